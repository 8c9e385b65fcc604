"""Build and locate ``spark.wafer::MeshLinear`` and ``MeshLinearQ``, the ONNX Runtime ops that run a
partitioned linear (float weights, and int8 / int4 weights), and ``DecoderAttention``.

``mesh_op.c`` (next to this file) computes a whole tiled linear — every mesh line's partial
products and their chain reduction — in one kernel launch.  It is compiled on first use with the
system C compiler (``$CC``, else ``cc``/``gcc``/``clang``) for this CPU (``-march=native``; with
link-time optimisation where the compiler has it, :data:`LTO`, which compiles on every core) into
the spark-lsp cache (``$SPARK_LSP_CACHE/ops``, else ``~/.cache/spark-lsp/ops``), keyed by the
source, compiler and CPU, and loaded into sessions with ``SessionOptions.register_custom_ops_library``.
Like the graph cache, a build is written to a temporary name and renamed, so concurrent servers
never load half a file; each process checks the library on one small linear before using it.

Where it cannot be built (no compiler, an ONNX Runtime older than the op needs, or
``SPARK_LSP_MESH_OP=0``), :func:`library` returns ``None`` with the reason in :func:`why_not`,
and ``TiledLinear`` emits the same partitioning as standard ONNX ops instead (slower on small
models; see docs/wafer.md).  The quantised op is self-tested on its own: where only it fails,
:func:`quantized` is ``False`` (reason in :func:`why_not_quantized`) and quantised engines use
the fused ``MatMulNBits`` form.

``MeshLinearQ`` runs passes of several token rows (speculative verification, prefill) on AMX-INT8
tiles where the CPU and kernel allow it (:func:`amx`), bit-identical to its VNNI path;
``SPARK_LSP_AMX=0`` keeps sessions created while it is set on the VNNI path and
``SPARK_LSP_AMX_MIN_ROWS`` moves the row count from which AMX runs (docs/wafer.md).

Both ops can also run the gated MLP's act(gate) * up after a ``gate_up`` linear (attribute
``glu``; :func:`glu_interleave` writes the weight columns in the order it needs) and the RMSNorm
before a linear, with the skip add (attributes ``norm``, ``epsilon``): nodes a small model's
decode step would otherwise pay ONNX Runtime's per-node cost for (docs/wafer.md).

The library also holds ``DecoderAttention`` (:data:`ATTN_OP`), the decoder's attention with
GroupQueryAttention's inputs and outputs (rotary, causal GQA over the in-place KV cache) without
its per-head dispatch; op-form emitters emit it through :func:`emit_attention` where its own
self-test passed (:func:`attention`), GroupQueryAttention otherwise.
:func:`reference_attention` is its arithmetic in numpy.

:func:`pack_float` and :func:`pack_quantized` write float and block-quantised weights in the
layouts ``MeshLinear`` and ``MeshLinearQ`` read in place (described at the top of each kernel in
``mesh_op.c``), so a session maps the graph's initializers and keeps no second copy;
:func:`reference_quantized` is the quantised arithmetic in numpy (the op's self-test and unit
tests compare against it).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from ..graph_cache import cache_root

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("mesh_op.c")
DOMAIN = "spark.wafer"
OP = "MeshLinear"
QOP = "MeshLinearQ"
#: The decoder attention op (GroupQueryAttention's contract as the decoder graph uses it).
ATTN_OP = "DecoderAttention"
#: Output columns per panel of MeshLinear's and MeshLinearQ's weight layouts (NR in mesh_op.c).
PANEL = 64
#: ``glu`` attribute values of MeshLinear / MeshLinearQ by MLP activation: the op then returns
#: act(gate) * up of a gated MLP's gate_up linear (weights in :func:`glu_interleave`'s order).
GLU = {"silu": 1, "gelu_tanh": 2}
#: The C API table version the op is compiled against (its slots exist from this release on).
MIN_ORT = (1, 20)
FLAGS = (
    "-O3",
    "-shared",
    "-fPIC",
    "-pthread",
    "-fvisibility=hidden",
    "-std=gnu11",
    "-fno-math-errno",  # sqrtf as one instruction: no libm
)
#: Link-time optimisation, tried first (a build without it where the compiler cannot): the one
#: source's code generation is split into partitions the compiler runs in parallel (GCC: a job
#: per core, through ``make`` where it is installed, else one after the other), so a machine's
#: first load waits less for the library.  The machine code is the same functions, optimised
#: alike: the outputs are the same bit for bit (tests/wafer/test_mesh_build.py).
LTO = ("-flto=auto",)
#: Libraries after the source: libm for fmaf where the target has no FMA instruction (the
#: portable loops' fused multiply-adds; a -march=native build on an FMA CPU needs nothing).
LIBS = ("-lm",)

_lock = threading.Lock()
_state: dict[str, object] = {}


def ops_dir() -> Path:
    """Beside the graph cache (``$SPARK_LSP_CACHE``, else ``~/.cache/spark-lsp``)."""
    return cache_root().parent / "ops"


def _compiler() -> str | None:
    found = (shutil.which(c) for c in (os.environ.get("CC"), "cc", "gcc", "clang") if c)
    return next((path for path in found if path), None)


def _cpu_id() -> str:
    """What ``-march=native`` depends on: the architecture and the CPU's feature flags."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = line
                break
    except OSError:
        pass
    return f"{platform.machine()} {flags}"


