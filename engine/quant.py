"""Quantised weights: int8 / 4-bit linear emitters for the decoder graph, and a measured choice.

Decode on a small model is bound by the bytes of weights read per token (see
``../shared/research/engine.md``), so storing them in 8 or 4 bits is the largest single lever after
the KV cache.  :class:`QuantLinear` is a *linear emitter* (same interface as
``engine.graph.DenseLinear``): every weight matmul, the LM head included, becomes one
``com.microsoft.MatMulNBits`` node with ``accuracy_level=4`` — ORT quantises the activations per
block to int8 and uses VNNI int8 dot products, so the weights stay small *and* the arithmetic is
integer ('int8', 'int4').  'int8-rowq' instead quantises each activation row itself and runs
``MatMulInteger``: a bit slower per token, but rows never depend on each other and multi-token
passes are cheap — what speculative verification needs.

Composition with the wafer partitioning (``engine.wafer.partition.TiledLinear``, the engine's
default): with ``inner=TiledLinear(...)`` the weight is quantised **per PE tile** — every
quantisation block lies inside one tile (the block size divides the tile's K extent), so each PE
holds its own int codes and scales, exactly as it would on the mesh.  Two ONNX forms:

* ``form="fused"`` (default): one MatMulNBits over the whole weight.  Because blocks never cross a
  tile boundary, this computes the same per-tile products and sums them over the mesh axis inside
  the kernel's K loop — the mesh reduction is fused into the op.
* ``form="mesh"``: the input is split along the reduction axis, one MatMulNBits per mesh line
  and an explicit ``Sum`` (the reduction as a separate op, like TiledLinear's ReduceSum).  Same
  numbers; ~2x slower on CPU (measured in BENCHMARKS.md), kept for inspection and tests.

:func:`choose_precision` measures fp32 against the quantised candidates on the model itself (decode
tok/s and greedy agreement) and returns the fastest one that agrees with fp32 on at least 95 % of
tokens; the decision is cached on disk so an engine start pays for it once per model and machine.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

log = logging.getLogger(__name__)

MS_DOMAIN = "com.microsoft"
TensorProto_UINT8, TensorProto_FLOAT = 2, 1  # onnx.TensorProto.UINT8 / FLOAT (no onnx import here)
PRECISIONS = ("fp32", "int8", "int8-rowq", "int4")
#: precision -> QuantLinear arguments
QUANT_ARGS = {"int8": {"bits": 8}, "int8-rowq": {"bits": 8, "op": "rowq"}, "int4": {"bits": 4}}
#: Default quantisation block (weights per scale along K) per bit width, from the measurements in
#: BENCHMARKS.md: 4-bit needs small blocks to keep greedy agreement, 8-bit does not.
DEFAULT_BLOCK = {8: 128, 4: 32}
_VALID_BLOCKS = (256, 128, 64, 32, 16)  # MatMulNBits: a power of two >= 16
#: choose_precision takes int8-rowq over a faster qualifier when it is at least this fast relative
#: to it: its 9-token passes cost ~1.5 steps where MatMulNBits' cost ~2.7 (BENCHMARKS.md), and
#: unlike MatMulNBits it can verify speculative drafts.
ROWQ_PREFERENCE = 0.9
#: Among the other qualifiers, one with higher greedy agreement is taken over a faster one when it is
#: at least this fast relative to it: int8 and int4 decode within ~15% of each other here and swap
#: places from run to run, while int8 agrees with fp32 on ~99% of tokens and int4 on ~95%.
AGREEMENT_PREFERENCE = 0.85


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


def quantize_blockwise(weight: np.ndarray, bits: int, block_size: int, *, symmetric: bool = False) -> QuantizedWeight:
    """Round-to-nearest block quantisation of ``W[K, N]`` along K (one scale per block and column).

    Asymmetric (min/max with a zero point) by default: it keeps a block's whole range and measurably
    improves 4-bit greedy agreement; ``symmetric=True`` drops the zero points.
    """
    if bits not in (4, 8):
        raise ValueError(f"bits={bits!r}: only 4 and 8 are supported")
    if block_size not in _VALID_BLOCKS:
        raise ValueError(f"block_size={block_size!r} must be one of {_VALID_BLOCKS}")
    w = np.asarray(weight, dtype=np.float32)
    if w.ndim != 2:
        raise ValueError(f"weight must be 2-D [K, N], got shape {w.shape}")
    K, N = w.shape
    nb = -(-K // block_size)
    padded = np.zeros((nb * block_size, N), np.float32)
    padded[:K] = w
    blocks = padded.T.reshape(N, nb, block_size).astype(np.float64)
    qmax = (1 << bits) - 1
    if symmetric:
        half = 1 << (bits - 1)
        amax = np.abs(blocks).max(-1)
        scale = amax / (half - 1)
        scale[scale == 0] = 1.0
        zp = np.full((N, nb), half, np.int64)
    else:
        lo = np.minimum(blocks.min(-1), 0.0)
        hi = np.maximum(blocks.max(-1), 0.0)
        scale = (hi - lo) / qmax
        scale[scale == 0] = 1.0
        zp = np.clip(np.round(-lo / scale), 0, qmax).astype(np.int64)
    q = np.clip(np.round(blocks / scale[..., None]) + zp[..., None], 0, qmax).astype(np.uint8)
    if bits == 4:
        packed = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
    else:
        packed = q
    zero_points = None
    if not symmetric:
        z = zp.astype(np.uint8)
        if bits == 4:
            if nb % 2:
                z = np.concatenate([z, np.zeros((N, 1), np.uint8)], axis=1)
            z = (z[:, 0::2] | (z[:, 1::2] << 4)).astype(np.uint8)
        zero_points = np.ascontiguousarray(z)
    return QuantizedWeight(np.ascontiguousarray(packed), scale.astype(np.float32), zero_points, K, N, bits, block_size)


def dequantize(qw: QuantizedWeight) -> np.ndarray:
    """The float32 ``W[K, N]`` a :class:`QuantizedWeight` represents (reference for tests)."""
    N, nb, _ = qw.packed.shape
    if qw.bits == 4:
        codes = np.empty((N, nb, qw.block_size), np.uint8)
        codes[..., 0::2] = qw.packed & 0x0F
        codes[..., 1::2] = qw.packed >> 4
    else:
        codes = qw.packed
    if qw.zero_points is None:
        zp = np.full((N, nb), 1 << (qw.bits - 1), np.float32)
    elif qw.bits == 4:
        zp = np.empty((N, qw.zero_points.shape[1] * 2), np.float32)
        zp[:, 0::2] = qw.zero_points & 0x0F
        zp[:, 1::2] = qw.zero_points >> 4
        zp = zp[:, :nb]
    else:
        zp = qw.zero_points.astype(np.float32)
    w = (codes.astype(np.float32) - zp[..., None]) * qw.scales[..., None]
    return np.ascontiguousarray(w.reshape(N, nb * qw.block_size).T[: qw.K])


# -- the emitter ---------------------------------------------------------------------------------

def _block_for(k_extent: int, preferred: int) -> int | None:
    """Largest valid block size <= ``preferred`` that divides ``k_extent`` (None if there is none)."""
    for b in _VALID_BLOCKS:
        if b <= preferred and k_extent % b == 0:
            return b
    return None


class QuantLinear:
    """Linear emitter with ``bits``-bit weights (MatMulNBits, int8 compute).

    ``inner``: the float emitter this one stands in for.  A ``TiledLinear`` (anything with a
    ``grid``) makes the quantisation per PE tile, and its ``layout`` report
    is filled in as if it had emitted the weights; ``None``/``DenseLinear`` quantises the whole
    matrix.  ``block_size``: weights per scale along K (default :data:`DEFAULT_BLOCK`; lowered to
    divide the tile size).  ``roles``: which linears to quantise (others go to ``inner``).
    """

    def __init__(self, bits: int = 8, inner: Any = None, *, block_size: int | None = None, form: str = "fused",
                 accuracy_level: int = 4, symmetric: bool = False, roles: Iterable[str] | None = None,
                 op: str = "nbits") -> None:
        if bits not in (4, 8):
            raise ValueError(f"bits={bits!r}: QuantLinear supports 4 or 8")
        if op not in ("nbits", "rowq"):
            raise ValueError(f"op={op!r}: expected 'nbits' (MatMulNBits) or 'rowq' (per-row int8 MatMulInteger)")
        if op == "rowq" and bits != 8:
            raise ValueError("op='rowq' is int8 only (bits=8)")
        if form not in ("fused", "mesh"):
            raise ValueError(f"form={form!r}: expected 'fused' or 'mesh'")
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
        self.layout: dict[str, dict] = {}

    @property
    def precision(self) -> str:
        return f"int{self.bits}" + ("-rowq" if self.op == "rowq" else "")

    @property
    def verify_margin(self) -> float:
        """Relative top-2 logit margin under which speculative decoding re-decides a batched
        pass's argmax with a single step.  A batched pass can quantise an activation one code
        differently from a single step (float noise upstream crossing a rounding boundary; for
        MatMulNBits also its own per-batch kernel): measured on the bundled model with
        ``python -m engine.quant --consistency 9``, rows move by up to ~3e-3 (int8-rowq, 2 % of rows)
        and ~8e-3 (MatMulNBits, 15 % of rows) of the logit scale; the margins leave headroom."""
        return 6e-3 if self.op == "rowq" else 2e-2  # (MatMulNBits does not speculate: max_verify_tokens)

    @property
    def accepts_3d(self) -> bool:
        """[1, S, K] activations are fine (MatMulNBits / MatMulInteger broadcast over leading axes;
        every axis below is counted from the end), unless unquantised roles go to an inner
        emitter that needs 2-D."""
        return self.roles is None or bool(getattr(self.inner, "accepts_3d", False))

    @property
    def max_verify_tokens(self) -> int | None:
        """Most tokens one pass may hold for speculative verification (None: no limit).

        MatMulNBits: 1, i.e. no speculation.  Its batched kernel quantises activations differently
        from its single-row one (up to ~8e-3 of the logit scale on 15 % of rows of the bundled
        model; from 16 rows on (int8) / 9 (int4) a third kernel, ~1e-2 everywhere), so a verified
        token could differ from plain greedy decoding, and a 9-token pass costs ~2.7 single steps
        — speculation would be neither exact nor fast (measured: BENCHMARKS.md).  int8-rowq
        quantises each row itself and verifies cheaply.
        """
        return None if self.op == "rowq" else 1

    @property
    def custom_op_libraries(self) -> tuple[str, ...]:
        """The float emitter's op libraries: linears outside ``roles`` are emitted by it."""
        return tuple(getattr(self.inner, "custom_op_libraries", ())) if self.roles is not None else ()

    def cache_key(self) -> str:
        inner = getattr(self.inner, "cache_key", None)
        inner_key = inner() if callable(inner) else "dense"
        roles = "all" if self.roles is None else "+".join(sorted(self.roles))
        if self.op == "rowq":
            return f"rowq8-{self.form}-{roles}-v2/{inner_key}"
        return (f"q{self.bits}-b{self.block_size}-{self.form}-acc{self.accuracy_level}"
                f"-{'sym' if self.symmetric else 'asym'}-{roles}-v2/{inner_key}")

    # The K extents each quantisation must respect: one per mesh line along the reduction axis.
    def _k_parts(self, shape: tuple[int, int], role: str) -> list[int]:
        grid = getattr(self.inner, "grid", None)
        if grid is None:
            return [shape[0]]
        from .wafer.partition import block_sizes, reduce_axis

        R, C = grid
        return block_sizes(shape[0], R if reduce_axis(role) == "rows" else C)

    def _nbits(self, gb, x: str, w: np.ndarray, name: str, block: int) -> str:
        qw = quantize_blockwise(w, self.bits, block, symmetric=self.symmetric)
        ins = [x, gb.initializer(f"{name}.q{self.bits}", qw.packed), gb.initializer(f"{name}.scales", qw.scales)]
        if qw.zero_points is not None:
            ins.append(gb.initializer(f"{name}.zero_points", qw.zero_points))
        return gb.node("MatMulNBits", ins, domain=MS_DOMAIN, name=f"{name}/matmul_nbits", K=qw.K, N=qw.N,
                       bits=self.bits, block_size=block, accuracy_level=self.accuracy_level or None)

    def emit(self, gb, x: str, weight: np.ndarray, *, name: str, role: str, bias: np.ndarray | None = None) -> str:
        if self.roles is not None and role not in self.roles:
            inner = self.inner
            if inner is None:
                from .graph import DenseLinear
                inner = DenseLinear()
            return inner.emit(gb, x, weight, name=name, role=role, bias=bias)
        w = np.asarray(weight, dtype=np.float32)
        if w.ndim != 2:
            raise ValueError(f"{name}: weight must be 2-D [K, N], got shape {w.shape}")
        K, N = w.shape
        parts = self._k_parts((K, N), role)
        kb = parts[0]
        if self.op == "rowq":
            return self._emit_rowq(gb, x, w, parts, name, role, bias)
        block = _block_for(kb, self.block_size) if len(parts) > 1 else self.block_size
        form = self.form if block is not None else "mesh"  # no block fits the tiles: explicit mesh lines
        if form == "fused":
            y = self._nbits(gb, x, w, name, block)
        else:
            offs = np.cumsum([0] + parts)
            xs = gb.node("Split", [x, gb.const_i64(parts)], n_out=len(parts), name=f"{name}/split_k",
                         axis=-1) if len(parts) > 1 else [x]
            ys = [self._nbits(gb, xs[p], np.ascontiguousarray(w[offs[p]:offs[p + 1]]), f"{name}.line{p}",
                              _block_for(parts[p], self.block_size) or 16)
                  for p in range(len(parts))]
            y = gb.node("Sum", ys, name=f"{name}/mesh_reduce") if len(ys) > 1 else ys[0]
        self.layout[name] = {"role": role, "shape": (K, N), "k_tiles": parts, "bits": self.bits,
                             "block_size": block or 16, "form": form}
        inner_layout = getattr(self.inner, "layout", None)
        if isinstance(inner_layout, dict) and getattr(self.inner, "grid", None) is not None:
            from .wafer.partition import block_sizes, reduce_axis

            R, C = self.inner.grid
            axis = reduce_axis(role)
            inner_layout[name] = {"role": role, "shape": (K, N), "grid": (R, C), "reduce_axis": axis,
                                  "k_blocks": parts, "n_blocks": block_sizes(N, C if axis == "rows" else R),
                                  "quant": f"int{self.bits}/b{block or 16}/{form}"}
        if bias is not None:
            b = gb.initializer(f"{name}.bias", np.asarray(bias, dtype=np.float32))
            y = gb.node("Add", [y, b], name=f"{name}/bias")
        return y


    def _emit_rowq(self, gb, x: str, w: np.ndarray, parts: list[int], name: str, role: str,
                   bias: np.ndarray | None) -> str:
        """int8 weights (one scale per output column) x int8 activations (one scale per row).

        Every row is quantised on its own, so a row's result does not depend on the other rows of
        the batch: a k-token verification pass gives bit-for-bit the logits of k single steps
        (which MatMulNBits' batched kernel does not promise, and which it runs ~per row anyway).
        The mesh form reduces the lines' int32 partial sums with integer Adds (exact); the fused
        form is one MatMulInteger (ORT may fuse it with the rescale into MatMulIntegerToFloat).
        """
        K, N = w.shape
        col = np.abs(w).max(axis=0) / 127.0
        col[col == 0] = 1.0
        q = np.clip(np.round(w / col), -127, 127).astype(np.int8)
        amax = gb.node("ReduceMax", [gb.node("Abs", [x], name=f"{name}/abs")], name=f"{name}/row_max",
                       axes=[-1], keepdims=1)
        row = gb.node("Max", [gb.node("Mul", [amax, gb.const_f32(1.0 / 127.0)], name=f"{name}/row_scale0"),
                              gb.const_f32(1e-30)], name=f"{name}/row_scale")
        xr = gb.node("Round", [gb.node("Div", [x, row], name=f"{name}/x_div")], name=f"{name}/x_round")
        xq = gb.node("Cast", [gb.node("Add", [xr, gb.const_f32(128.0)], name=f"{name}/x_shift")],
                     name=f"{name}/x_u8", to=TensorProto_UINT8)
        zp = gb.initializer(f"{name}.x_zero_point", np.array(128, np.uint8))
        if self.form == "fused" or len(parts) == 1:
            acc = gb.node("MatMulInteger", [xq, gb.initializer(f"{name}.q8", q), zp], name=f"{name}/matmul_int8")
        else:
            offs = np.cumsum([0] + parts)
            xs = gb.node("Split", [xq, gb.const_i64(parts)], n_out=len(parts), name=f"{name}/split_k", axis=-1)
            acc = None
            for p in range(len(parts)):
                qp = gb.initializer(f"{name}.line{p}.q8", np.ascontiguousarray(q[offs[p]:offs[p + 1]]))
                part = gb.node("MatMulInteger", [xs[p], qp, zp], name=f"{name}/line{p}_int8")
                acc = part if acc is None else gb.node("Add", [acc, part], name=f"{name}/line{p}_reduce")
        scale = gb.node("Mul", [row, gb.initializer(f"{name}.col_scale", col.astype(np.float32))], name=f"{name}/scale")
        y = gb.node("Mul", [gb.node("Cast", [acc], name=f"{name}/acc_f32", to=TensorProto_FLOAT), scale],
                    name=f"{name}/dequant")
        self.layout[name] = {"role": role, "shape": (K, N), "k_tiles": parts, "bits": 8, "block_size": K,
                             "form": self.form if len(parts) > 1 else "fused", "op": "rowq"}
        if bias is not None:
            y = gb.node("Add", [y, gb.initializer(f"{name}.bias", np.asarray(bias, dtype=np.float32))], name=f"{name}/bias")
        return y


