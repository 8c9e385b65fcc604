"""Placement of a transformer on wafer-scale meshes: layer-pipelined rectangular regions.

Every transformer layer owns an ``R x C`` region of PEs and keeps its weights resident there
(the MeshGEMV layout of :mod:`engine.wafer.partition`: qkv / gate_up tiled K-over-rows,
o / down stored transposed, K-over-columns), plus its share of the KV cache for the configured
context (the shift-based KV cache keeps it balanced over the region) and a few activation
buffers.  The embedding table and the LM head get regions of their own.  Regions are packed in
shelves onto wafers in model order, so a model larger than one wafer is cut at layer
boundaries; only activations cross wafers.

Works from a model config alone (no weights): the sizes are all that matter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..config import ModelError, load_config, model_name, parse_config, read_json
from ..hub import model_info, parse_spec
from .chips import Chip

#: Fraction of each PE's SRAM the layout may fill: WaferLLM hit "out of PE memory" at link time
#: well before 48 KB (code, routing tables and stacks need the rest).
DEFAULT_BUDGET = 0.8
BYTES_FP16 = 2


class PlacementError(ValueError):
    """The model does not fit: the message says where and how much is missing."""


@dataclass(frozen=True)
class ModelShape:
    """The sizes placement and the performance model need (from a config.json)."""

    name: str
    hidden: int
    ffn: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool = False
    max_context: int = 8192
    gated: bool = (
        True  # gate and up projections (SwiGLU / GeGLU); False: one up projection (Starcoder2)
    )

    @classmethod
    def from_config(cls, config, name: str = "model") -> ModelShape:
        return cls(
            name=name,
            hidden=config.hidden_size,
            ffn=config.intermediate_size,
            layers=config.num_hidden_layers,
            heads=config.num_attention_heads,
            kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            vocab=config.vocab_size,
            tied=bool(config.tie_word_embeddings),
            max_context=config.max_position_embeddings,
            gated=bool(getattr(config, "mlp_gated", True)),
        )

    @property
    def up_out(self) -> int:
        """Outputs of the MLP's first linear: gate and up side by side, or up alone."""
        return 2 * self.ffn if self.gated else self.ffn

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def qkv_out(self) -> int:
        return (self.heads + 2 * self.kv_heads) * self.head_dim

    def matrices(self) -> dict[str, tuple[int, int, str]]:
        """name -> (K, N, reduction axis) of one layer's weights, in MeshGEMV layout."""
        d, f = self.hidden, self.ffn
        return {
            "qkv": (d, self.qkv_out, "rows"),
            "o": (self.q_dim, d, "cols"),
            "gate_up": (d, self.up_out, "rows"),
            "down": (f, d, "cols"),
        }

    @property
    def layer_params(self) -> int:
        return sum(k * n for k, n, _ in self.matrices().values())

    @property
    def params(self) -> int:
        head = 0 if self.tied else self.vocab * self.hidden
        return self.layers * self.layer_params + self.vocab * self.hidden + head


def load_shape(path: str | Path) -> ModelShape:
    """A :class:`ModelShape` from a model folder, a ``config.json``-style file (any name), a GGUF
    file, or a model name as ``serve --model`` takes it (a catalogue name, ``hf:ORG/REPO``): of
    those only the config.json or the GGUF header is read, from the Hub or its cache, never the
    weights."""
    p = Path(path).expanduser()
    if p.is_dir():
        return ModelShape.from_config(load_config(p), name=model_name(p))
    if p.suffix == ".gguf" or (not p.exists() and parse_spec(str(path)) is not None):
        info = model_info(str(path))  # "ORG/REPO", "ORG/REPO:FILE.gguf" or "FILE.gguf"
        name = info.name.rsplit(":", 1)[-1].rsplit("/", 1)[-1]
        return ModelShape.from_config(info.config, name=name.removesuffix(".gguf"))
    if not p.is_file():
        raise ModelError(f"{p}: config file not found")
    if p.name == "config.json":
        return ModelShape.from_config(load_config(p.parent), name=p.parent.name or p.stem)
    raw = read_json(p)  # a config.json under another name: errors name this file
    assert raw is not None
    name = raw.get("_name_or_path") or p.stem
    return ModelShape.from_config(
        parse_config(raw, path=p, name=p.name), name=str(name).split("/")[-1] or p.stem
    )


