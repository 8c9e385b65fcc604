"""What MeshLinear / MeshLinearQ take over around a linear.

The gated-MLP epilogue (attribute ``glu``): ``emit_gated`` nodes against numpy (fp32) and against
the unfused op followed by the activation and the product (int8 / int4, so the only difference is
where the gating runs), for one row (the GEMV / VNNI path) and many (multi-row passes, AMX where
the CPU has it), odd F, several mesh lines, with and without bias; the column order.

The RMSNorm prologue (attributes ``norm``, ``epsilon``): against the plain op fed rows normed in
numpy, with and without skip, the second output, with glu and the transposed head; errors.

And the decoder: node counts and logits against the unfused graph."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto
from op_forms import op_linear

from engine.graph import GraphBuilder, build_decoder
from engine.quant import QuantLinear
from engine.runtime import session_options
from engine.wafer import mesh_op
from engine.wafer.partition import TiledLinear


@pytest.fixture(scope="module", autouse=True)
def _op_built():
    if not mesh_op.quantized():  # CI has a compiler; say why if this machine does not
        pytest.fail(f"MeshLinearQ op unavailable: {mesh_op.why_not_quantized()}")


@pytest.fixture(params=["vnni", "amx"])
def kernel_path(request, monkeypatch):
    """MeshLinearQ sessions made in the test take the VNNI path, or AMX from one row (skipped
    where this machine has no AMX)."""
    if request.param == "vnni":
        monkeypatch.setenv("SPARK_LSP_AMX", "0")
    else:
        if not mesh_op.amx():
            pytest.skip("no AMX-INT8 here")
        monkeypatch.delenv("SPARK_LSP_AMX", raising=False)
        monkeypatch.setenv("SPARK_LSP_AMX_MIN_ROWS", "1")
    return request.param


def _act(kind: str, g: np.ndarray) -> np.ndarray:
    g = g.astype(np.float64)
    if kind == "silu":
        return g / (1.0 + np.exp(-g))
    return 0.5 * g * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (g + 0.044715 * g**3)))


def _run(build, x: np.ndarray, libs) -> np.ndarray:
    gb = GraphBuilder()
    y = build(gb, gb.input("x", TensorProto.FLOAT, ["s", x.shape[1]]))
    gb.output(y, "y", TensorProto.FLOAT, None)
    sess = ort.InferenceSession(
        gb.to_model().SerializeToString(),
        session_options(1, custom_ops=libs),
        providers=["CPUExecutionProvider"],
    )
    return sess.run(None, {"x": x})[0], gb


def _case(K: int, F: int, bias: bool, seed: int = 0):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((K, 2 * F)) * (2.0 / np.sqrt(K))).astype(np.float32)
    b = (rng.standard_normal(2 * F) * 0.5).astype(np.float32) if bias else None
    x = rng.standard_normal((19, K)).astype(np.float32)
    return w, b, x


def test_glu_columns_order():
    """Panel q: gate columns [32q, 32q + 32), then the same up columns; padding past F is -1."""
    cols = mesh_op.glu_columns(40)
    assert cols.shape == (128,)
    assert list(cols[:32]) == list(range(32)) and list(cols[32:64]) == list(range(40, 72))
    assert list(cols[64:72]) == list(range(32, 40)) and (cols[72:96] == -1).all()
    assert list(cols[96:104]) == list(range(72, 80)) and (cols[104:] == -1).all()
    a = np.arange(80, dtype=np.float32)
    np.testing.assert_array_equal(mesh_op.glu_interleave(a, 40), np.where(cols >= 0, cols, 0))
    with pytest.raises(ValueError, match="gate | up"):
        mesh_op.glu_interleave(a, 41)


@pytest.mark.parametrize("F", [1, 31, 32, 33, 100])
@pytest.mark.parametrize("order", ["C", "F"])
def test_glu_interleave_of_a_weight_in_either_layout(F, order):
    """Rows of [gate | up] columns, and a checkpoint's [out, in] weight seen as [K, 2F] (column
    major, which the interleave keeps): the columns of glu_columns' order, zeros in the padding."""
    w = np.random.default_rng(F).standard_normal((7, 2 * F)).astype(np.float32)
    w = np.asfortranarray(w) if order == "F" else w
    cols = mesh_op.glu_columns(F)
    want = np.where(cols >= 0, w[:, np.maximum(cols, 0)], 0)
    got = mesh_op.glu_interleave(w, F)
    np.testing.assert_array_equal(got, want)
    assert got.flags.f_contiguous == (order == "F")


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("grid,K,F", [((2, 2), 64, 96), ((3, 2), 70, 45), ((1, 1), 33, 1)])
@pytest.mark.parametrize("T", [1, 4, 19])
def test_float_matches_numpy(act, bias, grid, K, F, T):
    w, b, x = _case(K, F, bias)
    lin = TiledLinear(grid, form="op")
    y, gb = _run(
        lambda gb, xi: lin.emit_gated(gb, xi, w, name="gu", act=act, bias=b),
        x[:T],
        lin.custom_op_libraries,
    )
    h = x[:T].astype(np.float64) @ w + (0 if b is None else b)
    want = _act(act, h[:, :F]) * h[:, F:]
    assert y.shape == (T, F)
    np.testing.assert_allclose(y, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())
    (node,) = [n for n in gb.nodes if n.op_type != "Identity"]
    assert node.op_type == mesh_op.OP and lin.layout["gu"]["glu"] == act


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("grid,K,F", [((2, 2), 128, 96), ((3, 2), 96, 45), ((2, 2), 64, 7)])
@pytest.mark.parametrize("T", [1, 2, 5, 19])
def test_quantised_equals_the_unfused_op(bits, act, bias, grid, K, F, T, kernel_path):
    """The same codes and dot products as emit(role='gate_up'); only the gating moved: the
    difference is the activation's float rounding."""
    w, b, x = _case(K, F, bias, seed=bits)
    x = x[:T]
    lin = QuantLinear(bits, inner=TiledLinear(grid), form="op", block_size=16)
    fused, gb = _run(
        lambda gb, xi: lin.emit_gated(gb, xi, w, name="gu", act=act, bias=b),
        x,
        lin.custom_op_libraries,
    )
    (node,) = [n for n in gb.nodes if n.op_type != "Identity"]
    assert node.op_type == mesh_op.QOP
    h, _ = _run(
        lambda gb, xi: lin.emit(gb, xi, w, name="gu", role="gate_up", bias=b),
        x,
        lin.custom_op_libraries,
    )
    want = _act(act, h[:, :F]) * h[:, F:].astype(np.float64)
    assert fused.shape == (T, F)
    np.testing.assert_allclose(fused, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())