def make_linear(precision: str, wafer: bool = True, grid=None, **kw) -> Any:
    """The linear emitter for ``precision`` on the engine's float emitter.

    'fp32': the float emitter itself; 'int8' / 'int4': MatMulNBits (block-quantised weights, int8
    compute); 'int8-rowq': per-row int8 activations x per-column int8 weights with MatMulInteger
    (cheaper multi-token passes: speculative verification, prefill).

    ``wafer``/``grid`` mean what they mean for ``Engine.load``: the float emitter is TiledLinear
    (partitioned, the default) or DenseLinear; quantised precisions wrap it per tile.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}: expected one of {PRECISIONS}")
    from .engine import _linear_emitter

    base = _linear_emitter(wafer, grid)
    if precision == "fp32":
        return base
    return QuantLinear(inner=base, **{**QUANT_ARGS[precision], **kw})


def load_engine(model_dir: str | Path | None, linear: Any, **kw):
    """``Engine.load`` with an explicit linear emitter (e.g. ``make_linear("int8")``); ``kw`` are
    ``Engine.load``'s options (threads, cache_dir, slots, max_context, spinning, ...)."""
    from .engine import Engine

    return Engine.load(model_dir, linear=linear, **kw)


# -- measuring -----------------------------------------------------------------------------------

