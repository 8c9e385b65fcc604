"""Analytic performance model: decode cycles per token and time to first token from a placement.

One decode step of a layer on its ``R x C`` region follows the MeshGEMV dataflow (see
:mod:`engine.wafer.partition`): ten phases, each a local computation on every PE followed by
an all-reduce along one mesh axis —

    norm1 (cols, 1 word) -> qkv GEMV (reduce down the columns) -> attention scores (along rows)
    -> softmax max and sum (cols) -> attention x V (cols) -> o GEMV (along rows, transposed
    storage) -> norm2 (cols, 1 word) -> gate/up GEMV (cols) -> down GEMV (rows) -> hand-off

An all-reduce over a line of ``n`` PEs with ``m`` 32-bit words per PE is a binary tree toward
the line's first PE (level ``l`` sends over ``2**l`` hops; its critical path evaluated
exactly) followed by a free router multicast back out; every message costs hops + (m - 1)
pipelined words + the ramp on both ends, every receive an ``m``-word SIMD add.  Local GEMVs
cost ``MACs / (simd * eta)``, elementwise passes one SIMD op per ``simd`` elements.

From first principles: hops, ramps, words, SIMD width, clock, I/O (the chip spec).  Fitted to
WaferLLM's Llama-3-8B decode on WSE-2 (420x420: 2,700, 540x540: 2,502, 660x660: 2,243 tok/s):
``eta`` (the fraction of SIMD peak a GEMV sustains) and ``c0`` (any fixed per-layer cycles not
modelled above, constrained to be >= 0).  :func:`calibrate` re-derives both; the shipped
constants are its output (eta = 0.131, c0 = 0: hops and compute explain the published points).  Prefill uses WaferLLM's reported end-to-end efficiency (~10% of peak).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from .chips import WSE2, Chip, load_chip
from .placement import (
    DEFAULT_BUDGET,
    ModelShape,
    Placement,
    PlacementError,
    Region,
    load_shape,
    place,
)

#: Published WaferLLM decode speeds, Llama-3-8B on WSE-2, one P x P region per layer.
WAFERLLM_POINTS = ((420, 2700.0), (540, 2502.0), (660, 2243.0))
#: Context assumed for the calibration points (attention over it is a small share of decode).
CALIBRATION_CONTEXT = 4096

#: Fitted by :func:`calibrate` (see module docstring); ``python -m engine.projection.perfmodel``
#: prints the fit.
ETA_GEMV = 0.1312
C0_CYCLES = 0.0
#: End-to-end prefill efficiency reported by WaferLLM (~10% of peak FLOPs).
ETA_PREFILL = 0.10


@dataclass(frozen=True)
class Constants:
    eta: float = ETA_GEMV
    c0: float = C0_CYCLES
    eta_prefill: float = ETA_PREFILL


def words(elems: int, chip: Chip) -> int:
    """32-bit link words for ``elems`` fp16 values."""
    return max(1, math.ceil(elems * 16 / chip.link_bits))


def tree_levels(side: int) -> int:
    """Levels of a distance-doubling tree over ``side`` PEs on one side of the root."""
    return math.ceil(math.log2(side + 1)) if side > 0 else 0


def ROOT_AT(n: int) -> int:  # noqa: N802 — where a line's reduction tree is rooted
    return 0


@lru_cache(maxsize=65536)
def allreduce_cycles(n: int, m: int, chip: Chip) -> float:
    """All-reduce over a line of ``n`` PEs, ``m`` words each, rooted at the line's first PE.

    The line reduces toward the root by distance doubling: at level ``l`` PE ``delta`` (its
    distance from the root) receives from ``delta + 2**l`` once that PE holds its own subtree's
    sum; a message costs ``2**l`` hops + (m - 1) pipelined words + the ramp at both ends, the
    receiver an m-word SIMD add.  The critical path is evaluated exactly (about n hops), then
    the root multicasts the sum back along the line (n - 1 hops): ~2n hops per all-reduce,
    which with ten all-reduces per layer is the ~18-20 cycles per unit of P that WaferLLM's
    measurements show.  (A root in the middle would halve the hops; the published points
    do not support that for WaferLLM's implementation.)
    """
    if n <= 1:
        return 0.0
    hop, ramp = chip.hop_cycles, chip.ramp_cycles
    add = math.ceil(m * chip.link_bits / 16 / chip.simd_fp16)
    root = ROOT_AT(n)
    sides = [s for s in (root, n - 1 - root) if s > 0]
    fins = [np.zeros(s + 1) for s in sides]  # index: distance from the root
    t_root = 0.0
    for lv in range(tree_levels(max(sides))):
        step = 2**lv
        cost = step * hop + (m - 1) + 2 * ramp
        arrivals = []
        for f, s in zip(fins, sides):
            recv = np.arange(2 * step, s - step + 1, 2 * step)
            if recv.size:
                f[recv] = np.maximum(f[recv], f[recv + step] + cost) + add
            if step <= s:
                arrivals.append(f[step] + cost)
        for arr in sorted(arrivals):
            t_root = max(t_root, arr) + add
    return float(t_root) + max(sides) * hop + (m - 1) + 2 * ramp


def gemv_cycles(macs: int, chip: Chip, eta: float) -> float:
    return macs / (chip.simd_fp16 * eta)


def layer_phases(shape, R: int, C: int, context: int, chip: Chip, k: Constants) -> list[dict]:
    """The decode phases of one layer on an R x C region: compute cycles, reduction line and words.

    ``axis`` 'cols' reduces down a mesh column (a line of R PEs), 'rows' along a mesh row (C PEs).
    Shared with the mesh simulator so both model the same dataflow.
    """
    d, f = shape.hidden, shape.ffn
    d_r = math.ceil(d / R)
    q_c = math.ceil(shape.q_dim / C)
    tok_r = math.ceil(context / R)  # shift-based KV: context spread over the rows
    heads_c = max(1, math.ceil(shape.heads / C))
    head_line = max(1, min(C, math.ceil(C / shape.heads)))  # columns one head spans
    vec = lambda e: math.ceil(e / chip.simd_fp16)  # noqa: E731 — elementwise SIMD pass
    return [
        {"name": "norm1", "compute": vec(d_r), "axis": "cols", "n": R, "words": 1},
        {
            "name": "qkv",
            "compute": gemv_cycles(d_r * math.ceil(shape.qkv_out / C), chip, k.eta),
            "axis": "cols",
            "n": R,
            "words": words(math.ceil(shape.qkv_out / C), chip),
        },
        {
            "name": "scores",
            "compute": gemv_cycles(tok_r * q_c, chip, k.eta),
            "axis": "rows",
            "n": head_line,
            "words": words(tok_r * heads_c, chip),
        },
        {
            "name": "softmax_max",
            "compute": vec(tok_r * heads_c),
            "axis": "cols",
            "n": R,
            "words": words(heads_c, chip),
        },
        {
            "name": "softmax_sum",
            "compute": vec(tok_r * heads_c),
            "axis": "cols",
            "n": R,
            "words": words(heads_c, chip),
        },
        {
            "name": "attn_v",
            "compute": gemv_cycles(tok_r * q_c, chip, k.eta),
            "axis": "cols",
            "n": R,
            "words": words(q_c, chip),
        },
        {
            "name": "o",
            "compute": gemv_cycles(q_c * d_r, chip, k.eta),
            "axis": "rows",
            "n": C,
            "words": words(d_r, chip),
        },
        {"name": "norm2", "compute": vec(d_r), "axis": "cols", "n": R, "words": 1},
        {
            "name": "gate_up",
            "compute": gemv_cycles(d_r * math.ceil(shape.up_out / C), chip, k.eta),
            "axis": "cols",
            "n": R,
            "words": words(math.ceil(shape.up_out / C), chip),
        },
        {
            "name": "down",
            "compute": gemv_cycles(math.ceil(f / C) * d_r, chip, k.eta),
            "axis": "rows",
            "n": C,
            "words": words(d_r, chip),
        },
    ]


def handoff_cycles(src: Region, dst: Region | None, m: int, chip: Chip) -> float:
    """Send the layer output (``m`` words per mesh row) to the next region on the same wafer.

    Row i's slice leaves the region's last column and the routers multicast it along the next
    region's row i, so it costs the hops to that row's far end.
    """
    if dst is None or dst.wafer != src.wafer:
        return 0.0
    hops = abs(dst.row - src.row) + abs((dst.col + dst.cols - 1) - (src.col + src.cols - 1))
    return hops * chip.hop_cycles + (m - 1) + 2 * chip.ramp_cycles


def layer_cycles(shape, R: int, C: int, context: int, chip: Chip, k: Constants) -> dict:
    """Cycles of one layer's decode step: fixed + compute + reductions (by phase)."""
    phases = layer_phases(shape, R, C, context, chip, k)
    comp = sum(p["compute"] for p in phases)
    comm = sum(allreduce_cycles(p["n"], p["words"], chip) for p in phases)
    return {"fixed": k.c0, "compute": comp, "reduce": comm, "total": k.c0 + comp + comm}


def head_cycles(shape, region: Region, chip: Chip, k: Constants) -> float:
    """Final norm + LM head GEMV + its reduction + the argmax along the row."""
    R, C = region.rows, region.cols
    d_r, v_c = math.ceil(shape.hidden / R), math.ceil(shape.vocab / C)
    return (
        math.ceil(d_r / chip.simd_fp16)
        + allreduce_cycles(R, 1, chip)
        + gemv_cycles(d_r * v_c, chip, k.eta)
        + allreduce_cycles(R, words(v_c, chip), chip)
        + math.ceil(v_c / chip.simd_fp16)
        + allreduce_cycles(C, 2, chip)
    )


def io_seconds(placement: Placement) -> float:
    """Wafer-to-wafer hand-offs per token: the activation across each cut, the token back."""
    if placement.wafers <= 1:
        return 0.0
    chip = placement.chip
    act = placement.shape.hidden * 2 * 8 / (chip.io_tbps * 1e12)
    return (placement.wafers - 1) * (chip.io_latency_us * 1e-6 + act) + chip.io_latency_us * 1e-6


@dataclass
class Projection:
    decode_cycles: float  # on-wafer cycles per token (all layers + embed + head)
    decode_s: float  # seconds per token, I/O included
    ttft_s: float
    prompt_tokens: int
    per_layer: list[dict]

    @property
    def decode_tok_s(self) -> float:
        return 1.0 / self.decode_s


def project(
    placement: Placement, *, prompt_tokens: int | None = None, constants: Constants | None = None
) -> Projection:
    """Decode speed and time to first token of a placement."""
    k = constants or Constants()
    p, chip, shape = placement, placement.chip, placement.shape
    R, C = p.grid
    regions = p.regions
    lc = layer_cycles(shape, R, C, p.context, chip, k)
    m_out = words(math.ceil(shape.hidden / R), chip)
    per_layer = []
    total = 0.0
    for idx, r in enumerate(regions):
        nxt = regions[idx + 1] if idx + 1 < len(regions) else None
        hand = handoff_cycles(r, nxt, m_out, chip)
        if r.kind == "layer":
            cyc = lc["total"] + hand
            per_layer.append(
                {
                    "layer": r.layer,
                    "wafer": r.wafer,
                    "region": [r.row, r.col, r.rows, r.cols],
                    "cycles": round(cyc, 1),
                    "compute": round(lc["compute"], 1),
                    "reduce": round(lc["reduce"], 1),
                    "fixed": round(lc["fixed"], 1),
                    "peak_kb": round(r.peak_bytes / 1024, 2),
                }
            )
        elif r.kind == "embed":  # fetch one row of the table (a column of PEs) and forward it
            cyc = r.rows * chip.hop_cycles + m_out + 2 * chip.ramp_cycles + hand
        else:
            cyc = head_cycles(shape, r, chip, k)
        total += cyc
    decode_s = total / (chip.clock_ghz * 1e9) + io_seconds(p)
    T = int(prompt_tokens or min(p.context, 4096))
    ttft = prefill_seconds(p, T, k) + decode_s
    return Projection(total, decode_s, ttft, T, per_layer)


def prefill_seconds(p: Placement, T: int, k: Constants) -> float:
    """Prompt of T tokens, layer by layer on each layer's region at WaferLLM's prefill efficiency."""
    chip, shape = p.chip, p.shape
    peak = chip.simd_fp16 * 2 * chip.clock_ghz * 1e9 * k.eta_prefill  # FLOP/s per PE
    R, C = p.grid
    flops_layer = 2 * shape.layer_params * T + 2 * T * T * shape.q_dim
    head = next(r for r in p.regions if r.kind == "lm_head")
    return (
        shape.layers * flops_layer / (R * C * peak)
        + 2 * shape.hidden * shape.vocab / (head.pes * peak)
        + io_seconds(p)
    )


# -- calibration -------------------------------------------------------------------------------


def calibrate(
    shape, chip: Chip, points=WAFERLLM_POINTS, context: int = CALIBRATION_CONTEXT
) -> Constants:
    """Fit ``eta`` and ``c0`` (least squares on relative time) to published (P, tok/s) points.

    Per-token seconds are linear in (c0, 1/eta) once the placement is fixed:
    ``s = (L * c0 + A + B / eta) / f + io``.
    """
    rows, rhs = [], []
    for P, tok_s in points:
        pl = place(shape, chip, (P, P), context=context)
        base = project(pl, constants=Constants(eta=1.0, c0=0.0))
        slow = project(pl, constants=Constants(eta=0.5, c0=0.0))
        B = slow.decode_cycles - base.decode_cycles  # = B * (1/0.5 - 1/1)
        A = base.decode_cycles - B
        f = chip.clock_ghz * 1e9
        target = 1.0 / tok_s
        io = io_seconds(pl)
        # s = (L*c0 + A + B*u) / f + io, u = 1/eta; weight by 1/target for relative error.
        rows.append([shape.layers / f / target, B / f / target])
        rhs.append((target - io - A / f) / target)
    a, b = np.array(rows), np.array(rhs)
    (c0, u), *_ = np.linalg.lstsq(a, b, rcond=None)
    if c0 < 0:  # a fixed cost cannot be negative: fit the efficiency alone
        c0 = 0.0
        u = float(a[:, 1] @ b / (a[:, 1] @ a[:, 1]))
    return Constants(eta=float(1.0 / u), c0=float(c0))


def calibration_table(shape, chip: Chip, constants: Constants | None = None) -> list[dict]:
    out = []
    for P, tok_s in WAFERLLM_POINTS:
        pl = place(shape, chip, (P, P), context=CALIBRATION_CONTEXT)
        proj = project(pl, constants=constants)
        out.append(
            {
                "grid": f"{P}x{P}",
                "published_tok_s": tok_s,
                "projected_tok_s": round(float(proj.decode_tok_s), 1),
                "error": round(float(proj.decode_tok_s / tok_s - 1), 4),
                "wafers": pl.wafers,
            }
        )
    return out


def candidate_grids(chip: Chip, min_side: int = 8) -> list[tuple[int, int]]:
    """Square regions of every size, plus rectangles that tile the mesh exactly a x b times."""
    side = min(chip.mesh_rows, chip.mesh_cols)
    step = max(1, side // 400)
    cands = {(P, P) for P in range(min_side, side + 1, step)}
    for a in range(1, 13):
        for b in range(1, 13):
            r, c = chip.mesh_rows // a, chip.mesh_cols // b
            if r >= min_side and c >= min_side and max(r, c) <= 2 * min(r, c):
                cands.add((r, c))
    return sorted(cands)


def plan(
    shape,
    chip: Chip,
    *,
    grid: tuple[int, int] | None = None,
    context: int = 4096,
    budget: float | None = None,
    max_wafers: int | None = None,
    prompt_tokens: int | None = None,
    constants: Constants | None = None,
):
    """Placement + projection.  Without ``grid``, the region size with the fastest projected decode.

    The search is limited to ``max_wafers`` wafers — by default the fewest any region size needs
    (a wafer is a whole machine; raise it to trade machines for speed).
    Raises :class:`~engine.projection.placement.PlacementError` when nothing fits.
    """
    budget = DEFAULT_BUDGET if budget is None else budget
    if grid is not None:
        pl = place(shape, chip, grid, context=context, budget=budget, max_wafers=max_wafers)
        return pl, project(pl, prompt_tokens=prompt_tokens, constants=constants)
    feasible, last_err = [], None
    for g in candidate_grids(chip):
        try:
            feasible.append(place(shape, chip, g, context=context, budget=budget))
        except PlacementError as e:
            last_err = e
    if not feasible:
        raise last_err or PlacementError(f"{shape.name}: no region size fits {chip.name}")
    fewest = min(p.wafers for p in feasible)
    limit = fewest if max_wafers is None else max_wafers
    allowed = [p for p in feasible if p.wafers <= limit]
    if not allowed:  # explain with the layout that needs the fewest wafers
        best = min(feasible, key=lambda p: p.wafers)
        place(shape, chip, best.grid, context=context, budget=budget, max_wafers=limit)
    scored = [(project(p, prompt_tokens=prompt_tokens, constants=constants), p) for p in allowed]
    proj, pl = max(scored, key=lambda t: (t[0].decode_tok_s, -t[1].pes_used))
    return pl, proj


def project_model(
    config, *, chip: str | Chip = "wse3", grid: tuple[int, int] | None = None, name: str = "model"
) -> dict:
    """The status-bar projection for a loaded model's config: ``{"chip", "grid", "decode_tok_s",
    "ttft_ms"}`` on ``chip`` (a built-in name, a spec file, or a :class:`Chip`), at ``grid`` or
    the fastest region size.  Raises ChipError / PlacementError with a message."""
    spec = chip if isinstance(chip, Chip) else load_chip(chip)
    placement, proj = plan(ModelShape.from_config(config, name=name), spec, grid=grid)
    return {
        "chip": spec.name,
        "grid": list(placement.grid),
        "decode_tok_s": round(float(proj.decode_tok_s), 1),
        "ttft_ms": round(float(proj.ttft_s) * 1e3, 3),
    }


def summary(placement: Placement, proj: Projection) -> dict:
    """The JSON form of a plan (``spark-lsp wafer --json``)."""
    p, chip = placement, placement.chip

    def region(r: Region) -> dict:
        return {"wafer": r.wafer, "row": r.row, "col": r.col, "rows": r.rows, "cols": r.cols}

    layers = []
    for info in proj.per_layer:
        r = p.layer_regions()[info["layer"]]
        layers.append(
            {
                "layer": info["layer"],
                "region": region(r),
                "cycles": info["cycles"],
                "compute_cycles": info["compute"],
                "reduce_cycles": info["reduce"],
                "peak_sram_kb": info["peak_kb"],
            }
        )
    others = {
        r.kind: dict(region(r), peak_sram_kb=round(r.peak_bytes / 1024, 2))
        for r in p.regions
        if r.kind != "layer"
    }
    return {
        "model": {
            "name": p.shape.name,
            "params": p.shape.params,
            "layers": p.shape.layers,
            "hidden": p.shape.hidden,
        },
        "chip": chip.name,
        "chip_spec": chip.to_dict(),
        "grid": f"{p.grid[0]}x{p.grid[1]}",
        "context": p.context,
        "wafers": p.wafers,
        "pes_used": p.pes_used,
        "sram_budget": p.budget,
        "sram_utilization": round(p.sram_utilization, 4),
        "peak_sram_fill": round(p.peak_fill, 4),
        "decode_tok_s": round(proj.decode_tok_s, 1),
        "decode_cycles_on_wafer": round(proj.decode_cycles, 1),
        "ttft_ms": round(proj.ttft_s * 1e3, 3),
        "prompt_tokens": proj.prompt_tokens,
        "embed": others.get("embed"),
        "lm_head": others.get("lm_head"),
        "per_layer": layers,
    }


if __name__ == "__main__":  # print the fit and the table
    here = Path(__file__).resolve().parents[2] / "tests" / "wafer" / "data" / "llama-3-8b.json"
    s = load_shape(here)
    k = calibrate(s, WSE2)
    print(f"eta = {k.eta:.4f}, c0 = {k.c0:.1f}")
    for row in calibration_table(s, WSE2, k):
        print(row)
