"""Quantised linear emitters: int8 / 4-bit weights for the decoder graph.

Decode on a small model is bound by the bytes of weights read per token, so storing them in 8 or 4
bits is the largest single lever after the KV cache.  :class:`QuantLinear` is a *linear emitter*
(same interface as ``engine.graph.DenseLinear``): every weight matmul, the LM head included,
becomes one ``com.microsoft.MatMulNBits`` node with ``accuracy_level=4`` — ORT quantises the
activations per block to int8 and uses int8 dot products, so the weights stay small *and* the
arithmetic is integer ('int8', 'int4').  'int8-rowq' instead quantises each activation row itself
and runs ``MatMulInteger``: rows never depend on each other and multi-token passes are cheap —
what speculative verification needs.

Composition with the wafer partitioning (``engine.wafer.partition.TiledLinear``, the engine's
default): with ``inner=TiledLinear(...)`` the weight is quantised **per PE tile** — every
quantisation block lies inside one tile (the block size divides the tile's K extent), so each PE
holds its own int codes and scales, exactly as it would on the mesh.  Three ONNX forms:

* ``form="fused"`` (the default off a grid): one MatMulNBits over the whole weight.  Because blocks never cross a
  tile boundary, this computes the same per-tile products and sums them over the mesh axis inside
  the kernel's K loop — the mesh reduction is fused into the op.
* ``form="op"`` (the default on a grid where the op builds with its AVX-512 VNNI or AVX2 loop;
  its portable loops, on ARM and older x86, are slower than MatMulNBits': :func:`mesh_op.qloop`):
  one ``spark.wafer::MeshLinearQ``
  node per linear (engine/wafer/mesh_op.c): each mesh line's int8/int4 tiles with their per-block
  scales, int8 dot products per line and the chain reduction of the lines' partial products in
  line order — the partition executed, as ``MeshLinear`` does for float weights.  Same weights and
  activation quantisation as the fused form, so the same greedy tokens; every row is computed on
  its own, so a multi-token pass gives exactly the single steps' results (speculation works).
  Like MeshLinear it also runs a gated MLP's gating (:meth:`QuantLinear.emit_gated`) and the
  RMSNorm before a linear (``norm=``), fewer nodes per decode step.
* ``form="mesh"``: the input is split along the reduction axis, one MatMulNBits per mesh line
  and an explicit ``Sum`` (the reduction as a separate op, like TiledLinear's ReduceSum).  Same
  numbers, slower on CPU; kept for inspection and tests.

The emitter for a precision name is made by :func:`engine.linears.make_linear`.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from .cpu import int8_dot
from .graph import DenseLinear
from .wafer import mesh_op
from .wafer.partition import block_sizes, mesh_node, reduce_axis
from .weights import as_weight

MS_DOMAIN = "com.microsoft"
TensorProto_UINT8, TensorProto_FLOAT = 2, 1  # onnx.TensorProto.UINT8 / FLOAT (no onnx import here)
#: Default quantisation block (weights per scale along K) per bit width: 4-bit needs small blocks
#: to keep greedy agreement with fp32, 8-bit does not.
DEFAULT_BLOCK = {8: 128, 4: 32}
_VALID_BLOCKS = (256, 128, 64, 32, 16)  # MatMulNBits: a power of two >= 16


#: MeshLinearQ's vector loops (:func:`mesh_op.qloop`): where it has one the partition executes by
#: default; its portable C loops are slower than MatMulNBits', so the fused form is kept there.
FAST_LOOPS = ("vnni", "avx2")

#: Weights quantised per step (column chunks): bounds the float64 temporaries of quantising a
#: large matrix (an LM head of 150k rows) to a few times 8 MB, shared by the threads that
#: quantise at once.
QUANT_CHUNK = 1 << 20
#: At most this many threads quantise a weight's chunks at once.
QUANT_THREADS = 8


def quant_threads() -> int:
    """Threads for quantising at graph build: the CPUs this process may run on, up to
    ``QUANT_THREADS``; ``SPARK_LSP_BUILD_THREADS`` overrides."""
    env = os.environ.get("SPARK_LSP_BUILD_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env)
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        n = os.cpu_count() or 1
    return max(1, min(n, QUANT_THREADS))


def in_column_runs(w, step: int, fn: Callable[[int, np.ndarray], None], threads: int) -> None:
    """``fn(n0, w[:, n0:n0 + step])`` for every run of ``step`` columns of ``w``, on up to
    ``threads`` threads (inline for one run or one thread); a lazy weight (a tied head, which
    reads its file) is read one run at a time.  The first error is raised once all have run."""
    read = threading.Lock()

    def run(n0: int) -> None:
        with read:
            cols = w[:, n0 : n0 + step]
        fn(n0, cols)

    starts = range(0, w.shape[1], step)
    if threads == 1 or len(starts) <= 1:
        for n0 in starts:
            run(n0)
        return
    with ThreadPoolExecutor(min(threads, len(starts))) as pool:
        for done in [pool.submit(run, n0) for n0 in starts]:
            done.result()


# -- packing -------------------------------------------------------------------------------------


@dataclass
class QuantizedWeight:
    """A [K, N] weight in MatMulNBits layout.

    ``packed`` uint8 [N, n_blocks, block_size * bits / 8] (column n, block b holds
    W[b*bs:(b+1)*bs, n], 4-bit codes two per byte, low nibble first); ``scales`` float32
    [N, n_blocks]; ``zero_points`` uint8 (8-bit: [N, n_blocks]; 4-bit: [N, ceil(n_blocks/2)]
    packed like the codes) or None for symmetric (the op then uses 2**(bits-1)).
    """

    packed: np.ndarray
    scales: np.ndarray
    zero_points: np.ndarray | None
    K: int
    N: int
    bits: int
    block_size: int


def quantize_blockwise(
    weight: np.ndarray,
    bits: int,
    block_size: int,
    *,
    symmetric: bool = False,
    threads: int | None = None,
) -> QuantizedWeight:
    """Round-to-nearest block quantisation of ``W[K, N]`` along K (one scale per block and column).

    Asymmetric (min/max with a zero point) by default: it keeps a block's whole range and measurably
    improves 4-bit greedy agreement; ``symmetric=True`` drops the zero points.  Column chunks
    are quantised on ``threads`` threads (default :func:`quant_threads`).
    """
    if bits not in (4, 8):
        raise ValueError(f"bits={bits!r}: only 4 and 8 are supported")
    if block_size not in _VALID_BLOCKS:
        raise ValueError(f"block_size={block_size!r} must be one of {_VALID_BLOCKS}")
    w = as_weight(weight)  # a lazy tied head is read below a column chunk at a time
    if w.ndim != 2:
        raise ValueError(f"weight must be 2-D [K, N], got shape {w.shape}")
    K, N = w.shape
    nb = -(-K // block_size)
    packed = np.empty((N, nb, block_size * bits // 8), np.uint8)
    scales = np.empty((N, nb), np.float32)
    zps = None if symmetric else np.empty((N, nb), np.uint8)
    # Column chunks: a 150k-row LM head never exists in float64 at once.
    threads = threads or quant_threads()
    step = max(1, QUANT_CHUNK // threads // (nb * block_size))

    def run(n0: int, cols: np.ndarray) -> None:
        n1 = n0 + cols.shape[1]
        p, sc, zp = _quantize_columns(cols, bits, block_size, nb, symmetric)
        packed[n0:n1], scales[n0:n1] = p, sc
        if zps is not None:
            zps[n0:n1] = zp

    in_column_runs(w, step, run, threads)
    zero_points = None
    if zps is not None:
        z = zps
        if bits == 4:
            if nb % 2:
                z = np.concatenate([z, np.zeros((N, 1), np.uint8)], axis=1)
            z = (z[:, 0::2] | (z[:, 1::2] << 4)).astype(np.uint8)
        zero_points = np.ascontiguousarray(z)
    return QuantizedWeight(packed, scales, zero_points, K, N, bits, block_size)


def _quantize_columns(
    w: np.ndarray, bits: int, block_size: int, nb: int, symmetric: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Codes [n, nb, bytes], scales [n, nb] and zero points [n, nb] of the columns ``w[K, n]``."""
    K, N = w.shape
    if K == nb * block_size:  # whole blocks (real models): one conversion, no zero fill
        blocks = np.asarray(w.T, np.float64, order="C")
    else:
        blocks = np.zeros((N, nb * block_size), np.float64)
        blocks[:, :K] = w.T
    blocks = blocks.reshape(N, nb, block_size)
    qmax = (1 << bits) - 1
    if symmetric:
        half = 1 << (bits - 1)
        amax = np.abs(blocks).max(-1)
        scale = _scales(amax / (half - 1), bits)
        zp = np.full((N, nb), half, np.int64)
    else:
        lo = np.minimum(blocks.min(-1), 0.0)
        hi = np.maximum(blocks.max(-1), 0.0)
        scale = _scales((hi - lo) / qmax, bits)
        zp = np.clip(np.round(-lo / scale), 0, qmax).astype(np.int64)
    # round(w / scale) + zp, clipped, computed in place (the chunk's one float64 buffer)
    q = np.divide(blocks, scale[..., None], out=blocks)
    np.round(q, out=q)
    q += zp[..., None]
    q = np.clip(q, 0, qmax, out=q).astype(np.uint8)
    if bits == 4:
        q = q[..., 0::2] | (q[..., 1::2] << 4)
    return q, scale.astype(np.float32), zp.astype(np.uint8)