def _ort_version() -> tuple[int, ...]:
    return tuple(int(p) for p in ort.__version__.split(".")[:2] if p.isdigit())


def _compile(cc: str, out: Path, arch: list[str], lto: bool = True) -> str | None:
    """Compile with ``FLAGS`` and ``arch`` into ``out`` (written to a temporary name and renamed,
    so a reader never sees half a file): with ``LTO`` first, then without it where that failed (a
    compiler without link-time optimisation); returns ``None``, or the command and why it failed."""
    if lto and _compile_once(cc, out, [*LTO, *arch]) is None:
        return None
    return _compile_once(cc, out, arch)


def _compile_once(cc: str, out: Path, arch: list[str]) -> str | None:
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=out.name + ".", suffix=".tmp", dir=out.parent)
    os.close(fd)
    cmd = [cc, *FLAGS, *arch, "-o", tmp, str(SOURCE), *LIBS]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        Path(tmp).unlink(missing_ok=True)
        return f"{' '.join(cmd)}: {e}"
    if res.returncode == 0:
        os.replace(tmp, out)
        return None
    Path(tmp).unlink(missing_ok=True)
    return f"{' '.join(cmd)}: {res.stderr.strip()[-400:]}"


def _build(cc: str, out: Path) -> None:
    """Compile into ``out`` (atomically); tries ``-march=native`` first, then a generic build."""
    errors = []
    for arch in (["-march=native"], []):
        if (error := _compile(cc, out, arch)) is None:
            return
        errors.append(error)
    raise RuntimeError("; ".join(errors))


def build(out: Path, arch: list[str], cc: str | None = None, lto: bool = True) -> Path:
    """Compile the library for a chosen target into ``out`` and return it: ``arch`` is the
    compiler's target flags, e.g. ``["-march=x86-64-v3"]`` (AVX2 + FMA, no AVX-512) or
    ``["-march=x86-64"]`` (SSE2 only: the kernels' portable C loops).

    :func:`library` keeps building for this CPU; this is for testing the code paths another CPU
    compiles (tests/wafer/test_mesh_portable.py) and for a build to ship to other machines.  No
    self-test runs here (``_self_test`` and friends take the path).  Raises ``RuntimeError`` with
    the compiler's message where it fails, or where no compiler is found (``cc`` else ``$CC``,
    ``cc``, ``gcc``, ``clang``).  ``lto=False``: without link-time optimisation (``LTO``)."""
    cc = cc or _compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set CC, or install gcc or clang)")
    out = Path(out)
    if (error := _compile(cc, out, list(arch), lto)) is not None:
        raise RuntimeError(error)
    return out