def _blocks(n: int, parts: int) -> np.ndarray:
    """Sizes of ``n`` split over ``parts`` PEs (ceil blocks first, last ones smaller, maybe 0)."""
    b = math.ceil(n / parts)
    return np.clip(n - b * np.arange(parts), 0, b)


@dataclass
class Region:
    """One rectangle of PEs on one wafer."""

    name: str
    kind: str  # 'embed' | 'layer' | 'lm_head'
    rows: int
    cols: int
    peak_bytes: int  # the fullest PE of the region
    total_bytes: int
    layer: int | None = None
    wafer: int = 0
    row: int = 0  # top-left corner on the wafer
    col: int = 0
    parts: dict = field(default_factory=dict)  # what the fullest PE holds, bytes by kind

    @property
    def pes(self) -> int:
        return self.rows * self.cols


def layer_fill(shape: ModelShape, R: int, C: int, context: int, per_pe: bool = False):
    """Bytes per PE of one layer on an ``R x C`` region.

    Returns (peak bytes, total bytes, breakdown of the peak PE) or, with ``per_pe``, the
    ``[R, C]`` array of bytes for the SRAM heat map.
    """
    rb = {}
    fill = np.zeros((R, C), dtype=np.int64) if per_pe else None
    peak = {}
    for name, (K, N, axis) in shape.matrices().items():
        if axis == "rows":  # PE (i, j) holds K-block i x N-block j
            a, b = _blocks(K, R), _blocks(N, C)
            tile = np.outer(a, b)
        else:  # stored transposed: K-block j x N-block i
            a, b = _blocks(N, R), _blocks(K, C)
            tile = np.outer(a, b)
        if per_pe:
            fill += tile * BYTES_FP16
        peak[name] = int(tile[0, 0]) * BYTES_FP16
        rb[name] = K * N * BYTES_FP16
    # Norm weights, residual and activation buffers: slices of d (along rows) and of the
    # qkv / gate_up outputs (along columns), double-buffered.
    d_r, q_c, f_c = (
        math.ceil(shape.hidden / R),
        math.ceil(shape.qkv_out / C),
        math.ceil(shape.up_out / C),
    )
    vec = (2 * d_r + 2 * (2 * d_r + q_c + f_c)) * BYTES_FP16
    # Shift-based KV cache: K and V for `context` tokens, balanced over the region.
    kv_total = 2 * context * shape.kv_heads * shape.head_dim * BYTES_FP16
    kv = math.ceil(kv_total / (R * C))
    peak["vectors"], peak["kv_cache"] = vec, kv
    if per_pe:
        return fill + vec + kv
    return sum(peak.values()), sum(rb.values()) + (kv + vec) * R * C, peak


def head_fill(shape: ModelShape, R: int, C: int) -> tuple[int, int]:
    """(peak, total) bytes of the LM head (K = d over rows, N = vocab over columns)."""
    tile = math.ceil(shape.hidden / R) * math.ceil(shape.vocab / C) * BYTES_FP16
    vec = (math.ceil(shape.hidden / R) + 2 * math.ceil(shape.vocab / C)) * BYTES_FP16
    return tile + vec, shape.hidden * shape.vocab * BYTES_FP16 + vec * R * C


def embed_fill(shape: ModelShape, R: int, C: int) -> tuple[int, int]:
    """(peak, total) bytes of the embedding table (vocab over columns, d over rows)."""
    tile = math.ceil(shape.vocab / C) * math.ceil(shape.hidden / R) * BYTES_FP16
    return tile, shape.vocab * shape.hidden * BYTES_FP16


def _fit_cols(fill_fn, R: int, min_cols: int, budget: int, max_cols: int) -> int | None:
    """Smallest column count >= min_cols whose peak fill fits the budget (None: none does)."""
    lo = max(1, min_cols)
    if fill_fn(R, lo)[0] <= budget:
        return lo
    if fill_fn(R, max_cols)[0] > budget:
        return None
    hi = max_cols
    while lo + 1 < hi:  # fill decreases with more columns
        mid = (lo + hi) // 2
        if fill_fn(R, mid)[0] <= budget:
            hi = mid
        else:
            lo = mid
    return hi


