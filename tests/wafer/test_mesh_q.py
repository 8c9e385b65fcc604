"""The MeshLinearQ op (engine/wafer/mesh_op.c): int8 / int4 partitioned linears against numpy for
every row/column blocking path, on both the VNNI and the AMX path (bit-identical to each other),
rows independent of the batch, weights fed at run time, clear errors, thread counts, the quantised
emitter on a grid, and the fallbacks to fused MatMulNBits."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from op_forms import OP_DEFAULT

from engine import Engine
from engine.generate import GenerationParams
from engine.graph import GraphBuilder
from engine.quant import QuantLinear, quantize_blockwise, unpack_codes
from engine.runtime import session_options
from engine.wafer import mesh_op
from engine.wafer.partition import TiledLinear


def _cpu_has_amx() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "amx_int8" in flags and "amx_tile" in flags


@pytest.fixture(params=["vnni", "amx"])
def kernel_path(request, monkeypatch):
    """Sessions made in the test take this MeshLinearQ path at every row count: the VNNI loop
    (``SPARK_LSP_AMX=0``) or AMX tiles (``SPARK_LSP_AMX_MIN_ROWS=1``; skipped on a CPU without
    AMX-INT8, but on one with it the path must be usable)."""
    if request.param == "vnni":
        monkeypatch.setenv("SPARK_LSP_AMX", "0")
    else:
        if not _cpu_has_amx():
            pytest.skip("this CPU has no AMX-INT8")
        assert mesh_op.amx(), "the CPU has AMX-INT8 but MeshLinearQ cannot use it"
        monkeypatch.delenv("SPARK_LSP_AMX", raising=False)
        monkeypatch.setenv("SPARK_LSP_AMX_MIN_ROWS", "1")
    return request.param


def _lines(k_sizes, N, bits, block, rng):
    """Random codes, scales and zero points per mesh line, in the natural layout."""
    lines = []
    for k in k_sizes:
        nb = -(-k // block)
        codes = rng.integers(0, 1 << bits, (N, nb * block)).astype(np.uint8)
        codes[:, k:] = 0  # a line's padding past its K extent
        scales = (rng.random((N, nb)) * 0.02 + 1e-3).astype(np.float32)
        lines.append(
            (
                codes,
                scales if bits == 8 else mesh_op.half_scales(scales),  # int4: half floats
                rng.integers(0, 1 << bits, (N, nb)).astype(np.uint8),
                k,
            )
        )
    return lines


def _session(lines, bits, block, *, rank=2, const=True, threads=1, bias=None):
    shape, packed = mesh_op.quantized_node_inputs(lines, bits)
    K = (
        int(shape[1:].sum()) if const else "K"
    )  # run-time weights: shapes left open, so the op checks them
    names, inits = ["x", "shape"], []
    inputs = [
        helper.make_tensor_value_info(
            "x", TensorProto.FLOAT, ["T", K] if rank == 2 else [1, "T", K]
        )
    ]
    arrays = (
        [("shape", shape)]
        + [
            (f"{w}{p}", a)
            for p, line in enumerate(packed)
            for w, a in zip(("codes", "scales", "zp"), line)
        ]
        + ([("bias", bias)] if bias is not None else [])
    )
    for name, a in arrays[1:] if not const else []:
        inputs.append(
            helper.make_tensor_value_info(
                name, helper.np_dtype_to_tensor_dtype(a.dtype), [None] * a.ndim
            )
        )
    for name, a in arrays:
        if const or name == "shape":
            inits.append(numpy_helper.from_array(a, name))
    names += [n for n, _ in arrays[1:]]
    node = helper.make_node(
        mesh_op.QOP, names, ["y"], domain=mesh_op.DOMAIN, bits=bits, block_size=block
    )
    graph = helper.make_graph(
        [node], "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(mesh_op.DOMAIN, 1)]
    )
    model.ir_version = 8
    so = session_options(threads, custom_ops=(mesh_op.library(),))
    feeds = {} if const else dict(arrays[1:])
    return ort.InferenceSession(
        model.SerializeToString(), so, providers=["CPUExecutionProvider"]
    ), feeds


def _close(y, want):
    scale = max(1e-6, float(np.abs(want).max()))
    assert float(np.abs(y - want).max()) / scale < 2e-6


@pytest.fixture(scope="module", autouse=True)
def _op_built():
    if not mesh_op.quantized():  # CI has a compiler; say why if this machine does not
        pytest.fail(f"MeshLinearQ op unavailable: {mesh_op.why_not_quantized()}")


@pytest.mark.parametrize("bits,block", [(8, 128), (8, 32), (4, 32), (4, 16)])
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
def test_matches_numpy(bits, block, T, k_sizes, N, kernel_path):
    rng = np.random.default_rng(T + N)
    lines = _lines(k_sizes, N, bits, block, rng)
    sess, _ = _session(lines, bits, block)
    x = rng.standard_normal((T, sum(k_sizes))).astype(np.float32)
    x[0, :3] = 0.0  # an all-zero block in some lines: scale 0, codes 0
    before = mesh_op.amx_tasks()
    _close(sess.run(None, {"x": x})[0], mesh_op.reference_quantized(x, lines, block))
    assert (mesh_op.amx_tasks() > before) == (kernel_path == "amx")


@pytest.mark.parametrize("bits,block", [(4, 256), (8, 256), (4, 512), (8, 512)])
@pytest.mark.parametrize("T", [1, 3])
def test_zero_points_at_the_largest_activation_sums(bits, block, T):
    """The zero point's correction, -zp * sum(a), is taken as 16-bit products for blocks of up
    to 256 weights (|sum(a)| <= 127 x 256 fits an int16) and as 32-bit ones beyond: activations
    that all quantise to +-127 give the largest sums either way."""
    rng = np.random.default_rng(block + bits + T)
    lines = _lines([2 * block, block], 70, bits, block, rng)
    sess, _ = _session(lines, bits, block)
    x = np.ones((T, 3 * block), np.float32)
    x[1:, block:] = -1.0
    x[0, -1] = -1.0
    _close(sess.run(None, {"x": x})[0], mesh_op.reference_quantized(x, lines, block))


@pytest.mark.parametrize("bits,block", [(8, 128), (8, 64), (8, 16), (4, 32), (4, 128), (4, 48)])
@pytest.mark.parametrize("T", [2, 4, 9, 16, 17, 33, 70])
@pytest.mark.parametrize("threads", [1, 2])
def test_amx_and_vnni_paths_are_bit_identical(bits, block, T, threads, monkeypatch):
    """The same exact integer dot products, scaled and summed in the same order: the AMX path
    gives the VNNI path's outputs bit for bit (ragged columns, uneven lines, a bias, passes of
    16 rows and a remainder), so a verification pass matches single steps whichever path runs."""
    if not _cpu_has_amx():
        pytest.skip("this CPU has no AMX-INT8")
    rng = np.random.default_rng(T * block + bits)
    lines = _lines([3 * block - 5, 2 * block, block + 1], 200, bits, block, rng)
    bias = rng.standard_normal(200).astype(np.float32)
    x = rng.standard_normal((T, 6 * block - 4)).astype(np.float32)
    x *= rng.uniform(0.1, 10, (T, 1)).astype(np.float32)
    monkeypatch.setenv("SPARK_LSP_AMX", "0")
    vnni, _ = _session(lines, bits, block, threads=threads, bias=bias)
    monkeypatch.delenv("SPARK_LSP_AMX")
    monkeypatch.setenv("SPARK_LSP_AMX_MIN_ROWS", "1")
    amx, _ = _session(lines, bits, block, threads=threads, bias=bias)
    before = mesh_op.amx_tasks()
    want = vnni.run(None, {"x": x})[0]
    assert mesh_op.amx_tasks() == before
    got = amx.run(None, {"x": x})[0]
    assert mesh_op.amx_tasks() > before
    np.testing.assert_array_equal(got, want)


def test_amx_takes_passes_from_the_default_row_count(monkeypatch):
    """By default a decode step (one row) stays on the VNNI path and a verification pass (9 rows)
    takes AMX where the CPU has it; SPARK_LSP_AMX=0 turns AMX off for sessions made after."""
    monkeypatch.delenv("SPARK_LSP_AMX", raising=False)
    monkeypatch.delenv("SPARK_LSP_AMX_MIN_ROWS", raising=False)
    rng = np.random.default_rng(12)
    lines = _lines([64, 64], 130, 4, 32, rng)
    x = rng.standard_normal((9, 128)).astype(np.float32)
    sess, _ = _session(lines, 4, 32)
    before = mesh_op.amx_tasks()
    sess.run(None, {"x": x[:1]})
    assert mesh_op.amx_tasks() == before
    sess.run(None, {"x": x})
    assert (mesh_op.amx_tasks() > before) == mesh_op.amx()
    assert mesh_op.amx() == _cpu_has_amx()
    monkeypatch.setenv("SPARK_LSP_AMX", "off")
    off, _ = _session(lines, 4, 32)
    before = mesh_op.amx_tasks()
    y = off.run(None, {"x": x})[0]
    assert mesh_op.amx_tasks() == before
    np.testing.assert_array_equal(y, sess.run(None, {"x": x})[0])


@pytest.mark.parametrize("const", [True, False])
@pytest.mark.parametrize("bits", [8, 4])
def test_bias_is_added_after_the_reduction(bits, const, kernel_path):
    """An optional last input: the op adds the bias after the chain, as an Add node would."""
    rng = np.random.default_rng(11)
    lines = _lines([40, 37], 70, bits, 16, rng)
    bias = rng.standard_normal(70).astype(np.float32)
    x = rng.standard_normal((5, 77)).astype(np.float32)
    plain, feeds = _session(lines, bits, 16, const=const)
    biased, bfeeds = _session(lines, bits, 16, const=const, bias=bias)
    y = plain.run(None, {"x": x, **feeds})[0]
    np.testing.assert_array_equal(biased.run(None, {"x": x, **bfeeds})[0], y + bias)
    if not const:
        with pytest.raises(Exception, match=r"MeshLinearQ: bias must be a float tensor \[70\]"):
            biased.run(None, {"x": x, **bfeeds, "bias": np.ones(69, np.float32)})


def test_quantised_activations_are_what_the_reference_says():
    """Round half to even, scale max|x|/127, zero blocks stay zero (the reference's own contract)."""
    x = np.array([[127.0, 0.5, -0.5, 1.5, -63.5] + [0.0] * 11], np.float32)
    q, s = mesh_op.quantize_activations(x, 16, 16)
    assert q[0, :5].tolist() == [127, 0, 0, 2, -64] and s[0, 0] == 1.0
    q, s = mesh_op.quantize_activations(np.zeros((1, 5), np.float32), 5, 16)
    assert not q.any() and s[0, 0] == 0 and q.shape == (1, 16)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("threads", [1, 2])
def test_3d_input_and_threads(bits, threads, kernel_path):
    """[1, T, K] activations (the decoder's form) and a linear big enough to be split into tasks."""
    rng = np.random.default_rng(1)
    lines = _lines([256, 256], 2000, bits, 32, rng)
    sess, _ = _session(lines, bits, 32, rank=3, threads=threads)
    x = rng.standard_normal((1, 7, 512)).astype(np.float32)
    y = sess.run(None, {"x": x})[0]
    assert y.shape == (1, 7, 2000)
    _close(y[0], mesh_op.reference_quantized(x[0], lines, 32))


@pytest.mark.parametrize("bits,block", [(8, 32), (8, 128), (4, 32)])
@pytest.mark.parametrize("T", [4, 9, 11, 19])
def test_rows_do_not_depend_on_the_batch(bits, block, T, kernel_path):
    """A batch of rows gives bit for bit the results of one row at a time (speculative
    verification relies on it): up to 16 rows, whose row groups take each block in turn
    (qpanel_rows), and more, which sweep each panel once per group of rows."""
    rng = np.random.default_rng(2 + T)
    lines = _lines([96 * block // 32, 96 * block // 32, 80], 200, bits, block, rng)
    sess, _ = _session(lines, bits, block)
    K = sum(k for *_, k in lines)
    x = rng.standard_normal((T, K)).astype(np.float32) * rng.uniform(0.1, 10, (T, 1)).astype(
        np.float32
    )
    batch = sess.run(None, {"x": x})[0]
    single = np.concatenate([sess.run(None, {"x": x[i : i + 1]})[0] for i in range(T)])
    assert np.array_equal(batch, single)


def test_weights_fed_at_run_time():
    rng = np.random.default_rng(3)
    lines = _lines([40, 37], 70, 8, 16, rng)
    sess, feeds = _session(lines, 8, 16, const=False)
    x = rng.standard_normal((3, 77)).astype(np.float32)
    _close(sess.run(None, {"x": x, **feeds})[0], mesh_op.reference_quantized(x, lines, 16))


def test_bad_shapes_give_clear_errors_and_the_session_lives_on():
    rng = np.random.default_rng(4)
    lines = _lines([40, 37], 70, 8, 16, rng)
    sess, good = _session(lines, 8, 16, const=False)
    x = rng.standard_normal((2, 77)).astype(np.float32)
    with pytest.raises(
        Exception, match="MeshLinearQ: x has 76 features but the lines' K extents sum to 77"
    ):
        sess.run(None, {"x": x[:, :76], **good})
    with pytest.raises(
        Exception, match=r"MeshLinearQ: line 1's scales must be a float tensor \[2, 3, 64\]"
    ):
        sess.run(None, {"x": x, **good, "scales1": np.ones((2, 4, 64), np.float32)})
    with pytest.raises(
        Exception, match=r"MeshLinearQ: line 0's codes must be a uint8 tensor \[2, 12, 256\]"
    ):
        sess.run(None, {"x": x, **good, "codes0": np.ones((2, 11, 256), np.uint8)})
    _close(sess.run(None, {"x": x, **good})[0], mesh_op.reference_quantized(x, lines, 16))


@pytest.mark.parametrize(
    "attrs,match",
    [
        ({"bits": 3, "block_size": 16}, "bits must be 8 or 4"),
        ({"bits": 8, "block_size": 24}, "block_size must be a multiple of 16"),
    ],
)
def test_bad_attributes_fail_the_load_clearly(attrs, match):
    rng = np.random.default_rng(5)
    shape, packed = mesh_op.quantized_node_inputs(_lines([32], 64, 8, 16, rng), 8)
    inits = [numpy_helper.from_array(shape, "shape")] + [
        numpy_helper.from_array(a, f"{n}0") for n, a in zip(("c", "s", "z"), packed[0])
    ]
    node = helper.make_node(
        mesh_op.QOP, ["x", "shape", "c0", "s0", "z0"], ["y"], domain=mesh_op.DOMAIN, **attrs
    )
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 32])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        inits,
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(mesh_op.DOMAIN, 1)]
    )
    model.ir_version = 8
    with pytest.raises(Exception, match=match):
        ort.InferenceSession(
            model.SerializeToString(),
            session_options(1, custom_ops=(mesh_op.library(),)),
            providers=["CPUExecutionProvider"],
        )