def eval_prompts(tokenizer, count: int = 8, length: int = 192, seed: int = 0,
                 files: Sequence[Path] | None = None) -> list[list[int]]:
    """Token windows of real Python source, fixed by ``seed``: ``files`` (e.g. a model's held-out
    files), else this Python's standard library.  Real code gives a meaningful agreement figure;
    random tokens would not (their logits are nearly flat).
    """
    import sysconfig

    if files is None:
        lib = Path(sysconfig.get_paths()["stdlib"])
        files = [p for p in lib.glob("*.py") if p.stat().st_size > 8000]
    files = sorted(Path(f) for f in files if Path(f).is_file() and Path(f).stat().st_size > 2000)
    if not files:
        raise RuntimeError("no Python sources found to build evaluation prompts from")
    rng = np.random.default_rng(seed)
    prompts: list[list[int]] = []
    for f in rng.permutation(len(files)):
        if len(prompts) >= count:
            break
        ids = tokenizer.encode(files[f].read_text(encoding="utf-8", errors="replace"))
        if len(ids) < length + 64:
            continue
        start = int(rng.integers(0, len(ids) - length - 64))
        prompts.append(ids[start:start + length])
    return prompts


def heldout_files(folder: Path, minimum: int = 4) -> list[Path] | None:
    """The files a model folder's ``heldout_files.txt`` lists (code it was not trained on), when at
    least ``minimum`` of them exist on this machine; else None."""
    from .evaluate import resolve_files  # reads an @list as `spark-lsp eval --files @list` does

    try:
        listed = resolve_files([f"@{Path(folder) / 'heldout_files.txt'}"])
    except ValueError:  # no list, or an empty one
        return None
    files = [p for p in listed if p.is_file()]
    return files if len(files) >= minimum else None


