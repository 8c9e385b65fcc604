"""The op library's code paths for CPUs other than this one (engine/wafer/mesh_op.c).

``mesh_op.c`` picks its inner loops when it is compiled: AVX-512 (and VNNI, AMX) where the
compiler targets them, AVX2 for MeshLinearQ's integer loop, GCC vector extensions and plain C
otherwise.  ``library()`` builds for
this CPU, so the other tests only run the paths this machine's compiler picks.  Here the library
is built (:func:`mesh_op.build`, once per session) for ``-march=x86-64-v3`` (AVX2 + FMA: most
laptops, AMD Zen 2/3) and ``-march=x86-64`` (SSE2, no FMA: the portable C that ARM also builds),
and the same checks run against each build, through the other test files' helpers with
``mesh_op.library`` pointed at it: the three load-time self-tests, fp32 MeshLinear (uneven
lines, odd K and N, the glu epilogue, the RMSNorm prologue), MeshLinearQ at 8 and 4 bits (one
and several rows, block sizes, mesh lines; rows independent of the batch, and the native build's
outputs, bit for bit),
DecoderAttention (prefill and decode, GQA groups, head sizes 64 and 128, the last positions of
the buffer, a float16 cache and its rounding) and a tiny model's greedy tokens against the native build's.

x86 only: on another architecture ``library()`` already builds the portable C."""

from __future__ import annotations

import ctypes
import platform
import shutil
import subprocess

import numpy as np
import pytest
import test_mesh_attention as attn_t
import test_mesh_fusions as fusions_t
import test_mesh_op as float_t
import test_mesh_q as q_t
from op_forms import op_linear

from engine import Engine, cpu
from engine.generate import GenerationParams
from engine.quant import QuantLinear
from engine.wafer import mesh_op
from engine.wafer.partition import TiledLinear

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        platform.machine().lower() not in ("x86_64", "amd64"),
        reason="x86 targets; elsewhere library() builds the portable C the other tests run",
    ),
]

#: target -> (predefined macros it must have, macros it must not have)
TARGETS = {
    "x86-64-v3": ({"__AVX2__", "__FMA__"}, {"__AVX512F__", "__AVX512VNNI__", "__AMX_TILE__"}),
    "x86-64": (set(), {"__AVX__", "__FMA__", "__AVX512F__", "__AVX512VNNI__", "__AMX_TILE__"}),
}


