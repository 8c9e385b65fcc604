"""The wafer picture: layer regions outlined and labelled over a heat map of SRAM fill.

matplotlib is an optional dependency (the ``plot`` extra); :func:`draw` raises
:class:`MissingMatplotlib` with an install hint when it is not there.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from .placement import Placement

MAX_PANELS = 6


class MissingMatplotlib(RuntimeError):
    pass


def draw(placement: Placement, out: str | Path, *, title: str | None = None) -> Path:
    """Write a PNG of the placement (one panel per wafer, the first few if there are many)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib import patches
    except ImportError:
        raise MissingMatplotlib(
            "drawing the wafer needs matplotlib: pip install matplotlib"
        ) from None
    p, chip = placement, placement.chip
    n = min(p.wafers, MAX_PANELS)
    cols = min(n, 3)
    rows = math.ceil(n / cols)
    aspect = chip.mesh_rows / chip.mesh_cols
    width = max(8.0, 4.6 * cols + 1.4)
    fig, axes = plt.subplots(
        rows,
        cols,
        figsize=(width, (width - 1.4) / cols * aspect * rows + 1.0),
        squeeze=False,
        layout="constrained",
    )
    cmap = plt.get_cmap("viridis").with_extremes(bad="#e9e9e9")  # grey: PEs no region uses
    im = None
    for w in range(rows * cols):
        ax = axes[w // cols][w % cols]
        if w >= n:
            ax.axis("off")
            continue
        m = np.ma.masked_invalid(p.fill_map(w) * 100)
        im = ax.imshow(m, cmap=cmap, vmin=0, vmax=100, interpolation="nearest", origin="upper")
        for r in p.regions:
            if r.wafer != w:
                continue
            colour = {"layer": "white", "embed": "#ff7f0e", "lm_head": "#d62728"}[r.kind]
            ax.add_patch(
                patches.Rectangle(
                    (r.col - 0.5, r.row - 0.5),
                    r.cols,
                    r.rows,
                    fill=False,
                    edgecolor=colour,
                    linewidth=1.0,
                )
            )
            label = f"L{r.layer}" if r.kind == "layer" else ("emb" if r.kind == "embed" else "head")
            size = max(5, min(12, 60 * min(r.rows / chip.mesh_rows, r.cols / chip.mesh_cols)))
            ax.text(
                r.col + r.cols / 2,
                r.row + r.rows / 2,
                label,
                ha="center",
                va="center",
                fontsize=size,
                color="white" if r.kind == "layer" else colour,
                fontweight="bold",
            )
        ax.set_title(f"wafer {w + 1} of {p.wafers}", fontsize=10)
        ax.set_xticks([])
        ax.set_yticks([])
    extra = f" (first {n} of {p.wafers} wafers shown)" if p.wafers > n else ""
    fig.suptitle(
        (title or f"{p.shape.name} on {chip.name}: {p.grid[0]}x{p.grid[1]} PEs per layer") + extra,
        fontsize=11,
    )
    cbar = fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.8)
    cbar.set_label(f"SRAM fill, % of {chip.sram_kb_per_pe:g} KB per PE (budget {p.budget:.0%})")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