def test_rows_are_independent_and_3d_input_works(kernel_path):
    """A row's gated output does not depend on the batch; [1, S, K] input gives [1, S, F]."""
    w, b, x = _case(96, 50, True, seed=3)
    lin = QuantLinear(4, inner=TiledLinear((2, 2)), form="op", block_size=16)
    gb = GraphBuilder()
    y = lin.emit_gated(gb, gb.input("x", TensorProto.FLOAT, [1, "s", 96]), w, name="gu", act="silu")
    gb.output(y, "y", TensorProto.FLOAT, None)
    sess = ort.InferenceSession(
        gb.to_model().SerializeToString(),
        session_options(2, custom_ops=lin.custom_op_libraries),
        providers=["CPUExecutionProvider"],
    )
    many = sess.run(None, {"x": x[None]})[0]
    assert many.shape == (1, 19, 50)
    for t in (0, 7, 18):
        np.testing.assert_array_equal(
            sess.run(None, {"x": x[None, t : t + 1]})[0][0, 0], many[0, t]
        )


def test_emitters_that_cannot_return_none():
    """The standard-op form, rowq, fused MatMulNBits and an activation without an epilogue (erf
    GELU) keep the separate Split + activation + Mul."""
    w, _, _ = _case(32, 16, False)
    gb = GraphBuilder()
    x = gb.input("x", TensorProto.FLOAT, ["s", 32])
    for lin, act in [
        (TiledLinear((2, 2), form="graph"), "silu"),
        (TiledLinear((2, 2), form="op"), "gelu"),
        (TiledLinear((2, 2), form="op", roles=("qkv",)), "silu"),
        (QuantLinear(8, inner=TiledLinear((2, 2)), form="fused"), "silu"),
        (QuantLinear(8, inner=TiledLinear((2, 2)), op="rowq"), "silu"),
        (QuantLinear(8, inner=TiledLinear((2, 2)), form="op"), "gelu"),
    ]:
        assert lin.emit_gated(gb, x, w, name="gu", act=act) is None, (lin, act)
    assert not gb.nodes and not gb.initializers