#: The least and greatest scale a half float holds (its smallest subnormal, its largest finite).
HALF_MIN, HALF_MAX = 2.0**-24, 65504.0


def _scales(scale: np.ndarray, bits: int) -> np.ndarray:
    """Block scales, 1.0 for an all-zero block; at 4 bits half floats, rounded up (a block's
    range still fits its codes).  MeshLinearQ stores 4-bit scales as float16 (at blocks of 32 a
    float32 scale adds a quarter to the bytes of the codes a decode step streams, a half float
    an eighth), MatMulNBits as float32: both hold these exactly, so the forms compute the same
    products."""
    if bits != 4:
        return np.where(scale == 0, 1.0, scale)
    s = np.where(scale == 0, 1.0, np.clip(scale, HALF_MIN, HALF_MAX))
    h = s.astype(np.float16)
    low = h.astype(np.float64) < s
    h[low] = np.nextafter(h[low], np.float16(np.inf))
    return h.astype(np.float64)


def unpack_codes(qw: QuantizedWeight) -> tuple[np.ndarray, np.ndarray]:
    """One code per byte: (codes uint8 [N, n_blocks * block_size], zero points uint8 [N, n_blocks])."""
    N, nb, _ = qw.packed.shape
    if qw.bits == 4:
        codes = np.empty((N, nb, qw.block_size), np.uint8)
        codes[..., 0::2] = qw.packed & 0x0F
        codes[..., 1::2] = qw.packed >> 4
    else:
        codes = qw.packed
    if qw.zero_points is None:
        zp = np.full((N, nb), 1 << (qw.bits - 1), np.uint8)
    elif qw.bits == 4:
        zp = np.empty((N, qw.zero_points.shape[1] * 2), np.uint8)
        zp[:, 0::2] = qw.zero_points & 0x0F
        zp[:, 1::2] = qw.zero_points >> 4
        zp = zp[:, :nb]
    else:
        zp = qw.zero_points
    return codes.reshape(N, nb * qw.block_size), np.ascontiguousarray(zp)