def _macros(cc: str, arch: str) -> set[str]:
    out = subprocess.run(
        [cc, f"-march={arch}", "-dM", "-E", "-"],
        input="",
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return {line.split()[1] for line in out.splitlines() if line.startswith("#define ")}


@pytest.fixture(scope="session")
def _builds(tmp_path_factory) -> dict[str, str]:
    """Each target compiled once per session (checked free of AVX-512 code)."""
    cc = mesh_op._compiler()
    if cc is None:
        pytest.fail("no C compiler")
    out = tmp_path_factory.mktemp("mesh_portable")
    paths = {}
    for arch, (have, lack) in TARGETS.items():
        macros = _macros(cc, arch)
        assert have <= macros and not lack & macros, arch
        path = mesh_op.build(out / f"mesh_op-{arch}.so", [f"-march={arch}"])
        if shutil.which("objdump"):  # no AVX-512 register in the machine code
            asm = subprocess.run(
                ["objdump", "-d", str(path)], capture_output=True, text=True, check=True
            ).stdout
            assert "%zmm" not in asm and "%k1" not in asm, arch
            if arch == "x86-64":
                assert "%ymm" not in asm, arch
            # a float16 KV cache: F16C's conversions on AVX2, the portable rounding without
            assert ("vcvtph2ps" in asm and "vcvtps2ph" in asm) == (arch != "x86-64"), arch
            symbols = subprocess.run(
                ["objdump", "-T", str(path)], capture_output=True, text=True, check=True
            ).stdout
            if "fmaf" in symbols:  # no FMA instruction: libm's, linked (not left to the host)
                needed = subprocess.run(
                    ["objdump", "-p", str(path)], capture_output=True, text=True, check=True
                ).stdout
                assert "libm.so" in needed, arch
        paths[arch] = str(path)
    return paths


@pytest.fixture(params=list(TARGETS))
def lib(request, _builds, monkeypatch) -> str:
    """``mesh_op.library()`` (what the emitters and the helpers load) returns this target's
    build for the test; the native library's self-test results and ctypes handle (:func:`vnni`:
    the quantised emitters keep the op form) stand for the rest."""
    native = mesh_op.library()
    assert native is not None and mesh_op.quantized() and mesh_op.attention(), mesh_op.why_not()
    mesh_op._native()  # ctypes' copy stays the native library's (amx(), qloop(), amx_tasks())
    path = _builds[request.param]
    monkeypatch.setattr(mesh_op, "library", lambda: path)
    monkeypatch.setenv("SPARK_LSP_AMX", "0")  # (these builds have no AMX path anyway)
    return path


def test_each_build_says_which_quantised_loop_it_has(lib, request):
    """spark_mesh_vnni / spark_mesh_avx2 say which MeshLinearQ loop was compiled (QuantLinear's
    default form follows :func:`mesh_op.qloop`): the AVX2 loop for x86-64-v3, the portable one
    for x86-64; this machine's own build has the loop its CPU flags allow."""
    arch = request.node.callspec.params["lib"]
    built = ctypes.CDLL(lib)
    assert built.spark_mesh_vnni() == 0
    assert built.spark_mesh_avx2() == (arch == "x86-64-v3")
    if shutil.which("objdump"):  # the AVX2 loop's int8 x uint8 products are in the machine code
        asm = subprocess.run(["objdump", "-d", lib], capture_output=True, text=True).stdout
        assert ("vpmaddubsw" in asm) == (arch == "x86-64-v3"), arch
    flags = cpu.cpu_flags()
    want = (
        "vnni"
        if {"avx512_vnni", "avx512bw"} <= flags
        else "avx2"
        if cpu.AVX2_FLAGS <= flags
        else "portable"
    )
    assert mesh_op.qloop() == want


def test_quantlinear_defaults_to_matmulnbits_without_a_vector_loop(monkeypatch):
    """Where MeshLinearQ would run its portable loops the quantised emitter on a grid defaults to
    fused MatMulNBits (ONNX Runtime's vectorised kernels); form="op" can still be asked for."""
    monkeypatch.setattr(mesh_op, "qloop", lambda: "portable")
    assert QuantLinear(8, inner=TiledLinear((2, 2))).form == "fused"
    assert QuantLinear(4, inner=TiledLinear((2, 2)), form="op").form == "op"
    for loop in ("vnni", "avx2"):
        monkeypatch.setattr(mesh_op, "qloop", lambda loop=loop: loop)
        assert QuantLinear(4, inner=TiledLinear((2, 2))).form == "op"


def test_self_tests_pass(lib):
    mesh_op._self_test(lib)
    mesh_op._self_test_quantized(lib)
    mesh_op._self_test_attention(lib)


# -- MeshLinear (fp32) -----------------------------------------------------------------------------


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("T", [1, 3, 4, 9, 70])
@pytest.mark.parametrize(
    "k_sizes,N", [([128, 128], 512), ([13, 13, 11], 29), ([40, 40, 40, 39], 65), ([1, 1], 1)]
)
def test_float_matches_numpy(lib, T, k_sizes, N, transposed):
    sess, w = float_t._session(k_sizes, N, transposed=transposed)
    x = np.random.default_rng(T).standard_normal((T, sum(k_sizes))).astype(np.float32)
    np.testing.assert_allclose(sess.run(None, {"x": x})[0], x @ w, atol=2e-4, rtol=1e-5)


@pytest.mark.parametrize("transposed", [False, True])
def test_float_3d_input_and_two_threads(lib, transposed):
    sess, w = float_t._session([256, 256], 2000, rank=3, threads=2, transposed=transposed)
    x = np.random.default_rng(1).standard_normal((1, 7, 512)).astype(np.float32)
    np.testing.assert_allclose(sess.run(None, {"x": x})[0], x @ w, atol=3e-4, rtol=1e-5)


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("grid,K,F,bias", [((2, 2), 64, 96, True), ((3, 2), 70, 45, False)])
@pytest.mark.parametrize("T", [1, 19])
def test_float_glu_matches_numpy(lib, act, grid, K, F, bias, T):
    w, b, x = fusions_t._case(K, F, bias)
    lin = TiledLinear(grid, form="op")
    assert lin.custom_op_libraries == (lib,)
    y, _ = fusions_t._run(
        lambda gb, xi: lin.emit_gated(gb, xi, w, name="gu", act=act, bias=b),
        x[:T],
        lin.custom_op_libraries,
    )
    h = x[:T].astype(np.float64) @ w + (0 if b is None else b)
    want = fusions_t._act(act, h[:, :F]) * h[:, F:]
    np.testing.assert_allclose(y, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())


@pytest.mark.parametrize("precision", ["fp32", "int8", "int4"])
@pytest.mark.parametrize("T", [1, 19])
def test_norm_prologue_matches_the_separate_norm(lib, precision, T):
    """The RMSNorm prologue with the skip add and its second output."""
    fusions_t.test_norm_prologue_matches_the_separate_norm(precision, True, True, T, "vnni")


# -- MeshLinearQ ----------------------------------------------------------------------------------


@pytest.mark.parametrize("bits,block", [(8, 128), (8, 32), (4, 32), (4, 16)])
@pytest.mark.parametrize("T", [1, 3, 9])
@pytest.mark.parametrize(
    "k_sizes,N", [([128, 128], 512), ([13, 13, 11], 29), ([40, 40, 40, 39], 65), ([1, 1], 1)]
)
def test_quantized_matches_numpy(lib, bits, block, T, k_sizes, N):
    rng = np.random.default_rng(T + N)
    lines = q_t._lines(k_sizes, N, bits, block, rng)
    sess, _ = q_t._session(lines, bits, block)
    x = rng.standard_normal((T, sum(k_sizes))).astype(np.float32)
    x[0, :3] = 0.0  # an all-zero block in some lines
    q_t._close(sess.run(None, {"x": x})[0], mesh_op.reference_quantized(x, lines, block))


@pytest.mark.parametrize("bits,block", [(8, 128), (8, 32), (4, 32), (4, 16)])
@pytest.mark.parametrize("T", [1, 9])
def test_quantized_is_bit_identical_to_the_native_build(lib, bits, block, T, monkeypatch):
    """The portable loop computes the VNNI (and AMX) path's exact integer dot products, scaled
    and summed in the same order: the same outputs bit for bit (ragged columns, uneven lines, a
    bias), so a quantised model gives the same logits on every CPU."""
    rng = np.random.default_rng(T * block + bits)
    lines = q_t._lines([3 * block - 5, 2 * block, block + 1], 200, bits, block, rng)
    bias = rng.standard_normal(200).astype(np.float32)
    x = rng.standard_normal((T, 6 * block - 4)).astype(np.float32)
    x *= rng.uniform(0.1, 10, (T, 1)).astype(np.float32)
    got = q_t._session(lines, bits, block, bias=bias)[0].run(None, {"x": x})[0]
    monkeypatch.undo()
    monkeypatch.setenv("SPARK_LSP_AMX", "0")
    want = q_t._session(lines, bits, block, bias=bias)[0].run(None, {"x": x})[0]
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("bits,block", [(8, 128), (4, 32)])
@pytest.mark.parametrize("T", [9, 19])
def test_quantized_rows_do_not_depend_on_the_batch(lib, bits, block, T):
    q_t.test_rows_do_not_depend_on_the_batch(bits, block, T, "vnni")


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_3d_input_and_two_threads(lib, bits):
    q_t.test_3d_input_and_threads(bits, 2, "vnni")


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("T", [1, 5])
def test_quantized_glu_equals_the_unfused_op(lib, bits, act, T):
    fusions_t.test_quantised_equals_the_unfused_op(bits, act, True, (3, 2), 96, 45, T, "vnni")


# -- DecoderAttention -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "heads,kv_heads,H", [(8, 4, 32), (14, 2, 64), (7, 1, 16), (4, 4, 128), (16, 2, 128)]
)
@pytest.mark.parametrize("S,past", [(1, 0), (1, 37), (9, 5), (64, 0), (17, 300)])
@pytest.mark.parametrize("split", [False, True])
def test_attention_matches_numpy_and_gqa(lib, heads, kv_heads, H, S, past, split):
    max_len = 400
    x, pk, pv, cos, sin = mesh_op.attention_inputs(S, past, heads, kv_heads, H, max_len, seed=S)
    feeds = attn_t._feeds(x, pk, pv, past, cos, sin, split, heads, kv_heads)
    got = attn_t._session(heads, kv_heads, H, split=split).run(None, feeds)
    want = mesh_op.reference_attention(x, pk, pv, past, cos, sin, heads, kv_heads, H**-0.5)
    attn_t._close(got, want, past + S)
    gqa = attn_t._session(heads, kv_heads, H, op="GroupQueryAttention", split=split).run(
        None, feeds
    )
    attn_t._close(got, gqa, past + S)