def test_pack_quantized_rejects_bad_shapes():
    with pytest.raises(ValueError, match="bits"):
        mesh_op.pack_quantized(
            np.zeros((4, 16), np.uint8), np.ones((4, 1)), np.zeros((4, 1), np.uint8), 2
        )
    with pytest.raises(ValueError, match="multiple of 16"):
        mesh_op.pack_quantized(
            np.zeros((4, 24), np.uint8), np.ones((4, 1)), np.zeros((4, 1), np.uint8), 8
        )


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize(
    "role,grid,K,N", [("qkv", (2, 2), 256, 96), ("down", (3, 2), 200, 33), ("o", (2, 5), 72, 130)]
)
def test_emitter_equals_fused_matmulnbits(bits, role, grid, K, N):
    """QuantLinear on a grid: the op computes what the fused MatMulNBits computes from the same
    per-tile weights (float summation order aside), one initializer triple per mesh line."""
    rng = np.random.default_rng(6)
    w = rng.standard_normal((K, N)).astype(np.float32) * 0.1
    x = rng.standard_normal((5, K)).astype(np.float32)
    outs, emitters = {}, {}
    for form in ("fused", "op"):
        gb = GraphBuilder()
        lin = emitters[form] = QuantLinear(bits, inner=TiledLinear(grid), form=form, block_size=16)
        y = lin.emit(gb, gb.input("x", TensorProto.FLOAT, ["s", K]), w, name="lin", role=role)
        gb.output(y, "y", TensorProto.FLOAT, ["s", N])
        sess = ort.InferenceSession(
            gb.to_model().SerializeToString(),
            session_options(1, custom_ops=lin.custom_op_libraries),
            providers=["CPUExecutionProvider"],
        )
        outs[form] = sess.run(None, {"x": x})[0]
        if form == "op":
            (node,) = [n for n in gb.nodes if n.domain == mesh_op.DOMAIN]
            lines = len(emitters[form].layout["lin"]["k_tiles"])
            assert node.op_type == mesh_op.QOP and len(node.input) == 2 + 3 * lines
            assert not any(n.op_type in ("MatMulNBits", "Split", "Sum") for n in gb.nodes)
    np.testing.assert_allclose(outs["op"], outs["fused"], atol=2e-5 * np.abs(outs["fused"]).max())
    # and it is the per-tile quantised weights' arithmetic
    parts = emitters["op"].layout["lin"]["k_tiles"]
    offs = np.cumsum([0] + parts)
    lines = []
    for p, k in enumerate(parts):
        qw = quantize_blockwise(w[offs[p] : offs[p + 1]], bits, 16)
        codes, zps = unpack_codes(qw)
        lines.append((codes, qw.scales, zps, k))
    _close(outs["op"], mesh_op.reference_quantized(x, lines, 16))
    assert emitters["op"].max_verify_tokens is None and emitters["fused"].max_verify_tokens == 1


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("bits", [8, 4])
def test_line_packing_in_column_chunks_equals_one_pass(bits, threads, monkeypatch):
    """The emitter quantises and packs a wide line a run of panels at a time (bounded memory for
    a 150k-column LM head), the runs spread over threads: the same arrays as quantising and
    packing it whole."""
    import engine.quant as quant

    rng = np.random.default_rng(bits)
    w = rng.standard_normal((48, 1000)).astype(np.float32)
    lin = QuantLinear(bits, TiledLinear((2, 2)), form="op")
    qw = quantize_blockwise(w, bits, 16)
    codes, zps = unpack_codes(qw)
    whole = mesh_op.pack_quantized(codes, qw.scales, zps, bits)
    monkeypatch.setenv("SPARK_LSP_BUILD_THREADS", str(threads))
    assert quant.quant_threads() == threads
    # 192-column runs (64 with 3 threads: each takes a third of the chunk), an uneven tail
    monkeypatch.setattr(quant, "QUANT_CHUNK", 48 * 64 * 3)
    for got, want in zip(lin._pack_line(w, 16), whole):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)