def dequantize(qw: QuantizedWeight) -> np.ndarray:
    """The float32 ``W[K, N]`` a :class:`QuantizedWeight` represents (reference for tests)."""
    N, nb, _ = qw.packed.shape
    codes, zp = unpack_codes(qw)
    codes = codes.reshape(N, nb, qw.block_size).astype(np.float32)
    w = (codes - zp.astype(np.float32)[..., None]) * qw.scales[..., None]
    return np.ascontiguousarray(w.reshape(N, nb * qw.block_size).T[: qw.K])


# -- the emitter ---------------------------------------------------------------------------------


def _block_for(k_extent: int, preferred: int) -> int | None:
    """Largest valid block size <= ``preferred`` that divides ``k_extent`` (None if there is none)."""
    for b in _VALID_BLOCKS:
        if b <= preferred and k_extent % b == 0:
            return b
    return None


#: ONNX forms of a quantised linear on a grid (see the module docstring).
FORMS = ("fused", "op", "mesh")


def op_is_default() -> bool:
    """Whether quantised linears on a grid default to the ``op`` form here: the ``MeshLinearQ``
    library loads and its inner loop is vectorised (:data:`FAST_LOOPS`).  Elsewhere (ARM, x86
    before AVX2) they default to fused ``MatMulNBits``, whose kernels ONNX Runtime vectorises."""
    return mesh_op.quantized() and mesh_op.qloop() in FAST_LOOPS


