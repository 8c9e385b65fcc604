"""The MeshLinear op (engine/wafer/mesh_op.c): arithmetic against numpy for every row/column
blocking path, tiles fed at run time, clear errors, thread counts, and the fallback to standard
ONNX ops when the op cannot be built."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from engine import Engine
from engine.runtime import session_options
from engine.wafer import mesh_op
from engine.wafer.partition import TiledLinear, block_sizes


def _session(k_sizes, N, *, rank=2, const=True, threads=1, seed=0, transposed=False, bias=None):
    """A graph with one MeshLinear over len(k_sizes) lines; returns (session, weight [K, N]).

    ``const=False`` feeds the weights at run time (graph inputs, shapes left open, so the op itself
    checks them): ``shape``, then ``w0``, ``w1``, ... (packed panels) or ``table`` (transposed)."""
    rng = np.random.default_rng(seed)
    K = sum(k_sizes)
    w = rng.standard_normal((K, N)).astype(np.float32)
    shape, packed = mesh_op.float_node_inputs(w, k_sizes)
    arrays = {"shape": shape}
    if transposed:
        arrays["table"] = np.ascontiguousarray(w.T)
    else:
        arrays.update({f"w{p}": t for p, t in enumerate(packed)})
    if bias is not None:
        arrays["bias"] = bias
    kdim = K if const else "K"
    x_shape = ["T", kdim] if rank == 2 else [1, "T", kdim]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)]
    inits = []
    for name, a in arrays.items():
        if const:
            inits.append(numpy_helper.from_array(a, name))
        else:
            dtype = TensorProto.INT64 if name == "shape" else TensorProto.FLOAT
            dims = [f"{name}{i}" for i in range(a.ndim)]
            inputs.append(helper.make_tensor_value_info(name, dtype, dims))
    attrs = {"transposed": 1} if transposed else {}
    node = helper.make_node(mesh_op.OP, ["x", *arrays], ["y"], domain=mesh_op.DOMAIN, **attrs)
    graph = helper.make_graph(
        [node], "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(mesh_op.DOMAIN, 1)]
    )
    model.ir_version = 8
    so = session_options(threads, custom_ops=(mesh_op.library(),))
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    sess.arrays = arrays
    return sess, w


@pytest.fixture(scope="module", autouse=True)
def _op_built():
    if mesh_op.library() is None:  # CI has a compiler; say why if this machine does not
        pytest.fail(f"MeshLinear op unavailable: {mesh_op.why_not()}")


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("T", [1, 2, 3, 4, 5, 9, 17, 70])
@pytest.mark.parametrize(
    "k_sizes,N",
    [
        ([128, 128], 512),
        ([13, 13, 11], 29),
        ([64], 64),
        ([40, 40, 40, 39], 65),
        ([100, 100], 130),
        ([1, 1], 1),
    ],
)
def test_matches_numpy(T, k_sizes, N, transposed):
    sess, w = _session(k_sizes, N, transposed=transposed)
    x = np.random.default_rng(T).standard_normal((T, sum(k_sizes))).astype(np.float32)
    np.testing.assert_allclose(sess.run(None, {"x": x})[0], x @ w, atol=2e-4, rtol=1e-5)


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
def test_3d_input_and_threads(threads, transposed):
    """[1, T, K] activations (the decoder's form) and a linear big enough to be split into tasks."""
    sess, w = _session([256, 256], 2000, rank=3, threads=threads, transposed=transposed)
    x = np.random.default_rng(1).standard_normal((1, 7, 512)).astype(np.float32)
    y = sess.run(None, {"x": x})[0]
    assert y.shape == (1, 7, 2000)
    np.testing.assert_allclose(y, x @ w, atol=3e-4, rtol=1e-5)


@pytest.mark.parametrize("const", [True, False])
@pytest.mark.parametrize("transposed", [False, True])
def test_bias_is_added_after_the_reduction(transposed, const):
    """An optional last input: the op adds the bias after the chain, as an Add node would."""
    bias = np.random.default_rng(4).standard_normal(70).astype(np.float32)
    plain, _ = _session([30, 33], 70, transposed=transposed, const=const)
    biased, _ = _session([30, 33], 70, transposed=transposed, const=const, bias=bias)
    x = np.random.default_rng(5).standard_normal((7, 63)).astype(np.float32)
    y = plain.run(None, {"x": x, **({} if const else plain.arrays)})[0]
    got = biased.run(None, {"x": x, **({} if const else biased.arrays)})[0]
    np.testing.assert_array_equal(got, y + bias)
    if not const:
        with pytest.raises(Exception, match=r"MeshLinear: bias must be a float tensor \[70\]"):
            biased.run(None, {"x": x, **biased.arrays, "bias": np.ones(71, np.float32)})


def test_pack_float_layout():
    """Panel q, row k, lane c holds W[k, 64q + c]; columns past N are zero."""
    w = np.arange(3 * 70, dtype=np.float32).reshape(3, 70)
    packed = mesh_op.pack_float(w)
    assert packed.shape == (2, 3, 64)
    assert packed[1, 2, 5] == w[2, 69] and packed[0, 1, 63] == w[1, 63]
    assert not packed[1, :, 6:].any()


@pytest.mark.parametrize("transposed", [False, True])
def test_weights_fed_at_run_time(transposed):
    """Weights that are graph inputs rather than initializers are read in place per call."""
    sess, w = _session([5, 7], 33, const=False, transposed=transposed)
    x = np.random.default_rng(2).standard_normal((3, 12)).astype(np.float32)
    np.testing.assert_allclose(
        sess.run(None, {"x": x, **sess.arrays})[0], x @ w, atol=1e-4, rtol=1e-5
    )


def test_bad_shapes_give_clear_errors_and_the_session_lives_on():
    sess, w = _session([5, 7], 33, const=False)
    x = np.ones((2, 12), np.float32)
    good = {"x": x, **sess.arrays}
    with pytest.raises(
        Exception, match="MeshLinear: x has 11 features but the lines' K extents sum to 12"
    ):
        sess.run(None, {**good, "x": np.ones((2, 11), np.float32)})
    with pytest.raises(
        Exception, match=r"MeshLinear: line 1's tiles must be a float tensor \[1, 7, 64\]"
    ):
        sess.run(None, {**good, "w1": np.ones((1, 7, 32), np.float32)})
    with pytest.raises(Exception, match="MeshLinear: shape names 3 lines, so expected x, shape"):
        sess.run(None, {**good, "shape": np.array([33, 4, 4, 4], np.int64)})
    np.testing.assert_allclose(sess.run(None, good)[0], x @ w, atol=1e-4, rtol=1e-5)
    tsess, _ = _session([5, 7], 33, const=False, transposed=True)
    with pytest.raises(
        Exception, match=r"MeshLinear: the transposed weight must be a float tensor \[33, 12\]"
    ):
        tsess.run(None, {"x": x, **tsess.arrays, "table": np.ones((12, 33), np.float32)})


def test_emitter_stores_one_tile_initializer_per_mesh_line():
    from engine.graph import GraphBuilder

    gb = GraphBuilder()
    lin = TiledLinear((3, 5), form="op")
    lin.emit(
        gb,
        gb.input("x", TensorProto.FLOAT, ["T", 40]),
        np.zeros((40, 9), np.float32),
        name="l",
        role="o",
    )
    (node,) = gb.nodes
    # o reduces over the mesh columns: 5 lines of K-blocks 8 (C = 5), output split over the 3 rows;
    # each line's tiles stored in the op's panels ([panels, rows, 64]), after the shape tensor.
    tiles = [t for t in gb.initializers if t.name != "l.mesh_shape"]
    assert [list(t.dims) for t in tiles] == [[1, k, 64] for k in block_sizes(40, 5)]
    assert lin.accepts_3d
    assert list(node.input[1:]) == ["l.mesh_shape", *(f"l.col{p}" for p in range(5))]
    assert (
        TiledLinear((2, 2), form="op").cache_key() != TiledLinear((2, 2), form="graph").cache_key()
    )


def test_fallback_when_the_op_cannot_be_built(monkeypatch, tmp_path, tiny_models):
    """No compiler / disabled / a failing build or self-test: the engine still runs, on the
    standard-op form."""
    try:
        monkeypatch.setenv("SPARK_LSP_MESH_OP", "0")
        mesh_op.reset()
        assert mesh_op.library() is None and "SPARK_LSP_MESH_OP" in mesh_op.why_not()
        assert TiledLinear().form == "graph" and TiledLinear().custom_op_libraries == ()
        with pytest.raises(ValueError, match="MeshLinear op is unavailable"):
            TiledLinear(form="op")
        eng = Engine.load(tiny_models["llama"], cache_dir=tmp_path / "graphs", threads=1)
        assert eng.linear.form == "graph" and eng.runtime.custom_ops == ()
        assert len(eng.forward_logits([1, 2, 3])) == 3

        monkeypatch.delenv("SPARK_LSP_MESH_OP")
        monkeypatch.setattr(mesh_op, "_compiler", lambda: None)
        mesh_op.reset()
        assert mesh_op.library() is None and "no C compiler" in mesh_op.why_not()

        monkeypatch.undo()

        def broken(path):
            raise RuntimeError("self-test: max error 9")

        monkeypatch.setattr(mesh_op, "_self_test", broken)
        mesh_op.reset()
        assert mesh_op.library() is None and "self-test: max error 9" in mesh_op.why_not()

        monkeypatch.undo()
        bad = tmp_path / "bad.c"
        bad.write_text("this is not C\n")
        monkeypatch.setattr(mesh_op, "SOURCE", bad)
        monkeypatch.setenv("SPARK_LSP_CACHE", str(tmp_path / "cache"))
        mesh_op.reset()
        assert mesh_op.library() is None and mesh_op.why_not().startswith("build failed")
        assert not list((tmp_path / "cache" / "ops").glob("*.tmp"))  # no half-written files left
    finally:
        monkeypatch.undo()
        mesh_op.reset()
    assert mesh_op.library() is not None


def test_builds_into_the_cache_once(monkeypatch, tmp_path):
    try:
        monkeypatch.setenv("SPARK_LSP_CACHE", str(tmp_path))
        mesh_op.reset()
        path = mesh_op.library()
        assert path and path.startswith(str(tmp_path / "ops")) and path.endswith(".so")
        stamp = (tmp_path / "ops" / path.rsplit("/", 1)[1]).stat().st_mtime_ns
        mesh_op.reset()
        assert mesh_op.library() == path  # same source, compiler and CPU: reused, not rebuilt
        assert (tmp_path / "ops" / path.rsplit("/", 1)[1]).stat().st_mtime_ns == stamp
    finally:
        monkeypatch.undo()
        mesh_op.reset()