def test_bad_glu_attribute_fails_the_load():
    from onnx import helper

    shape, lines = mesh_op.float_node_inputs(np.zeros((8, 64), np.float32), [8])
    shape[0] = 32
    node = helper.make_node(mesh_op.OP, ["x", "shape", "w0"], ["y"], domain=mesh_op.DOMAIN, glu=7)
    with pytest.raises(Exception, match="glu must be"):
        mesh_op._run_node(
            mesh_op.library(),
            node,
            np.zeros((1, 8), np.float32),
            [
                __import__("onnx").numpy_helper.from_array(shape, "shape"),
                __import__("onnx").numpy_helper.from_array(lines[0], "w0"),
            ],
        )


@pytest.mark.parametrize("precision", ["fp32", "int8", "int4"])
@pytest.mark.parametrize("hidden", [("emit_gated",), ("fuses_norm",), ("emit_gated", "fuses_norm")])
def test_decoder_drops_the_fused_nodes_and_keeps_its_outputs(tiny_models, precision, hidden):
    """build_decoder with emit_gated and the norm prologue against the same emitter with either
    or both hidden: no Split / Sigmoid / Mul after gate_up (4 nodes per layer), no norm nodes
    (2 per layer and the final one), and the logits of the unfused graph to float rounding."""
    from engine.config import load_config
    from engine.weights import load_weights

    path = tiny_models["llama"]
    config = load_config(path)
    weights = load_weights(path, config)

    class Unfused:
        """The same emitter without some of its fusions (what an emitter lacking them emits)."""

        def __init__(self, inner):
            self._inner = inner

        def __getattr__(self, name):
            if name in hidden:
                raise AttributeError(name)
            return getattr(self._inner, name)

    models = {}
    for kind in ("fused", "unfused"):
        lin = op_linear(precision, grid=(2, 2))
        models[kind] = (
            build_decoder(config, weights, lin if kind == "fused" else Unfused(lin), max_len=64),
            lin.custom_op_libraries,
        )
    counts = {k: len(m.graph.node) for k, (m, _) in models.items()}
    L = config.num_hidden_layers
    # Split, Sigmoid, Mul (SiLU) and Mul (gating) per layer; ORT fuses the SiLU into one node
    want = (4 * L if "emit_gated" in hidden else 0) + (2 * L + 1 if "fuses_norm" in hidden else 0)
    assert counts["unfused"] - counts["fused"] == want
    ops = [n.op_type for n in models["fused"][0].graph.node]
    assert not {"Split", "Sigmoid", "SimplifiedLayerNormalization"} & set(ops)
    assert "SkipSimplifiedLayerNormalization" not in ops
    outs = {}
    for kind, (model, libs) in models.items():
        sess = ort.InferenceSession(
            model.SerializeToString(),
            session_options(1, custom_ops=libs),
            providers=["CPUExecutionProvider"],
        )
        ids = np.array([[1, 5, 9, 2, 7, 3]], np.int64)
        feeds = {
            "input_ids": ids,
            "seqlens_k": np.array([ids.shape[1] - 1], np.int32),
            "total_sequence_length": np.array(ids.shape[1], np.int32),
            "logits_from": np.array([0], np.int64),
        }
        for i in sess.get_inputs():
            if i.name.startswith("past."):
                shape = [1, config.num_key_value_heads, 64, i.shape[3]]
                feeds[i.name] = np.zeros(shape, np.float32)
        outs[kind] = sess.run(["logits"], feeds)[0]
    a, b = outs["unfused"], outs["fused"]
    assert np.abs(a - b).max() <= 1e-4 * np.abs(a).max()
    assert (a.argmax(-1) == b.argmax(-1)).all()