def greedy_agreement(ref, test, prompts: Sequence[Sequence[int]], max_new_tokens: int = 64) -> dict[str, Any]:
    """How often ``test`` picks the same greedy token as ``ref`` (both engines on the same tokenizer).

    ``teacher_forced``: ``ref`` generates greedily; ``test`` reads the same sequence and we count the
    positions where its argmax equals ``ref``'s token (the standard per-token agreement, not
    penalising one early flip twice).  ``free_running``: both generate; the fraction of tokens
    generated before the first divergence.
    """
    from .generate import GenerationParams

    nv = min(ref.sample_vocab, test.sample_vocab)
    params = GenerationParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    agree = total = same_prefix = gen_total = 0
    per_prompt = []
    for p in prompts:
        p = list(p)
        r = ref.generate(p, params)
        r.result()
        t = test.generate(p, params)
        t.result()
        logits = test.forward_logits(p + r.tokens[:-1])[len(p) - 1:]
        picks = logits[:, :nv].argmax(-1)
        a = int((picks == np.asarray(r.tokens)).sum())
        agree += a
        total += len(r.tokens)
        k = 0
        for x, y in zip(r.tokens, t.tokens):
            if x != y:
                break
            k += 1
        same_prefix += k
        gen_total += len(r.tokens)
        per_prompt.append({"tokens": len(r.tokens), "teacher_forced": a, "identical_prefix": k})
    return {"teacher_forced": agree / max(total, 1), "free_running": same_prefix / max(gen_total, 1),
            "tokens": total, "prompts": len(prompts), "per_prompt": per_prompt}