def test_emitter_form_choice_and_errors():
    # the default on a grid where MeshLinearQ has a vector loop (tests/op_forms.py)
    assert QuantLinear(8, inner=TiledLinear((2, 2))).form == ("op" if OP_DEFAULT else "fused")
    assert QuantLinear(8).form == "fused"  # no grid: nothing to partition
    assert QuantLinear(8, inner=TiledLinear((2, 2)), op="rowq").form == "fused"
    with pytest.raises(ValueError, match="inner must be a TiledLinear"):
        QuantLinear(8, form="op")
    with pytest.raises(ValueError, match="op='nbits'"):
        QuantLinear(8, inner=TiledLinear((2, 2)), form="op", op="rowq")
    with pytest.raises(ValueError, match="form"):
        QuantLinear(8, inner=TiledLinear((2, 2)), form="tiles")


@pytest.mark.parametrize("bits", [8, 4])
def test_engine_tokens_match_the_fused_form(tiny_models, tmp_path_factory, bits):
    """Greedy tokens of the partitioned quantised engine equal the fused one's on the tiny models;
    logits stay close (a flipped activation code moves a logit a little, never by much).  Both
    over a float32 KV cache: the fused form's GroupQueryAttention has no float16 one, and the
    linears are what is compared here."""
    cache = tmp_path_factory.getbasetemp() / "graph_cache_q"
    params = GenerationParams(max_new_tokens=24, ignore_eos=True)
    for arch in ("llama", "qwen2"):
        engines = {
            f: Engine.load(
                tiny_models[arch],
                cache_dir=cache,
                threads=1,
                linear=QuantLinear(bits, inner=TiledLinear((2, 2)), form=f),
                kv_cache="float32",
            )
            for f in ("fused", "op")
        }
        prompt = engines["op"].tokenizer.encode(
            "def fibonacci(n):\n    a, b = 0, 1\n    for i in range(n):\n"
        )
        got = {}
        for f, eng in engines.items():
            gen = eng.generate(prompt, params)
            gen.result()
            got[f] = (gen.tokens, eng.forward_logits(prompt))
        assert got["op"][0] == got["fused"][0], arch
        a, b = got["fused"][1], got["op"][1]
        assert np.abs(a - b).max() <= 0.05 * np.abs(a).max(), arch
        assert engines["op"].runtime.custom_ops == (mesh_op.library(),)