@pytest.mark.parametrize("heads,kv_heads,H", [(14, 2, 64), (4, 2, 128)])
@pytest.mark.parametrize("S", [1, 3, 16])
def test_attention_at_the_end_of_the_buffer(lib, heads, kv_heads, H, S):
    """The new rows fill the buffer's last positions (past + S == max_len)."""
    max_len = 67
    past = max_len - S
    x, pk, pv, cos, sin = mesh_op.attention_inputs(S, past, heads, kv_heads, H, max_len, seed=3)
    got = attn_t._session(heads, kv_heads, H).run(None, attn_t._feeds(x, pk, pv, past, cos, sin))
    want = mesh_op.reference_attention(x, pk, pv, past, cos, sin, heads, kv_heads, H**-0.5)
    attn_t._close(got, want, max_len)


@pytest.mark.parametrize("heads,kv_heads,H", [(14, 2, 64), (4, 4, 128)])
@pytest.mark.parametrize("kv_dtype", ["float32", "float16"])
def test_attention_in_place_and_rewind(lib, heads, kv_heads, H, kv_dtype):
    attn_t.in_place_and_rewind(heads, kv_heads, H, kv_dtype)


@pytest.mark.parametrize("heads,kv_heads,H", [(14, 2, 64), (4, 2, 128)])
@pytest.mark.parametrize("S,past", [(1, 37), (9, 5), (64, 0)])
def test_attention_half_cache(lib, heads, kv_heads, H, S, past):
    attn_t.test_half_cache_matches_numpy(heads, kv_heads, H, S, past)