def decode_speed(eng, prompt: Sequence[int], new_tokens: int = 64, repeats: int = 3) -> float:
    """Median decode tok/s of a cold greedy generation (eos ignored), as ``spark-lsp bench`` counts it."""
    from .generate import GenerationParams

    params = GenerationParams(max_new_tokens=new_tokens, ignore_eos=True)
    rates = []
    for _ in range(repeats + 1):
        eng.reset()
        g = eng.generate(list(prompt), params)
        g.result()
        rates.append(g.stats["decode_tok_s"])
    return float(statistics.median(rates[1:] or rates))  # the first run warms the session up


def compare_decode(engines: dict[str, Any], prompt: Sequence[int], new_tokens: int = 64, rounds: int = 5,
                   settle_s: float = 0.1) -> dict[str, float]:
    """Median decode tok/s per engine, measured in alternating rounds (one generation per engine per
    round) so that every engine sees the same machine load; a warm-up round is not counted.  Each
    run starts ``settle_s`` after the last: spinning threads of the engine before it stay awake
    ~40 ms and would slow it (fp32 measured at 650 instead of ~1,600 tok/s that way)."""
    rates: dict[str, list[float]] = {name: [] for name in engines}
    for r in range(rounds + 1):
        for name, eng in engines.items():
            time.sleep(settle_s)
            rate = decode_speed(eng, prompt, new_tokens, repeats=0)
            if r:
                rates[name].append(rate)
    return {name: float(statistics.median(v)) for name, v in rates.items()}


@dataclass
class PrecisionChoice:
    """The outcome of :func:`choose_precision` (``precision`` is what to load)."""

    precision: str
    decode_tok_s: dict[str, float] = field(default_factory=dict)
    agreement: dict[str, float] = field(default_factory=dict)
    speedup: dict[str, float] = field(default_factory=dict)
    reason: str = ""
    measured_at: str = ""
    cached: bool = False
    contended: bool = False  # measured while other work competed for the CPU (speeds unreliable)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _cpu_id() -> str:
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return model


def _decision_path(cache_dir: str | Path | None, key: str) -> Path:
    from .graph_cache import cache_root

    # An explicit cache_dir holds everything (graphs and decisions); the default root's graphs/
    # folder gets a sibling precision/.
    base = Path(cache_dir).expanduser() if cache_dir is not None else cache_root().parent
    return base / "precision" / f"{key}.json"