@dataclass
class Placement:
    chip: Chip
    shape: ModelShape
    grid: tuple[int, int]
    context: int
    budget: float
    regions: list[Region]
    wafers: int

    @property
    def budget_bytes(self) -> int:
        return int(self.chip.sram_bytes_per_pe * self.budget)

    @property
    def pes_used(self) -> int:
        return sum(r.pes for r in self.regions)

    @property
    def bytes_used(self) -> int:
        return sum(r.total_bytes for r in self.regions)

    @property
    def sram_utilization(self) -> float:
        """Bytes stored / SRAM of the PEs the layout uses."""
        return self.bytes_used / (self.pes_used * self.chip.sram_bytes_per_pe)

    @property
    def peak_fill(self) -> float:
        return max(r.peak_bytes for r in self.regions) / self.chip.sram_bytes_per_pe

    def layer_regions(self) -> list[Region]:
        return [r for r in self.regions if r.kind == "layer"]

    def fill_map(self, wafer: int) -> np.ndarray:
        """[mesh_rows, mesh_cols] SRAM fill fraction of one wafer (NaN where no region)."""
        m = np.full((self.chip.mesh_rows, self.chip.mesh_cols), np.nan)
        sram = self.chip.sram_bytes_per_pe
        layer_map = None  # every layer region has the same shape and contents
        for r in self.regions:
            if r.wafer != wafer:
                continue
            if r.kind == "layer":
                if layer_map is None:
                    layer_map = layer_fill(self.shape, r.rows, r.cols, self.context, per_pe=True)
                f = layer_map
            else:
                fn = head_fill if r.kind == "lm_head" else embed_fill
                cell = _region_map(self.shape, r, fn)
                f = cell
            m[r.row : r.row + r.rows, r.col : r.col + r.cols] = f / sram
        return m


def _region_map(shape: ModelShape, r: Region, fn) -> np.ndarray:
    """Per-PE bytes for the embedding / LM head (ceil blocks: the last rows/columns lighter)."""
    a = _blocks(shape.hidden, r.rows)
    b = _blocks(shape.vocab, r.cols)
    tile = np.outer(a, b) * BYTES_FP16
    if fn is head_fill:
        tile = tile + (a[:, None] + 2 * b[None, :]) * BYTES_FP16
    return tile


def _pack(regions: list[Region], chip: Chip) -> int:
    """Shelf-pack regions in order onto wafers (sets wafer/row/col); returns the wafer count."""
    wafer, x, y, shelf = 0, 0, 0, 0
    for r in regions:
        if r.rows > chip.mesh_rows or r.cols > chip.mesh_cols:
            raise PlacementError(
                f"{r.name}: a {r.rows}x{r.cols} region is larger than the "
                f"{chip.mesh_rows}x{chip.mesh_cols} mesh of {chip.name}"
            )
        if x + r.cols > chip.mesh_cols:  # next shelf
            x, y, shelf = 0, y + shelf, 0
        if y + r.rows > chip.mesh_rows:  # next wafer: the cut falls between two regions
            wafer, x, y, shelf = wafer + 1, 0, 0, 0
        r.wafer, r.row, r.col = wafer, y, x
        x += r.cols
        shelf = max(shelf, r.rows)
    return wafer + 1