def test_attention_half_rounding_matches_numpy(lib):
    """The portable float -> half conversion (x86-64: no F16C) rounds as numpy does."""
    attn_t.test_half_rounding_matches_numpy()


# -- a whole model --------------------------------------------------------------------------------


@pytest.mark.parametrize("precision", ["fp32", "int4"])
def test_tiny_model_tokens_equal_the_native_build(
    lib, precision, tiny_models, tmp_path, monkeypatch
):
    """Greedy tokens of a tiny model's wafer engine (MeshLinear / MeshLinearQ, DecoderAttention)
    through the portable build equal the native build's, over a float32 cache.  Over a float16
    one (int4's default) the attention's float32 sums (fused multiply-adds natively, separate ones
    without FMA) can round a cached key the other way, so there the logits are compared: the
    same argmax almost everywhere, and close."""
    params = GenerationParams(max_new_tokens=24, ignore_eos=True)
    tokens, logits = {}, {}
    for build in ("portable", "native"):
        if build == "native":
            monkeypatch.undo()
            monkeypatch.setenv("SPARK_LSP_AMX", "0")
        linear = op_linear(precision, grid=(2, 2))
        assert linear.custom_op_libraries == (
            (lib,) if build == "portable" else (mesh_op.library(),)
        )
        if precision != "fp32":
            assert isinstance(linear, QuantLinear) and linear.form == "op"
        eng = Engine.load(
            tiny_models["llama"], linear=linear, cache_dir=tmp_path, threads=1, kv_cache="float32"
        )
        prompt = eng.tokenizer.encode(
            "def fibonacci(n):\n    a, b = 0, 1\n    for i in range(n):\n"
        )
        gen = eng.generate(prompt, params)
        gen.result()
        tokens[build] = gen.tokens
        half = Engine.load(
            tiny_models["llama"], linear=linear, cache_dir=tmp_path, threads=1, kv_cache="float16"
        )
        assert half.runtime.kv_dtype == np.float16
        logits[build] = half.forward_logits(prompt + tokens[build])
    assert tokens["portable"] == tokens["native"]
    a, b = logits["portable"], logits["native"]
    assert (a.argmax(-1) == b.argmax(-1)).mean() >= 0.9
    assert np.abs(a - b).max() <= 0.1 * np.abs(b).max()