# -- the RMSNorm prologue (attribute norm) --------------------------------------------------------


def _rms(s: np.ndarray, gamma: np.ndarray, eps: float) -> np.ndarray:
    s = s.astype(np.float64)
    return s / np.sqrt((s * s).mean(-1, keepdims=True) + eps) * gamma


def _norm_graph(emit, K: int, skip: bool, keep_sum: bool, gamma: np.ndarray, eps: float):
    """A graph x[, skip] -> emit(..., norm=NormInput) with outputs y[, sum]."""
    from engine.graph import NormInput

    gb = GraphBuilder()
    x = gb.input("x", TensorProto.FLOAT, ["s", K])
    s = gb.input("skip", TensorProto.FLOAT, ["s", K]) if skip else None
    g = gb.initializer("gamma", gamma)
    y, total = emit(gb, x, NormInput(g, eps, skip=s, keep_sum=keep_sum))
    gb.output(y, "y", TensorProto.FLOAT, None)
    if total is not None:
        gb.output(total, "sum", TensorProto.FLOAT, None)
    return gb


def _run_graph(gb, libs, feeds, threads=1):
    sess = ort.InferenceSession(
        gb.to_model().SerializeToString(),
        session_options(threads, custom_ops=libs),
        providers=["CPUExecutionProvider"],
    )
    return sess.run(None, feeds)


@pytest.mark.parametrize("precision", ["fp32", "int8", "int4"])
@pytest.mark.parametrize("skip,keep_sum", [(True, True), (True, False), (False, False)])
@pytest.mark.parametrize("T", [1, 4, 19])
def test_norm_prologue_matches_the_separate_norm(precision, skip, keep_sum, T, kernel_path):
    """emit(norm=...) equals the plain op fed the rows normed in numpy (and, fp32, numpy's
    product) to float rounding; the second output is x + skip exactly."""

    K, N, eps = 96, 70, 1e-5
    rng = np.random.default_rng(T)
    w = (rng.standard_normal((K, N)) / np.sqrt(K)).astype(np.float32)
    gamma = (1.0 + 0.1 * rng.standard_normal(K)).astype(np.float32)
    x = rng.standard_normal((T, K)).astype(np.float32)
    sk = rng.standard_normal((T, K)).astype(np.float32)
    lin = op_linear(precision, grid=(3, 2))
    assert lin.fuses_norm
    gb = _norm_graph(
        lambda gb, xi, norm: lin.emit(gb, xi, w, name="qkv", role="qkv", norm=norm),
        K,
        skip,
        keep_sum,
        gamma,
        eps,
    )
    feeds = {"x": x, **({"skip": sk} if skip else {})}
    outs = _run_graph(gb, lin.custom_op_libraries, feeds)
    total = x + sk if skip else x
    normed = _rms(total, gamma, eps).astype(np.float32)
    plain, _ = _run(
        lambda gb, xi: lin.emit(gb, xi, w, name="qkv", role="qkv"), normed, lin.custom_op_libraries
    )
    assert len(outs) == (2 if keep_sum else 1)
    if keep_sum:
        np.testing.assert_array_equal(outs[1], total)
    if precision == "fp32":
        np.testing.assert_allclose(outs[0], normed.astype(np.float64) @ w, rtol=1e-4, atol=1e-5)
    # (with these inputs no activation code rounds the other way: float rounding only)
    assert float(np.abs(outs[0] - plain).max()) <= 1e-5 * float(np.abs(plain).max())