class QuantLinear:
    """Linear emitter with ``bits``-bit weights (MatMulNBits or MeshLinearQ, int8 compute).

    ``inner``: the float emitter this one stands in for.  A ``TiledLinear`` (anything with a
    ``grid``) makes the quantisation per PE tile, and its ``layout`` report
    is filled in as if it had emitted the weights; ``None``/``DenseLinear`` quantises the whole
    matrix.  ``block_size``: weights per scale along K (default :data:`DEFAULT_BLOCK`; lowered to
    divide the tile size).  ``roles``: which linears to quantise (others go to ``inner``).
    ``form``: one of :data:`FORMS`; ``None`` picks ``op`` on a grid where MeshLinearQ builds,
    else ``fused``.
    """

    def __init__(
        self,
        bits: int = 8,
        inner: Any = None,
        *,
        block_size: int | None = None,
        form: str | None = None,
        accuracy_level: int = 4,
        symmetric: bool = False,
        roles: Iterable[str] | None = None,
        op: str = "nbits",
    ) -> None:
        if bits not in (4, 8):
            raise ValueError(f"bits={bits!r}: QuantLinear supports 4 or 8")
        if op not in ("nbits", "rowq"):
            raise ValueError(
                f"op={op!r}: expected 'nbits' (MatMulNBits) or 'rowq' (per-row int8 MatMulInteger)"
            )
        if op == "rowq" and bits != 8:
            raise ValueError("op='rowq' is int8 only (bits=8)")
        on_grid = getattr(inner, "grid", None) is not None
        if form is None:  # the partition executed where the op has a vector loop
            form = "op" if on_grid and op == "nbits" and op_is_default() else "fused"
        if form not in FORMS:
            raise ValueError(f"form={form!r}: expected one of {', '.join(FORMS)}")
        if form == "op":
            if op != "nbits":
                raise ValueError("form='op' runs the nbits weights (op='nbits')")
            if not on_grid:
                raise ValueError("form='op' executes a wafer grid: inner must be a TiledLinear")
            if not mesh_op.quantized():
                raise ValueError(
                    f"form='op': the MeshLinearQ op is unavailable ({mesh_op.why_not_quantized()})"
                )
        block_size = DEFAULT_BLOCK[bits] if block_size is None else int(block_size)
        if block_size not in _VALID_BLOCKS:
            raise ValueError(f"block_size={block_size!r} must be one of {_VALID_BLOCKS}")
        if accuracy_level not in (0, 1, 2, 3, 4):
            raise ValueError(f"accuracy_level={accuracy_level!r} must be 0..4")
        self.bits = bits
        self.inner = inner
        self.block_size = block_size
        self.form = form
        self.accuracy_level = accuracy_level
        self.symmetric = symmetric
        self.roles = frozenset(roles) if roles is not None else None
        self.op = op
        # int8-rowq's weights as uint8 (zero point 128) where the CPU has no int8 dot product:
        # there ONNX Runtime's u8 x s8 kernel sums pairs of products in saturating int16
        # (255 x 127 x 2 > 32767) and its u8 x u8 one widens to int16 first (exact)
        self.rowq_unsigned = op == "rowq" and not int8_dot()
        self.layout: dict[str, dict] = {}

    @property
    def precision(self) -> str:
        return f"int{self.bits}" + ("-rowq" if self.op == "rowq" else "")

    @property
    def verify_margin(self) -> float:
        """Relative top-2 logit margin under which speculative decoding re-decides a batched
        pass's argmax with a single step.  A batched pass can quantise an activation one code
        differently from a single step (float noise upstream crossing a rounding boundary; for
        MatMulNBits also its own per-batch kernel).  The margins sit above how far rows move
        (``python -m engine.lab.precisions --consistency 9`` shows it for a model).  MeshLinearQ
        quantises each row on its own like int8-rowq, so only upstream float noise moves a row."""
        if self.op == "rowq" or self.form == "op":
            return 6e-3
        return 2e-2  # (MatMulNBits does not speculate: max_verify_tokens)

    @property
    def accepts_3d(self) -> bool:
        """[1, S, K] activations are fine (MatMulNBits / MatMulInteger broadcast over leading axes;
        every axis below is counted from the end), unless unquantised roles go to an inner
        emitter that needs 2-D."""
        return self.roles is None or bool(getattr(self.inner, "accepts_3d", False))

    @property
    def max_verify_tokens(self) -> int | None:
        """Most tokens one pass may hold for speculative verification (None: no limit).

        MatMulNBits: 1, i.e. no speculation.  Its batched kernels quantise activations differently
        from its single-row one, so a verified token could differ from plain greedy decoding, and a
        multi-token pass costs several single steps: speculation would be neither exact nor fast.
        int8-rowq and MeshLinearQ (form ``op``) quantise each row themselves and verify cheaply.
        """
        return None if self.op == "rowq" or self.form == "op" else 1

    @property
    def custom_op_libraries(self) -> tuple[str, ...]:
        """The MeshLinearQ library (form ``op``), and the float emitter's op libraries when linears
        outside ``roles`` are emitted by it."""
        libs = (
            tuple(getattr(self.inner, "custom_op_libraries", ())) if self.roles is not None else ()
        )
        if self.form == "op" and mesh_op.library() not in libs:
            libs += (mesh_op.library(),)
        return libs

    @property
    def fuses_norm(self) -> bool:
        """Form ``op`` runs the RMSNorm before a linear in MeshLinearQ (``norm=`` of :meth:`emit`
        and :meth:`emit_gated`; see ``engine.wafer.partition.mesh_node``)."""
        return self.form == "op" and self.op == "nbits" and self.roles is None

    def cache_key(self) -> str:
        inner = getattr(self.inner, "cache_key", None)
        inner_key = inner() if callable(inner) else "dense"
        roles = "all" if self.roles is None else "+".join(sorted(self.roles))
        if self.op == "rowq":
            u8 = "-u8" if self.rowq_unsigned else ""
            return f"rowq8{u8}-{self.form}-{roles}-v2/{inner_key}"
        # 4-bit: v5 / v3 since its scales are half floats
        form = ("meshq-v5" if self.bits == 4 else "meshq-v4") if self.form == "op" else self.form
        version = "v3" if self.bits == 4 else "v2"
        return (
            f"q{self.bits}-b{self.block_size}-{form}-acc{self.accuracy_level}"
            f"-{'sym' if self.symmetric else 'asym'}-{roles}-{version}/{inner_key}"
        )

    # The K extents each quantisation must respect: one per mesh line along the reduction axis.
    def _k_parts(self, shape: tuple[int, int], role: str) -> list[int]:
        grid = getattr(self.inner, "grid", None)
        if grid is None:
            return [shape[0]]
        R, C = grid
        return block_sizes(shape[0], R if reduce_axis(role) == "rows" else C)

    def quantize(self, w: np.ndarray, block: int) -> QuantizedWeight:
        """The MatMulNBits form of one weight (a subclass may keep codes it already has)."""
        return quantize_blockwise(w, self.bits, block, symmetric=self.symmetric)

    def _nbits(self, gb, x: str, w: np.ndarray, name: str, block: int) -> str:
        qw = self.quantize(w, block)
        ins = [
            x,
            gb.initializer(f"{name}.q{self.bits}", qw.packed),
            gb.initializer(f"{name}.scales", qw.scales),
        ]
        if qw.zero_points is not None:
            ins.append(gb.initializer(f"{name}.zero_points", qw.zero_points))
        return gb.node(
            "MatMulNBits",
            ins,
            domain=MS_DOMAIN,
            name=f"{name}/matmul_nbits",
            K=qw.K,
            N=qw.N,
            bits=self.bits,
            block_size=block,
            accuracy_level=self.accuracy_level or None,
        )

    def _mesh_q(
        self,
        gb,
        x: str,
        w: np.ndarray,
        parts: list[int],
        name: str,
        block: int,
        bias=None,
        *,
        glu: str | None = None,
        out_n: int | None = None,
        norm=None,
    ):
        """One MeshLinearQ node: each mesh line's tiles quantised on their own (blocks never cross
        a line), stored in the op's layout; the op adds ``bias`` after the reduction.  ``glu``:
        ``w`` is in the op's ``glu`` column order and the node returns act(gate) * up, ``out_n``
        columns.  ``norm``: the op's RMSNorm prologue (returns ``(y, sum)``, see ``mesh_node``)."""
        offs = np.cumsum([0] + parts)
        ins = [x, None]
        N = w.shape[1] if out_n is None else out_n
        for p in range(len(parts)):
            c, s, z = self._pack_line(w[offs[p] : offs[p + 1]], block)
            ins += [
                gb.initializer(f"{name}.line{p}.q{self.bits}", c),
                gb.initializer(f"{name}.line{p}.scales", s),
                gb.initializer(f"{name}.line{p}.zero_points", z),
            ]
        ins[1] = gb.initializer(f"{name}.mesh_shape", np.array([N, *parts], np.int64))
        if bias is not None:
            ins.append(gb.initializer(f"{name}.bias", np.asarray(bias, dtype=np.float32)))
        return mesh_node(
            gb,
            mesh_op.QOP,
            x,
            ins[1:],
            name=f"{name}/mesh_linear_q" + ("_glu" if glu else ""),
            norm=norm,
            bits=self.bits,
            block_size=block,
            glu=mesh_op.GLU[glu] if glu else None,
        )

    def _pack_line(self, w: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One mesh line's tiles ``w[k, N]`` quantised and packed in MeshLinearQ's layout, a run
        of whole panels at a time: the temporaries stay a few MB even for a 150k-column LM head.
        The runs are spread over threads (:func:`quant_threads`, each with its share of
        ``QUANT_CHUNK``): building a graph is mostly this, and numpy's loops release the GIL."""
        k, N = w.shape
        panels = -(-N // mesh_op.PANEL)
        threads = quant_threads()
        step = max(1, QUANT_CHUNK // threads // (k * mesh_op.PANEL)) * mesh_op.PANEL
        out = mesh_op.empty_quantized(panels, k, block, self.bits)

        def run(n0: int, cols: np.ndarray) -> None:
            qw = quantize_blockwise(cols, self.bits, block, symmetric=self.symmetric, threads=1)
            codes, zps = unpack_codes(qw)
            q0 = n0 // mesh_op.PANEL
            for o, a in zip(out, mesh_op.pack_quantized(codes, qw.scales, zps, self.bits)):
                o[q0 : q0 + a.shape[0]] = a

        in_column_runs(w, step, run, threads)
        return out

    def emit(
        self,
        gb,
        x: str,
        weight: np.ndarray,
        *,
        name: str,
        role: str,
        bias: np.ndarray | None = None,
        norm=None,
    ):
        """``x @ weight (+ bias)`` with quantised weights; with ``norm`` (``fuses_norm`` only)
        MeshLinearQ's RMSNorm prologue first, and the result is ``(y, sum)``."""
        if norm is not None and not self.fuses_norm:
            raise ValueError(f"{name}: this emitter does not fuse norms (form {self.form!r})")
        if self.roles is not None and role not in self.roles:
            inner = self.inner
            if inner is None:
                inner = DenseLinear()
            return inner.emit(gb, x, weight, name=name, role=role, bias=bias)
        w = as_weight(weight)  # a lazy tied head stays lazy: the forms read it in column chunks
        if w.ndim != 2:
            raise ValueError(f"{name}: weight must be 2-D [K, N], got shape {w.shape}")
        K, N = w.shape
        parts = self._k_parts((K, N), role)
        kb = parts[0]
        if self.op == "rowq":
            return self._emit_rowq(gb, x, w, parts, name, role, bias)
        block = _block_for(kb, self.block_size) if len(parts) > 1 else self.block_size
        form = (
            self.form if block is not None or self.form == "op" else "mesh"
        )  # no block fits: mesh lines
        if form == "op":  # the op adds the bias (and runs the norm)
            block = block or self.block_size
            self._record(name, role, (K, N), parts, block, form)
            return self._mesh_q(gb, x, w, parts, name, block, bias, norm=norm)
        if form == "fused":
            y = self._nbits(gb, x, w, name, block)
        else:
            offs = np.cumsum([0] + parts)
            xs = (
                gb.node(
                    "Split",
                    [x, gb.const_i64(parts)],
                    n_out=len(parts),
                    name=f"{name}/split_k",
                    axis=-1,
                )
                if len(parts) > 1
                else [x]
            )
            ys = [
                self._nbits(
                    gb,
                    xs[p],
                    w[offs[p] : offs[p + 1]],
                    f"{name}.line{p}",
                    _block_for(parts[p], self.block_size) or 16,
                )
                for p in range(len(parts))
            ]
            y = gb.node("Sum", ys, name=f"{name}/mesh_reduce") if len(ys) > 1 else ys[0]
        self._record(name, role, (K, N), parts, block or 16, form)
        if bias is not None:
            b = gb.initializer(f"{name}.bias", np.asarray(bias, dtype=np.float32))
            y = gb.node("Add", [y, b], name=f"{name}/bias")
        return y

    def emit_attention(self, gb, inputs: list[str], *, name: str, heads, kv_heads, scale):
        """The decoder's attention as ``spark.wafer::DecoderAttention`` where this emitter's graphs
        load the op library (form ``op``), else the inner emitter's choice (``None``: GQA)."""
        if self.form == "op":
            return mesh_op.emit_attention(
                gb, inputs, name=name, heads=heads, kv_heads=kv_heads, scale=scale
            )
        inner = getattr(self.inner, "emit_attention", None)
        if inner is None or self.roles is None:  # inner's libraries are only loaded with roles
            return None
        return inner(gb, inputs, name=name, heads=heads, kv_heads=kv_heads, scale=scale)

    def emit_gated(
        self,
        gb,
        x: str,
        weight: np.ndarray,
        *,
        name: str,
        act: str,
        bias: np.ndarray | None = None,
        norm=None,
    ):
        """A gated MLP's ``act(x @ W_gate) * (x @ W_up)`` as one ``MeshLinearQ(glu=...)`` node
        (form ``op``; see ``TiledLinear.emit_gated``; ``norm`` as :meth:`emit`).  Quantisation blocks run along K within
        one column, so storing the columns in the op's ``glu`` order quantises every column
        exactly as :meth:`emit` does: the same codes and dot products, only the gating moves
        into the op.  ``None`` where this emitter cannot (other forms, rowq, an activation the
        op lacks); ``gate_up`` outside ``roles`` goes to the inner emitter's ``emit_gated``."""
        if self.roles is not None and "gate_up" not in self.roles:
            inner = getattr(self.inner, "emit_gated", None)
            kw = {} if norm is None else {"norm": norm}
            return inner(gb, x, weight, name=name, act=act, bias=bias, **kw) if inner else None
        if self.form != "op" or self.op != "nbits" or act not in mesh_op.GLU:
            return None
        w = np.asarray(weight, dtype=np.float32)
        K, N2 = w.shape
        if N2 % 2:
            raise ValueError(f"{name}: a [gate | up] weight needs an even column count, got {N2}")
        F = N2 // 2
        parts = self._k_parts((K, N2), "gate_up")
        block = (
            _block_for(parts[0], self.block_size) if len(parts) > 1 else None
        ) or self.block_size
        glu_bias = mesh_op.glu_interleave(bias, F) if bias is not None else None
        self._record(name, "gate_up", (K, N2), parts, block, "op", glu=act)
        return self._mesh_q(
            gb,
            x,
            mesh_op.glu_interleave(w, F),
            parts,
            name,
            block,
            glu_bias,
            glu=act,
            out_n=F,
            norm=norm,
        )

    def _record(
        self, name: str, role: str, shape, parts: list[int], block: int, form: str, **extra
    ) -> None:
        """Fill in this emitter's ``layout`` report for one linear (and the inner TiledLinear's)."""
        K, N = shape
        self.layout[name] = {
            "role": role,
            "shape": (K, N),
            "k_tiles": parts,
            "bits": self.bits,
            "block_size": block,
            "form": form,
            **extra,
        }
        inner_layout = getattr(self.inner, "layout", None)
        if isinstance(inner_layout, dict) and getattr(self.inner, "grid", None) is not None:
            R, C = self.inner.grid
            axis = reduce_axis(role)
            inner_layout[name] = {
                "role": role,
                "shape": (K, N),
                "grid": (R, C),
                "reduce_axis": axis,
                "k_blocks": parts,
                "n_blocks": block_sizes(N, C if axis == "rows" else R),
                "quant": f"int{self.bits}/b{block}/{form}",
                **extra,
            }

    def _emit_rowq(
        self,
        gb,
        x: str,
        w: np.ndarray,
        parts: list[int],
        name: str,
        role: str,
        bias: np.ndarray | None,
    ) -> str:
        """int8 weights (one scale per output column) x int8 activations (one scale per row).

        Every row is quantised on its own, so a row's result does not depend on the other rows of
        the batch: a k-token verification pass gives bit-for-bit the logits of k single steps
        (which MatMulNBits' batched kernel does not promise, and which it runs ~per row anyway).
        The mesh form reduces the lines' int32 partial sums with integer Adds (exact); the fused
        form is one MatMulInteger (ORT may fuse it with the rescale into MatMulIntegerToFloat).
        """
        K, N = w.shape
        col = np.empty(N, np.float32)
        q = np.empty((K, N), np.int8)
        step = max(1, QUANT_CHUNK // K)  # column chunks: no full-size float temporaries
        for n0 in range(0, N, step):
            wc = w[:, n0 : n0 + step]
            c = np.abs(wc).max(axis=0) / 127.0
            c[c == 0] = 1.0
            col[n0 : n0 + step] = c
            q[:, n0 : n0 + step] = np.clip(np.round(wc / c), -127, 127)
        amax = gb.node(
            "ReduceMax",
            [gb.node("Abs", [x], name=f"{name}/abs")],
            name=f"{name}/row_max",
            axes=[-1],
            keepdims=1,
        )
        row = gb.node(
            "Max",
            [
                gb.node("Mul", [amax, gb.const_f32(1.0 / 127.0)], name=f"{name}/row_scale0"),
                gb.const_f32(1e-30),
            ],
            name=f"{name}/row_scale",
        )
        xr = gb.node(
            "Round", [gb.node("Div", [x, row], name=f"{name}/x_div")], name=f"{name}/x_round"
        )
        xq = gb.node(
            "Cast",
            [gb.node("Add", [xr, gb.const_f32(128.0)], name=f"{name}/x_shift")],
            name=f"{name}/x_u8",
            to=TensorProto_UINT8,
        )
        zp = gb.initializer(f"{name}.x_zero_point", np.array(128, np.uint8))
        w_zp: list[str] = []
        if self.rowq_unsigned:  # (see __init__) the same products, from q + 128 and zero point 128
            q = (q.astype(np.int16) + 128).astype(np.uint8)
            w_zp = [gb.initializer(f"{name}.w_zero_point", np.array(128, np.uint8))]
        if self.form == "fused" or len(parts) == 1:
            acc = gb.node(
                "MatMulInteger",
                [xq, gb.initializer(f"{name}.q8", q), zp, *w_zp],
                name=f"{name}/matmul_int8",
            )
        else:
            offs = np.cumsum([0] + parts)
            xs = gb.node(
                "Split",
                [xq, gb.const_i64(parts)],
                n_out=len(parts),
                name=f"{name}/split_k",
                axis=-1,
            )
            acc = None
            for p in range(len(parts)):
                qp = gb.initializer(
                    f"{name}.line{p}.q8", np.ascontiguousarray(q[offs[p] : offs[p + 1]])
                )
                part = gb.node("MatMulInteger", [xs[p], qp, zp, *w_zp], name=f"{name}/line{p}_int8")
                acc = (
                    part
                    if acc is None
                    else gb.node("Add", [acc, part], name=f"{name}/line{p}_reduce")
                )
        scale = gb.node(
            "Mul",
            [row, gb.initializer(f"{name}.col_scale", col.astype(np.float32))],
            name=f"{name}/scale",
        )
        y = gb.node(
            "Mul",
            [gb.node("Cast", [acc], name=f"{name}/acc_f32", to=TensorProto_FLOAT), scale],
            name=f"{name}/dequant",
        )
        self.layout[name] = {
            "role": role,
            "shape": (K, N),
            "k_tiles": parts,
            "bits": 8,
            "block_size": K,
            "form": self.form if len(parts) > 1 else "fused",
            "op": "rowq",
        }
        if bias is not None:
            y = gb.node(
                "Add",
                [y, gb.initializer(f"{name}.bias", np.asarray(bias, dtype=np.float32))],
                name=f"{name}/bias",
            )
        return y