def place(
    shape: ModelShape,
    chip: Chip,
    grid: tuple[int, int],
    *,
    context: int = 4096,
    budget: float = DEFAULT_BUDGET,
    max_wafers: int | None = None,
) -> Placement:
    """Place every layer on its own ``grid`` region; raise PlacementError if it cannot fit."""
    R, C = (int(v) for v in grid)
    if R <= 0 or C <= 0:
        raise PlacementError(f"grid {grid!r}: rows and columns must be positive")
    if context <= 0:
        raise PlacementError(f"context={context}: must be a positive number of tokens")
    if not 0 < budget <= 1:
        raise PlacementError(f"budget={budget}: must be a fraction of the SRAM in (0, 1]")
    if R > chip.mesh_rows or C > chip.mesh_cols:
        raise PlacementError(
            f"grid {R}x{C} is larger than the {chip.mesh_rows}x{chip.mesh_cols} mesh of {chip.name}"
        )
    cap = int(chip.sram_bytes_per_pe * budget)
    peak, total, parts = layer_fill(shape, R, C, context)
    if peak > cap:
        miss = peak - cap
        raise PlacementError(
            f"{shape.name}: one layer on a {R}x{C} region needs {peak / 1024:.1f} KB per PE "
            f"(weights {sum(v for k, v in parts.items() if k not in ('vectors', 'kv_cache')) / 1024:.1f} KB, "
            f"KV cache for {context} tokens {parts['kv_cache'] / 1024:.1f} KB, buffers "
            f"{parts['vectors'] / 1024:.1f} KB) but the budget is {cap / 1024:.1f} KB "
            f"({budget:.0%} of {chip.sram_kb_per_pe:g} KB): missing {miss / 1024:.1f} KB per PE, "
            f"{miss * R * C / 2**20:.1f} MB over the region; use a larger --grid or a shorter --context"
        )
    regions = []
    e_cols = _fit_cols(lambda r, c: embed_fill(shape, r, c), R, 1, cap, chip.mesh_cols)
    h_cols = _fit_cols(lambda r, c: head_fill(shape, r, c), R, C, cap, chip.mesh_cols)
    for what, cols in (("embedding table", e_cols), ("LM head", h_cols)):
        if cols is None:
            fn = embed_fill if what == "embedding table" else head_fill
            need = fn(shape, R, chip.mesh_cols)[0]
            raise PlacementError(
                f"{shape.name}: the {what} does not fit {R} rows x {chip.mesh_cols} columns "
                f"({need / 1024:.1f} KB per PE, budget {cap / 1024:.1f} KB: missing "
                f"{(need - cap) / 1024:.1f} KB per PE); use a larger --grid"
            )
    ep, et = embed_fill(shape, R, e_cols)
    regions.append(Region("embed", "embed", R, e_cols, ep, et))
    for i in range(shape.layers):
        regions.append(Region(f"layer {i}", "layer", R, C, peak, total, layer=i, parts=parts))
    hp, ht = head_fill(shape, R, h_cols)
    regions.append(Region("lm_head", "lm_head", R, h_cols, hp, ht))
    wafers = _pack(regions, chip)
    if max_wafers is not None and wafers > max_wafers:
        raise PlacementError(
            _too_many_wafers(shape, chip, (R, C), wafers, max_wafers, regions, budget)
        )
    return Placement(chip, shape, (R, C), context, budget, regions, wafers)


def _too_many_wafers(shape, chip, grid, wafers, max_wafers, regions, budget) -> str:
    need = sum(r.total_bytes for r in regions)
    have = max_wafers * chip.pes * chip.sram_bytes_per_pe * budget
    per_wafer = chip.pes * chip.sram_bytes_per_pe * budget
    return (
        f"{shape.name} on {grid[0]}x{grid[1]} layer regions needs {wafers} {chip.name} wafers "
        f"but at most {max_wafers} allowed: missing {wafers - max_wafers} wafer(s); "
        f"it stores {need / 1e9:.1f} GB against {have / 1e9:.1f} GB of SRAM at the {budget:.0%} budget "
        f"({per_wafer / 1e9:.1f} GB per wafer); raise --max-wafers or use a smaller --grid"
    )


def min_wafers(shape: ModelShape, chip: Chip, context: int, budget: float = DEFAULT_BUDGET) -> int:
    """A lower bound on wafers: total bytes over the usable SRAM of one wafer."""
    per_wafer = chip.pes * chip.sram_bytes_per_pe * budget
    kv = 2 * context * shape.kv_heads * shape.head_dim * BYTES_FP16 * shape.layers
    return max(1, math.ceil((shape.params * BYTES_FP16 + kv) / per_wafer))