@pytest.mark.parametrize("precision", ["fp32", "int4"])
def test_norm_prologue_with_glu_and_the_tied_head(precision):
    """The prologue composes with the glu epilogue (gate_up) and, fp32, the transposed head."""

    K, F, V, eps = 64, 40, 300, 1e-6
    rng = np.random.default_rng(11)
    w, b, x = _case(K, F, True, seed=5)
    x = x[:5]
    sk = rng.standard_normal(x.shape).astype(np.float32)
    gamma = (1.0 + 0.1 * rng.standard_normal(K)).astype(np.float32)
    lin = op_linear(precision, grid=(2, 2))
    gb = _norm_graph(
        lambda gb, xi, norm: lin.emit_gated(gb, xi, w, name="gu", act="silu", bias=b, norm=norm),
        K,
        True,
        True,
        gamma,
        eps,
    )
    y, total = _run_graph(gb, lin.custom_op_libraries, {"x": x, "skip": sk})
    normed = _rms(x + sk, gamma, eps).astype(np.float32)
    plain, _ = _run(
        lambda gb, xi: lin.emit_gated(gb, xi, w, name="gu", act="silu", bias=b),
        normed,
        lin.custom_op_libraries,
    )
    np.testing.assert_array_equal(total, x + sk)
    assert float(np.abs(y - plain).max()) <= 1e-5 * float(np.abs(plain).max())
    if precision == "fp32":
        table = rng.standard_normal((V, K)).astype(np.float32)

        def head(gb, xi, norm):
            t = gb.initializer("table", table)
            return lin.emit_tied(gb, xi, t, (V, K), name="lm_head", norm=norm)

        gb = _norm_graph(head, K, True, False, gamma, eps)
        (logits,) = _run_graph(gb, lin.custom_op_libraries, {"x": x, "skip": sk}, threads=2)
        np.testing.assert_allclose(
            logits, normed.astype(np.float64) @ table.T.astype(np.float64), rtol=1e-4, atol=1e-4
        )


def test_norm_needs_an_emitter_that_fuses_it():
    from engine.graph import NormInput

    w, _, _ = _case(32, 16, False)
    gb = GraphBuilder()
    x = gb.input("x", TensorProto.FLOAT, ["s", 32])
    norm = NormInput("gamma", 1e-6)
    for lin in (
        TiledLinear((2, 2), form="graph"),
        QuantLinear(8, inner=TiledLinear((2, 2)), form="fused"),
    ):
        assert not lin.fuses_norm
        with pytest.raises(ValueError, match="does not fuse norms"):
            lin.emit(gb, x, w, name="qkv", role="qkv", norm=norm)


def test_bad_norm_inputs_give_clear_errors():
    """A skip of another shape or a gamma of the wrong size fails the run with the op's message,
    and the session lives on."""
    from engine.graph import NormInput

    K = 32
    w, _, x = _case(K, 24, False)
    lin = TiledLinear((2, 2), form="op")
    gb = GraphBuilder()
    xi = gb.input("x", TensorProto.FLOAT, ["s", K])
    si = gb.input("skip", TensorProto.FLOAT, ["t", K])
    g = gb.initializer("gamma", np.ones(K, np.float32))
    y, total = lin.emit(gb, xi, w, name="qkv", role="qkv", norm=NormInput(g, 1e-6, skip=si))
    gb.output(y, "y", TensorProto.FLOAT, None)
    gb.output(total, "sum", TensorProto.FLOAT, None)
    sess = ort.InferenceSession(
        gb.to_model().SerializeToString(),
        session_options(1, custom_ops=lin.custom_op_libraries),
        providers=["CPUExecutionProvider"],
    )
    with pytest.raises(Exception, match="skip must be a float tensor of x's shape"):
        sess.run(None, {"x": x[:3], "skip": x[:2]})
    y, _ = sess.run(None, {"x": x[:3], "skip": x[:3]})
    assert y.shape == (3, 48)