def pick_precision(speeds: dict[str, float], agreement: dict[str, float], min_agreement: float = 0.95,
                   min_speedup: float = 1.15) -> str:
    """The rule of :func:`choose_precision` on measured decode tok/s (``speeds``, with "fp32") and
    agreement with fp32 per candidate."""
    good = [c for c in agreement if agreement[c] >= min_agreement and speeds[c] >= min_speedup * speeds["fp32"]]
    if not good:
        return "fp32"
    fastest = max(good, key=lambda c: speeds[c])
    best = max((c for c in good if speeds[c] >= AGREEMENT_PREFERENCE * speeds[fastest]), key=lambda c: agreement[c])
    if "int8-rowq" in good and speeds["int8-rowq"] >= ROWQ_PREFERENCE * speeds[best]:
        best = "int8-rowq"  # as fast within noise, and multi-token passes (speculation, prefill) are cheaper
    return best


def choose_precision(model_dir: str | Path | None, *, candidates: Sequence[str] = ("int8", "int8-rowq", "int4"),
                     wafer: bool = True,
                     grid=None, threads: int | None = None, cache_dir: str | Path | None = None,
                     min_agreement: float = 0.95, min_speedup: float = 1.15, prompts: int = 16,
                     new_tokens: int = 48, remeasure: bool = False, measure: bool = True,
                     log_fn=log.info) -> PrecisionChoice:
    """Measure fp32 and each quantised candidate on this model and machine; pick the fastest good one.

    A candidate qualifies when its teacher-forced greedy agreement with fp32 is at least
    ``min_agreement`` on real-code prompts and its decode is at least ``min_speedup`` times fp32's
    (quantising must pay for its accuracy cost).  Among qualifiers the fastest wins — except that
    the most faithful one within :data:`AGREEMENT_PREFERENCE` of its speed is taken, and int8-rowq
    within :data:`ROWQ_PREFERENCE` of that; otherwise fp32.  The decision is stored under ``<cache root>/precision/`` keyed by the weights, the
    emitter settings, the CPU model, ONNX Runtime's version and the thread count, so it is measured
    once (tens of seconds on a small model) and read back on every later start; pass
    ``remeasure=True`` to force a new measurement, ``measure=False`` to only read a stored decision
    (fp32 when there is none — e.g. a server start that must not spend the time).  A decision
    measured while the CPU was contended (``contended``) is used but measured again at the first
    start that finds the CPU calm: under load fp32 falls out of cache and every speed ratio skews.
    """
    import onnxruntime as ort

    from .runtime import cpu_contended

    from .config import model_path
    from .weights import weights_digest

    if model_dir is None:
        from .bench import resolve_model
        model_dir = resolve_model(None)
    folder = model_path(model_dir)
    bad = [c for c in candidates if c not in PRECISIONS or c == "fp32"]
    if bad:
        raise ValueError(f"candidates: {bad[0]!r} is not a quantised precision; expected some of {PRECISIONS[1:]}")
    # agreement on code the model did not train on where the folder names some (its own text
    # would flatter every precision alike), else on this Python's standard library
    agreement_files = heldout_files(folder)
    blob = json.dumps({"weights": weights_digest(folder), "candidates": list(candidates), "wafer": bool(wafer),
                       "grid": list(grid) if grid else None, "threads": threads, "cpu": _cpu_id(),
                       "ort": ort.__version__, "min_agreement": min_agreement, "min_speedup": min_speedup,
                       "agreement_prompts": prompts, "agreement_files": "heldout" if agreement_files else "stdlib",
                       "emitters": [make_linear(c, wafer, grid).cache_key() if c != "fp32" else "" for c in candidates],
                       "v": 3}, sort_keys=True)
    key = hashlib.blake2b(blob.encode(), digest_size=12).hexdigest()
    path = _decision_path(cache_dir, key)
    if path.is_file() and not remeasure:
        try:
            data = json.loads(path.read_text())
            choice = PrecisionChoice(**{**data, "cached": True})
            stale = choice.contended and measure and not cpu_contended()
            if choice.precision in PRECISIONS and not stale:
                return choice
            if stale:
                log_fn(f"precision decision for {folder.name} was measured under load; measuring again")
        except (OSError, ValueError, TypeError):
            pass  # unreadable decision: measure again
    if not measure:
        return PrecisionChoice("fp32", reason="no stored decision for this model and machine "
                                              "(measure with: python -m engine.quant --model DIR)")
    contended = cpu_contended()
    # steady thread mode: the automatic one can flip between runs and skew single ratios
    engines = {c: load_engine(folder, make_linear(c, wafer, grid), threads=threads, cache_dir=cache_dir, spinning=False)
               for c in ("fp32", *candidates)}
    ps = eval_prompts(engines["fp32"].tokenizer, count=prompts, files=agreement_files)
    speeds = compare_decode(engines, ps[0], new_tokens)
    agreement, speedup = {}, {}
    for c in candidates:
        agreement[c] = greedy_agreement(engines["fp32"], engines[c], ps, new_tokens)["teacher_forced"]
        speedup[c] = speeds[c] / speeds["fp32"]
    best = pick_precision(speeds, agreement, min_agreement, min_speedup)
    why = (f"{best}: {speedup[best]:.2f}x fp32 decode, {agreement[best]:.1%} greedy agreement" if best != "fp32"
           else "no quantised candidate was both faster (>= %.2fx) and in agreement (>= %.0f%%)"
           % (min_speedup, 100 * min_agreement))
    contended = contended or cpu_contended()
    choice = PrecisionChoice(best, speeds, agreement, speedup, why, time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                             contended=contended)
    log_fn(f"precision for {folder.name}: {why} (decode tok/s: "
           + ", ".join(f"{k} {v:.0f}" for k, v in speeds.items()) + ")")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(choice.to_dict(), indent=2))
        os.replace(tmp, path)
    except OSError as e:  # a read-only cache only costs a re-measurement next time
        log.warning("could not store the precision decision in %s: %s", path, e)
    return choice