def test_fallback_when_the_quantised_op_fails(monkeypatch, tmp_path, tiny_models):
    """A failing MeshLinearQ self-test (or no op library at all): quantised engines use the fused
    MatMulNBits form, the float MeshLinear op stays, one warning says why."""
    try:

        def broken(path):
            raise RuntimeError("relative error 9")

        monkeypatch.setattr(mesh_op, "_self_test_quantized", broken)
        mesh_op.reset()
        assert mesh_op.library() is not None and not mesh_op.quantized()
        assert "relative error 9" in mesh_op.why_not_quantized()
        assert QuantLinear(8, inner=TiledLinear((2, 2))).form == "fused"
        with pytest.raises(ValueError, match="MeshLinearQ op is unavailable"):
            QuantLinear(8, inner=TiledLinear((2, 2)), form="op")
        eng = Engine.load(
            tiny_models["llama"], cache_dir=tmp_path / "graphs", threads=1, precision="int8"
        )
        assert eng.linear.form == "fused" and len(eng.forward_logits([1, 2, 3])) == 3

        monkeypatch.undo()
        monkeypatch.setenv("SPARK_LSP_MESH_OP", "0")
        mesh_op.reset()
        assert not mesh_op.quantized() and "SPARK_LSP_MESH_OP" in mesh_op.why_not_quantized()
        eng = Engine.load(
            tiny_models["llama"], cache_dir=tmp_path / "graphs", threads=1, precision="int4"
        )
        assert eng.linear.form == "fused" and eng.runtime.custom_ops == ()
        assert len(eng.forward_logits([1, 2, 3])) == 3
    finally:
        monkeypatch.undo()
        mesh_op.reset()
    assert mesh_op.quantized()


def test_fallback_logs_one_line(monkeypatch, caplog):
    try:
        monkeypatch.setattr(mesh_op, "_self_test_quantized", lambda path: 1 / 0)
        mesh_op.reset()
        with caplog.at_level("WARNING", logger=mesh_op.__name__):
            mesh_op.library()
            mesh_op.quantized()
            QuantLinear(8, inner=TiledLinear((2, 2)))
        lines = [r.getMessage() for r in caplog.records]
        assert (
            len(lines) == 1
            and "MeshLinearQ op unavailable" in lines[0]
            and "fused MatMulNBits" in lines[0]
        )
    finally:
        monkeypatch.undo()
        mesh_op.reset()