def pack_float(tiles: np.ndarray) -> np.ndarray:
    """One mesh line's float tiles ``[k, N]`` in ``MeshLinear``'s layout: ``[panels, k, 64]``,
    panel q holding columns [64q, 64q + 64) of every row, zero-padded past N."""
    w = np.asarray(tiles, np.float32)
    k, N = w.shape
    panels = -(-N // PANEL)
    out = np.zeros((panels, k, PANEL), np.float32)
    for q in range(panels):  # one panel at a time: no second full-size temporary
        out[q, :, : min(PANEL, N - q * PANEL)] = w[:, q * PANEL : (q + 1) * PANEL]
    return out


def glu_columns(F: int) -> np.ndarray:
    """Which column of a gated MLP's ``[gate | up]`` weight (``2F`` columns) each stored column of
    the ``glu`` layout holds, ``-1`` for padding: panel q holds gate columns [32q, 32q + 32) then
    the matching up columns, each half zero-padded past F, so one panel's sums finish its 32
    gated outputs."""
    half = PANEL // 2
    panels = -(-F // half)
    c = np.arange(panels * half).reshape(panels, 1, half)
    cols = np.concatenate([c, c + F], axis=1)  # [panel, gate|up, 32]
    cols[np.broadcast_to(c >= F, cols.shape)] = -1
    return cols.reshape(-1)


def glu_interleave(a: np.ndarray, F: int) -> np.ndarray:
    """``a[..., 2F]`` (a ``[gate | up]`` weight ``[K, 2F]`` or bias ``[2F]``) in the ``glu``
    column order of :func:`glu_columns`, zeros in the padding."""
    a = np.asarray(a, np.float32)
    if a.shape[-1] != 2 * F:
        raise ValueError(f"expected {2 * F} [gate | up] columns, got shape {a.shape}")
    if a.ndim == 2 and a.flags.f_contiguous and not a.flags.c_contiguous:
        # a checkpoint's [out, in] weight seen as [K, 2F]: move whole rows of its transpose, and
        # return the same column-major layout (its columns, which the quantiser reads, contiguous)
        cols = glu_columns(F)
        out_t = np.zeros((cols.size, a.shape[0]), np.float32)
        keep = cols >= 0
        out_t[keep] = a.T[cols[keep]]
        return out_t.T
    lead, half = a.shape[:-1], PANEL // 2
    full, rest = divmod(F, half)
    # [..., panel, gate|up, 32]: strided copies of each half, not a gather over every column
    out = np.zeros((*lead, full + (rest > 0), 2, half), np.float32)
    for side in (0, 1):
        src = a[..., side * F : (side + 1) * F]
        out[..., :full, side, :] = src[..., : full * half].reshape(*lead, full, half)
        if rest:
            out[..., full, side, :rest] = src[..., full * half :]
    return out.reshape(*lead, -1)


def float_node_inputs(w: np.ndarray, k_sizes: list[int]) -> tuple[np.ndarray, list[np.ndarray]]:
    """``(shape, [packed tiles per line])`` for a MeshLinear node computing ``x @ w`` over lines
    of ``k_sizes`` rows."""
    offs = np.cumsum([0, *k_sizes])
    shape = np.array([w.shape[1], *k_sizes], np.int64)
    return shape, [pack_float(w[offs[p] : offs[p + 1]]) for p in range(len(k_sizes))]


def _self_test(path: str) -> None:
    """Load the library into a session and check one uneven, multi-row linear against numpy, in
    both weight layouts, so a broken build (compiler, ABI) falls back to the standard-op form
    instead of failing a load."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((70, 130)).astype(np.float32)
    x = rng.standard_normal((7, 70)).astype(np.float32)
    shape, lines = float_node_inputs(w, [36, 34])
    inits = [numpy_helper.from_array(shape, "shape")] + [
        numpy_helper.from_array(t, f"w{p}") for p, t in enumerate(lines)
    ]
    node = helper.make_node(OP, ["x", "shape", "w0", "w1"], ["y"], domain=DOMAIN)
    table = numpy_helper.from_array(np.ascontiguousarray(w.T), "table")
    tnode = helper.make_node(OP, ["x", "shape", "table"], ["y"], domain=DOMAIN, transposed=1)
    for y in (_run_node(path, node, x, inits), _run_node(path, tnode, x, [inits[0], table])):
        err = float(np.abs(y - x @ w).max())
        if not err < 1e-3:
            raise RuntimeError(f"self-test: max error {err:g} against numpy")


def pack_quantized(
    codes: np.ndarray, scales: np.ndarray, zero_points: np.ndarray, bits: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One mesh line's block-quantised weights in ``MeshLinearQ``'s layout.

    ``codes`` uint8 [N, nb * block] (one code per byte, column-major like MatMulNBits, the line's
    K extent zero-padded to whole blocks), ``scales`` float [N, nb], ``zero_points`` uint8
    [N, nb].  Returns (codes [panels, nb*block*bits/32, 256], scales [panels, nb, 64], zero
    points [panels, nb, 64]), columns padded to whole 64-column panels.  At 4 bits the scales
    are stored as half floats: pass values a half float holds (``half_scales``; the quantiser,
    ``engine.quant``, makes them so), or they are rounded to the nearest.
    """
    if bits not in (4, 8):
        raise ValueError(f"bits={bits!r}: MeshLinearQ takes 8 or 4")
    codes = np.asarray(codes, np.uint8)
    N, kpad = codes.shape
    nb = scales.shape[1]
    if scales.shape != (N, nb) or zero_points.shape != (N, nb) or kpad % nb or (kpad // nb) % 16:
        raise ValueError(
            f"codes {codes.shape}, scales {scales.shape}, zero points {zero_points.shape}: "
            "expected [N, nb*block], [N, nb], [N, nb] with block a multiple of 16"
        )
    panels = -(-N // PANEL)
    pad = panels * PANEL - N
    c = np.pad(codes, ((0, pad), (0, 0))).reshape(panels, PANEL, kpad)
    if bits == 8:  # [panel, k/4, column, 4 consecutive k]
        out = c.reshape(panels, PANEL, kpad // 4, 4).transpose(0, 2, 1, 3)
    else:  # [panel, k/8, column, 4]: k 0..3 in the low nibbles, k 4..7 in the high ones
        g = c.reshape(panels, PANEL, kpad // 8, 2, 4).transpose(0, 2, 1, 4, 3)
        out = (g[..., 0] & 0x0F) | ((g[..., 1] & 0x0F) << 4)
    out = np.ascontiguousarray(out, np.uint8).reshape(panels, -1, 4 * PANEL)

    def per_panel(a, dtype):
        a = np.pad(np.asarray(a, dtype), ((0, pad), (0, 0)))
        return np.ascontiguousarray(a.reshape(panels, PANEL, nb).transpose(0, 2, 1))

    scale_type = np.float16 if bits == 4 else np.float32
    return out, per_panel(scales, scale_type), per_panel(zero_points, np.uint8)


def empty_quantized(
    panels: int, k: int, block: int, bits: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Uninitialised arrays of :func:`pack_quantized`'s shapes and types for ``panels`` panels of
    one line of K extent ``k`` (zero-padded to whole blocks), to be filled a run of panels at a
    time."""
    nb = -(-k // block)
    return (
        np.empty((panels, nb * block * bits // 32, 4 * PANEL), np.uint8),
        np.empty((panels, nb, PANEL), np.float16 if bits == 4 else np.float32),
        np.empty((panels, nb, PANEL), np.uint8),
    )


def half_scales(scales: np.ndarray) -> np.ndarray:
    """``scales`` rounded to the half floats MeshLinearQ stores at 4 bits (as float32 values)."""
    return np.asarray(scales, np.float32).astype(np.float16).astype(np.float32)


def quantize_activations(x: np.ndarray, k: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    """One line's activations ``x[M, k]`` as MeshLinearQ quantises them: int codes [M, nb*block]
    (zero-padded) and scales [M, nb] (per row and block: max|x| / 127, round to nearest even)."""
    M = x.shape[0]
    nb = -(-k // block)
    xp = np.zeros((M, nb * block), np.float32)
    xp[:, :k] = x
    xb = xp.reshape(M, nb, block)
    amax = np.abs(xb).max(-1)
    inv = np.where(amax != 0, np.float32(127.0) / np.where(amax != 0, amax, 1), 0).astype(
        np.float32
    )
    q = np.round(xb * inv[..., None]).astype(np.int64)  # float32 product, half-even: as the kernel
    return q.reshape(M, nb * block), (amax / np.float32(127.0)).astype(np.float32)


def reference_quantized(
    x: np.ndarray, lines: list[tuple[np.ndarray, np.ndarray, np.ndarray, int]], block: int
) -> np.ndarray:
    """numpy MeshLinearQ: ``lines`` of (codes [N, nb*block], scales [N, nb], zero points [N, nb],
    K extent), in the natural layout :func:`pack_quantized` takes; ``x`` [M, sum of extents]."""
    y, k0 = 0.0, 0
    for codes, scales, zps, k in lines:
        q, xs = quantize_activations(x[:, k0 : k0 + k], k, block)
        M, nb = xs.shape
        w = (
            codes.astype(np.int64).reshape(-1, nb, block) - zps.astype(np.int64)[..., None]
        )  # [N, nb, block]
        dots = np.einsum("mbk,nbk->mnb", q.reshape(M, nb, block), w).astype(np.float64)
        y = y + (dots * scales.astype(np.float64)[None] * xs.astype(np.float64)[:, None, :]).sum(-1)
        k0 += k
    return np.asarray(y, np.float32)


def quantized_node_inputs(lines, bits: int):
    """``(shape, [(codes, scales, zero points) per line])`` arrays for a MeshLinearQ node, from
    ``lines`` as :func:`reference_quantized` takes them."""
    N = lines[0][0].shape[0]
    shape = np.array([N, *(k for *_, k in lines)], np.int64)
    return shape, [pack_quantized(c, s, z, bits) for c, s, z, _ in lines]


def _self_test_quantized(path: str) -> None:
    """MeshLinearQ at 8 and 4 bits on two uneven lines and several rows against numpy."""
    rng = np.random.default_rng(1)
    for bits in (8, 4):
        lines = []
        for k in (40, 37):
            nb = -(-k // 16)
            codes = rng.integers(0, 1 << bits, (70, nb * 16)).astype(np.uint8)
            codes[:, k:] = 0
            scales = rng.random((70, nb), np.float32) * 0.1
            lines.append(
                (
                    codes,
                    half_scales(scales) if bits == 4 else scales,  # as the op stores them
                    rng.integers(0, 1 << bits, (70, nb)).astype(np.uint8),
                    k,
                )
            )
        # 3 rows: the VNNI path; 19: the AMX one where the CPU has it (one full pass + 3 rows)
        x = rng.standard_normal((19, 77)).astype(np.float32)
        for rows in (3, 19):
            y = _run_quantized(path, x[:rows], lines, bits, 16)
            want = reference_quantized(x[:rows], lines, 16)
            err = float(np.abs(y - want).max() / max(1e-6, float(np.abs(want).max())))
            if not err < 1e-5:
                raise RuntimeError(
                    f"self-test ({bits} bits, {rows} rows): relative error {err:g} against numpy"
                )


def _run_quantized(path: str, x: np.ndarray, lines, bits: int, block: int) -> np.ndarray:
    shape, packed = quantized_node_inputs(lines, bits)
    inits = [numpy_helper.from_array(shape, "shape")]
    names = ["x", "shape"]
    for p, arrays in enumerate(packed):
        for what, a in zip(("codes", "scales", "zp"), arrays):
            inits.append(numpy_helper.from_array(a, f"{what}{p}"))
            names.append(f"{what}{p}")
    node = helper.make_node(QOP, names, ["y"], domain=DOMAIN, bits=bits, block_size=block)
    return _run_node(path, node, x, inits)


def _run_node(path: str, node, x: np.ndarray, initializers: list) -> np.ndarray:
    """Run one op of the library at `path` on `x` (float32 in, float32 `y` out), one thread."""
    graph = helper.make_graph(
        [node],
        "self_test",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        initializers,
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)]
    )
    model.ir_version = 8
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.register_custom_ops_library(path)
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]


def reference_attention(
    x: np.ndarray,
    past_k: np.ndarray,
    past_v: np.ndarray,
    past: int,
    cos: np.ndarray,
    sin: np.ndarray,
    heads: int,
    kv_heads: int,
    scale: float,
    k: np.ndarray | None = None,
    v: np.ndarray | None = None,
    written: tuple[np.ndarray, np.ndarray] | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``DecoderAttention`` in numpy (float64 inside): the S new rows of ``x`` ([1, S, (heads +
    2 kv_heads) H] packed Q|K|V, or q alone with ``k`` and ``v``) attend causally to the cache
    ``past_k`` / ``past_v`` ([1, kv_heads, max_len, H], positions [0, past) valid) and to each
    other, after rotate-half RoPE at positions past + s.  Returns (attn [1, S, heads H], present
    key, present value) with the new rows written at [past, past + S) of copies of the cache (in
    the cache's dtype: a float16 cache gets the new rows rounded to half, and attention reads the
    rounded values, as the op does).  ``written``: (key, value) caches that already hold the new
    rows (the op's present outputs): attend over those instead, so a half cache's key that the
    op's float32 rotation rounded the other way does not count against its attention."""
    H = past_k.shape[-1]
    S = x.shape[1]
    if k is None:
        q, k, v = np.split(x[0], [heads * H, (heads + kv_heads) * H], axis=-1)
    else:
        q, k, v = x[0], k[0], v[0]
    q = q.reshape(S, heads, H).astype(np.float64)
    k = k.reshape(S, kv_heads, H).astype(np.float64)
    v = v.reshape(S, kv_heads, H)
    pos = np.arange(past, past + S)
    c, s_ = cos[pos][:, None, :].astype(np.float64), sin[pos][:, None, :].astype(np.float64)

    def rope(a):
        a1, a2 = a[..., : H // 2], a[..., H // 2 :]
        return np.concatenate([a1 * c - a2 * s_, a2 * c + a1 * s_], axis=-1)

    pk, pv = past_k.copy(), past_v.copy()
    pk[0, :, past : past + S] = rope(k).transpose(1, 0, 2)
    pv[0, :, past : past + S] = v.transpose(1, 0, 2)
    if written is not None:
        pk, pv = written
    q = rope(q)
    out = np.zeros((S, heads, H))
    group = heads // kv_heads
    for h in range(heads):
        keys = pk[0, h // group, : past + S].astype(np.float64)
        vals = pv[0, h // group, : past + S].astype(np.float64)
        scores = scale * q[:, h] @ keys.T  # [S, past + S]
        scores[np.arange(past, past + S)[:, None] < np.arange(past + S)[None, :]] = -np.inf
        p = np.exp(scores - scores.max(axis=1, keepdims=True))
        out[:, h] = (p / p.sum(axis=1, keepdims=True)) @ vals
    return out.reshape(1, S, heads * H).astype(np.float32), pk, pv


def attention_inputs(
    S: int, past: int, heads: int, kv_heads: int, H: int, max_len: int, seed=0, kv_dtype="float32"
):
    """Random inputs of ``DecoderAttention`` (tests and the self-test): packed x, past key and
    value in ``kv_dtype`` (positions >= past hold garbage the op must not read), and RoPE
    tables."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((1, S, (heads + 2 * kv_heads) * H)).astype(np.float32)
    past_k = rng.standard_normal((1, kv_heads, max_len, H)).astype(kv_dtype)
    past_v = rng.standard_normal((1, kv_heads, max_len, H)).astype(kv_dtype)
    inv = 1.0 / (10000.0 ** (np.arange(0, H, 2) / H))
    freqs = np.outer(np.arange(max_len), inv)
    return x, past_k, past_v, np.cos(freqs).astype(np.float32), np.sin(freqs).astype(np.float32)


def attention_feeds(x, pk, pv, past: int, cos, sin) -> dict[str, np.ndarray]:
    """The inputs of :func:`attention_model`'s graph for the rows ``x`` after ``past`` cached
    positions (``seqlens_k`` and ``total_sequence_length`` as the decoder passes them)."""
    S = x.shape[1]
    return {
        "x": x,
        "past_key": pk,
        "past_value": pv,
        "seqlens_k": np.array([past + S - 1], np.int32),
        "total_sequence_length": np.array(past + S, np.int32),
        "cos": cos,
        "sin": sin,
    }


def attention_model(
    heads: int,
    kv_heads: int,
    H: int,
    scale: float,
    op: str = ATTN_OP,
    split=False,
    kv_dtype="float32",
):
    """A one-node model of ``DecoderAttention`` (``op=ATTN_OP``) or of GroupQueryAttention
    (``op="GroupQueryAttention"``) with the decoder's inputs: x (or q, k, v with ``split``),
    past_key, past_value (of ``kv_dtype``), seqlens_k, total_sequence_length, cos, sin."""
    f32 = TensorProto.FLOAT
    kv = TensorProto.FLOAT16 if kv_dtype == "float16" else f32
    names = ["q", "k", "v"] if split else ["x", "", ""]
    ins = [helper.make_tensor_value_info(n, f32, [1, "S", None]) for n in names if n]
    ins += [
        helper.make_tensor_value_info("past_key", kv, [1, kv_heads, "max_len", H]),
        helper.make_tensor_value_info("past_value", kv, [1, kv_heads, "max_len", H]),
        helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [1]),
        helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, []),
        helper.make_tensor_value_info("cos", f32, [None, H // 2]),
        helper.make_tensor_value_info("sin", f32, [None, H // 2]),
    ]
    gqa = op == "GroupQueryAttention"
    node = helper.make_node(
        op,
        [*names, "past_key", "past_value", "seqlens_k", "total_sequence_length", "cos", "sin"],
        ["attn", "present_key", "present_value"],
        domain="com.microsoft" if gqa else DOMAIN,
        num_heads=heads,
        kv_num_heads=kv_heads,
        scale=float(scale),
        **({"do_rotary": 1, "rotary_interleaved": 0} if gqa else {}),
    )
    outs = [helper.make_tensor_value_info(n, t, None) for n, t in zip(node.output, (f32, kv, kv))]
    graph = helper.make_graph([node], "attention", ins, outs)
    model = helper.make_model(
        graph,
        opset_imports=[
            helper.make_opsetid("", 17),
            helper.make_opsetid(DOMAIN, 1),
            helper.make_opsetid("com.microsoft", 1),
        ],
    )
    model.ir_version = 8
    return model


def _self_test_attention(path: str) -> None:
    """Check a verify-sized pass (3 rows over 5 cached positions, group size 2) against numpy,
    with a float32 and a float16 cache."""
    heads, kv_heads, H, S, past = 4, 2, 16, 3, 5
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.register_custom_ops_library(path)
    for kv_dtype, tol in (("float32", 1e-4), ("float16", 4e-3)):
        x, pk, pv, cos, sin = attention_inputs(S, past, heads, kv_heads, H, 12, kv_dtype=kv_dtype)
        model = attention_model(heads, kv_heads, H, H**-0.5, kv_dtype=kv_dtype)
        opts = ["CPUExecutionProvider"]
        sess = ort.InferenceSession(model.SerializeToString(), so, providers=opts)
        got = sess.run(None, attention_feeds(x, pk, pv, past, cos, sin))
        want = reference_attention(x, pk, pv, past, cos, sin, heads, kv_heads, H**-0.5)
        for g, w in zip(got, want):
            if g.dtype != w.dtype:
                raise RuntimeError(f"attention self-test: {g.dtype} output for a {kv_dtype} cache")
            g, w = (a[..., : past + S, :].astype(np.float64) for a in (g, w))
            # relative beyond 1: a half cache's new rows may round one unit the other way
            if not (err := float((np.abs(g - w) / np.maximum(1.0, np.abs(w))).max())) < tol:
                raise RuntimeError(f"attention self-test ({kv_dtype} cache): max error {err:g}")


def library() -> str | None:
    """Path of the compiled op library (built on first call), or ``None`` (see :func:`why_not`)."""
    with _lock:
        if "path" in _state:
            return _state["path"]  # type: ignore[return-value]
        path, reason = None, None
        try:
            if os.environ.get("SPARK_LSP_MESH_OP", "1").strip().lower() in (
                "0",
                "false",
                "no",
                "off",
            ):
                reason = "disabled by SPARK_LSP_MESH_OP"
            elif _ort_version() < MIN_ORT:
                reason = f"onnxruntime {'.'.join(map(str, _ort_version()))} is older than {'.'.join(map(str, MIN_ORT))}"
            elif (cc := _compiler()) is None:
                reason = "no C compiler found (set CC, or install gcc or clang)"
            else:
                try:
                    ver = subprocess.run(
                        [cc, "--version"], capture_output=True, text=True, timeout=30
                    ).stdout
                except (OSError, subprocess.TimeoutExpired):
                    ver = ""
                key = hashlib.sha256(
                    b"\0".join(
                        x.encode()
                        for x in (
                            SOURCE.read_text(),
                            cc,
                            ver,
                            " ".join(FLAGS + LTO + LIBS),
                            _cpu_id(),
                        )
                    )
                ).hexdigest()[:16]
                out = ops_dir() / f"mesh_op-{key}.so"
                if not out.exists():
                    log.info("compiling %s -> %s", SOURCE.name, out)
                    _build(cc, out)
                _self_test(str(out))
                path = str(out)
        except Exception as e:  # a failed build or self-test: fall back to the standard-op form
            reason = f"build failed: {e}"
        if reason:
            log.warning(
                "MeshLinear op unavailable (%s); partitioned linears use standard ONNX ops", reason
            )
        q_reason = a_reason = reason
        if path is not None:
            try:
                _self_test_attention(path)
            except Exception as e:  # only the attention op is broken: GroupQueryAttention instead
                a_reason = f"attention self-test failed: {e}"
                log.warning(
                    "DecoderAttention unavailable (%s); GroupQueryAttention instead", a_reason
                )
            try:
                _self_test_quantized(path)
            except Exception as e:  # only the quantised op is broken: fused MatMulNBits instead
                q_reason = f"quantised self-test failed: {e}"
                log.warning(
                    "MeshLinearQ op unavailable (%s); quantised linears use fused MatMulNBits",
                    q_reason,
                )
        _state["path"], _state["reason"], _state["q_reason"] = path, reason, q_reason
        _state["a_reason"] = a_reason
        return path


def why_not() -> str | None:
    """Why :func:`library` returned ``None`` (``None`` if it has not failed)."""
    library()
    return _state.get("reason")  # type: ignore[return-value]


def quantized() -> bool:
    """Whether ``MeshLinearQ`` (in the :func:`library`) is usable."""
    return library() is not None and _state.get("q_reason") is None


def why_not_quantized() -> str | None:
    """Why :func:`quantized` is ``False`` (``None`` if it is not)."""
    library()
    return _state.get("q_reason")  # type: ignore[return-value]


def attention() -> bool:
    """Whether ``DecoderAttention`` (in the :func:`library`) is usable."""
    return library() is not None and _state.get("a_reason") is None


def emit_attention(gb, inputs: list[str], *, name: str, heads: int, kv_heads: int, scale: float):
    """One ``DecoderAttention`` node over GroupQueryAttention's inputs (x or q, k, v; past key
    and value; seqlens_k; total_sequence_length; cos; sin): returns (attn, present key, present
    value), or ``None`` where the op is unavailable (the graph then emits GroupQueryAttention)."""
    if not attention():
        return None
    return gb.node(
        ATTN_OP,
        inputs,
        n_out=3,
        domain=DOMAIN,
        name=name,
        num_heads=heads,
        kv_num_heads=kv_heads,
        scale=float(scale),
    )


def _native():
    """The op library loaded with ctypes (the same copy ONNX Runtime loads), or ``None``."""
    path = library()
    if path is None:
        return None
    with _lock:
        if "cdll" not in _state:
            _state["cdll"] = ctypes.CDLL(path)
        return _state["cdll"]


def qloop() -> str | None:
    """Which inner loop the :func:`library`'s ``MeshLinearQ`` was compiled with: ``"vnni"``
    (AVX-512 VNNI and BW), ``"avx2"`` (AVX2, FMA and F16C without VNNI: AMD Zen 2/3, most
    laptops), ``"portable"`` (plain C: ARM, older x86), or ``None`` without the library.  All give
    the same results bit for bit; the portable loops are several times slower than ONNX Runtime's
    vectorised ``MatMulNBits`` kernels, so ``QuantLinear`` defaults to the fused form there."""
    lib = _native()
    if lib is None:
        return None
    if lib.spark_mesh_vnni():
        return "vnni"
    return "avx2" if lib.spark_mesh_avx2() else "portable"


def amx() -> bool:
    """Whether ``MeshLinearQ`` can run passes of many token rows on AMX-INT8 tiles here: the
    library was built with AMX (``-march=native`` on such a CPU), cpuid reports AMX-TILE and
    AMX-INT8, and Linux granted this process the tile state.  ``SPARK_LSP_AMX=0`` keeps sessions
    created while it is set on the VNNI path, whatever this says."""
    lib = _native()
    return bool(lib is not None and lib.spark_mesh_amx())


def amx_tasks() -> int:
    """How many tasks ``MeshLinearQ`` has run on the AMX path in this process (tests use it to
    tell which path ran: both give the same results)."""
    lib = _native()
    if lib is None:
        return 0
    lib.spark_mesh_amx_tasks.restype = ctypes.c_ulong
    return int(lib.spark_mesh_amx_tasks())


def reset() -> None:
    """Forget the cached result (tests; after changing ``CC`` or ``SPARK_LSP_MESH_OP``)."""
    with _lock:
        _state.clear()