# -- profiling -----------------------------------------------------------------------------------

def batch_consistency(eng, width: int = 9, positions: int = 30, files: Sequence[Path] | None = None) -> np.ndarray:
    """Per-row max |logits(one ``width``-token pass) - logits(single steps)| / max(|logits|, 1) at
    ``positions`` places in real code: how much a speculative verification pass can differ from
    plain decoding on this engine (float noise ~1e-7; a flipped int8 activation code ~1e-3)."""
    rt = eng.runtime
    ids = [t for p in eval_prompts(eng.tokenizer, count=2, length=300, files=files) for t in p]
    step = max(1, (len(ids) - width - 40) // positions)
    rel = []
    kv_a, kv_b = rt.new_kv(), rt.new_kv()
    for start in range(40, len(ids) - width, step)[:positions]:
        rt.forward(kv_a, ids[:start], 0)
        rt.forward(kv_b, ids[:start], 0)
        single = np.stack([rt.decode(kv_a, ids[start + i], start + i).copy() for i in range(width)])
        batch = rt.forward(kv_b, ids[start:start + width], start, num_logits=width)
        rel.extend((np.abs(batch - single).max(1) / np.maximum(np.abs(single).max(1), 1.0)).tolist())
    return np.asarray(rel)


def op_profile(eng, steps: int = 64, prompt_len: int = 61, verify: int = 0) -> dict[str, Any]:
    """Where a decode step's time goes: ONNX Runtime's own profiler over ``steps`` single-token runs
    (``verify > 0``: runs of ``verify`` tokens, like a speculative verification pass).

    Opens a second, profiling session on the engine's cached graph (same options and the same
    shared past/present KV binding as the runtime).  Returns per-op-type microseconds per run,
    sorted, the kernel total and the wall time per run (the prompt's run left out: ``prompt_len``
    is a prime, see ``engine.bench_profile.step_profile``).
    """
    import onnxruntime as ort

    from .runtime import session_options

    rt = eng.runtime
    so = session_options(rt.threads, custom_ops=rt.custom_ops,
                         profile=str(Path(os.environ.get("TMPDIR", "/tmp")) / f"spark-ort-profile-{os.getpid()}"))
    sess = ort.InferenceSession(str(eng.graph_path), so, providers=["CPUExecutionProvider"])
    binding = sess.io_binding()
    for i in range(rt.num_layers):  # one buffer bound as past and present, as the runtime does
        for t in ("key", "value"):
            v = ort.OrtValue.ortvalue_from_shape_and_type([1, rt.kv_heads, rt.max_len, rt.head_dim], np.float32)
            binding.bind_ortvalue_input(f"past.{i}.{t}", v)
            binding.bind_ortvalue_output(f"present.{i}.{t}", v)
    rng = np.random.default_rng(0)
    n = max(1, verify)
    ids = rng.integers(0, eng.sample_vocab, prompt_len + steps * n)

    names = {i.name for i in sess.get_inputs()}
    ids_shape = next(len(i.shape) for i in sess.get_inputs() if i.name == "input_ids")

    def run(tokens, pos):
        k = len(tokens)
        feeds = {"input_ids": np.asarray(tokens, np.int64).reshape((1, k) if ids_shape == 2 else (k,)),
                 "seqlens_k": np.array([pos + k - 1], np.int32), "total_sequence_length": np.array(pos + k, np.int32),
                 "num_logits": np.array([k], np.int64), "logits_from": np.array([0], np.int64)}
        for name, arr in feeds.items():
            if name in names:
                binding.bind_cpu_input(name, arr)
        binding.bind_output("logits")
        sess.run_with_iobinding(binding)

    run(ids[:prompt_len], 0)
    pos = prompt_len
    t0 = time.perf_counter()
    for _ in range(steps):
        run(ids[pos:pos + n], pos)
        pos += n
    wall = (time.perf_counter() - t0) / steps * 1e6
    path = sess.end_profiling()
    from .bench_profile import step_profile

    try:
        prof = step_profile([path], prompt_tokens=prompt_len)  # the runs after the prompt's
    finally:
        Path(path).unlink(missing_ok=True)
    return {"per_op_us": {op: o["us_per_step"] for op, o in prof["ops"].items()}, "kernel_us": prof["kernel_us"],
            "wall_us": wall, "tokens_per_run": n, "runs": prof["steps"]}


def _main(argv: list[str] | None = None) -> int:
    """``python -m engine.quant``: measure the precision choice, or profile a decode step per precision."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m engine.quant", description=_main.__doc__)
    ap.add_argument("--model", default=None, help="model folder or 'synthetic-8m' (default: the bundled model)")
    ap.add_argument("--profile", default=None, metavar="P1,P2", help="profile these precisions (e.g. fp32,int8)")
    ap.add_argument("--verify", type=int, default=0, help="with --profile: tokens per run (a verification pass)")
    ap.add_argument("--no-wafer", dest="wafer", action="store_false")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--remeasure", action="store_true", help="ignore a stored precision decision")
    ap.add_argument("--eval", dest="eval_files", action="append", metavar="GLOB",
                    help="with --precisions: `spark-lsp eval` (FIM line exact match, bits/byte) on these files "
                         "(glob or @list.txt) for every precision; with --agreement: where prompts come from")
    ap.add_argument("--eval-n", type=int, default=200, help="completion positions for --eval")
    ap.add_argument("--eval-bpb-bytes", type=int, default=100_000, help="bytes scored for bits/byte in --eval")
    ap.add_argument("--agreement", type=int, default=0, metavar="N",
                    help="with --precisions: greedy agreement with fp32 over N real-code prompts x 64 tokens")
    ap.add_argument("--precisions", default="fp32,int8,int8-rowq,int4",
                    help="precisions for --eval / --agreement / --consistency")
    ap.add_argument("--consistency", type=int, default=0, metavar="WIDTH",
                    help="with --precisions: how far WIDTH-token passes stray from single decode steps "
                         "(relative logit difference per row, over real-code positions)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    from .bench import resolve_model

    folder = resolve_model(args.model)
    files = None
    if args.eval_files:
        from .evaluate import resolve_files

        files = resolve_files(args.eval_files)
    if args.eval_files and not (args.agreement or args.consistency):
        from .evaluate import evaluate

        rows = {}
        for p in [s.strip() for s in args.precisions.split(",") if s.strip()]:
            eng = load_engine(folder, make_linear(p, wafer=args.wafer), threads=args.threads)
            r = evaluate(eng, files, n=args.eval_n, bpb_max_bytes=args.eval_bpb_bytes)
            rows[p] = {k: r.get(k) for k in ("exact_match", "edit_similarity", "bits_per_byte", "decode_tok_s_median", "n")}
            print(f"{p:10s} " + "  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                         for k, v in rows[p].items()), flush=True)
        if args.json:
            print(json.dumps(rows, indent=2))
        return 0
    if args.consistency:
        out = {}
        for p in [s.strip() for s in args.precisions.split(",") if s.strip()]:
            eng = load_engine(folder, make_linear(p, wafer=args.wafer), threads=args.threads)
            rel = batch_consistency(eng, args.consistency, files=files)
            out[p] = {"rows": int(rel.size), "median": float(np.median(rel)), "p99": float(np.percentile(rel, 99)),
                      "max": float(rel.max()), "rows_over_1e-4": int((rel > 1e-4).sum())}
            print(f"{p:10s} {args.consistency}-token pass vs single steps, relative logit difference per row: "
                  + ", ".join(f"{k} {v:.2g}" for k, v in out[p].items()), flush=True)
        if args.json:
            print(json.dumps(out, indent=2))
        return 0
    if args.agreement:
        names = [s.strip() for s in args.precisions.split(",") if s.strip() and s.strip() != "fp32"]
        ref = load_engine(folder, make_linear("fp32", wafer=args.wafer), threads=args.threads)
        prompts = eval_prompts(ref.tokenizer, count=args.agreement, files=files)
        out = {}
        for p in names:
            eng = load_engine(folder, make_linear(p, wafer=args.wafer), threads=args.threads)
            r = greedy_agreement(ref, eng, prompts, max_new_tokens=64)
            out[p] = {k: r[k] for k in ("teacher_forced", "free_running", "tokens", "prompts")}
            print(f"{p:10s} teacher-forced {r['teacher_forced']:.4f}  free-running {r['free_running']:.4f}  "
                  f"over {r['tokens']} tokens / {r['prompts']} prompts", flush=True)
        if args.json:
            print(json.dumps(out, indent=2))
        return 0
    if args.profile:
        out = {}
        for p in [s.strip() for s in args.profile.split(",") if s.strip()]:
            eng = load_engine(folder, make_linear(p, wafer=args.wafer), threads=args.threads)
            out[p] = op_profile(eng, verify=args.verify)
        if args.json:
            print(json.dumps(out, indent=2))
        else:
            for p, r in out.items():
                top = ", ".join(f"{op} {us:.0f}" for op, us in list(r["per_op_us"].items())[:8])
                print(f"{p:10s} kernels {r['kernel_us']:7.0f} us/run (wall {r['wall_us']:.0f}): {top}")
        return 0
    choice = choose_precision(folder, wafer=args.wafer, threads=args.threads, remeasure=args.remeasure,
                              log_fn=lambda s: print(s, flush=True))
    print(json.dumps(choice.to_dict(), indent=2) if args.json else
          f"{choice.precision}: {choice.reason}{' (stored decision)' if choice.cached else ''}")
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
