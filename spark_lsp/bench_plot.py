"""One PNG of a `spark-lsp bench all` run: each benchmark's headline figures beside its peer or target.

Kept apart from the benchmarks so they stay plain JSON producers; matplotlib (the `plot` extra) is
imported only here, and only when a plot is asked for.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: Issue targets drawn as dashed lines (keystroke-to-suggestion latency, in ms).
LSP_TARGETS_MS = {"median": 25.0, "p95": 60.0}


def _bars(ax, labels: list[str], values: list[float], title: str, ylabel: str, colors=None) -> None:
    xs = range(len(values))
    bars = ax.bar(xs, values, color=colors or ["#d9480f"] + ["#868e96"] * (len(values) - 1))
    ax.set_xticks(list(xs), labels, fontsize=8)
    ax.set_title(title, fontsize=10)
    ax.set_ylabel(ylabel, fontsize=8)
    for b, v in zip(bars, values):
        ax.annotate(f"{v:,.0f}" if v >= 10 else f"{v:.2f}", (b.get_x() + b.get_width() / 2, b.get_height()),
                    ha="center", va="bottom", fontsize=7)


def panels(results: dict[str, Any]) -> list[tuple[str, list[str], list[float], str, str]]:
    """The (name, labels, values, title, ylabel) of each panel that `results` has data for."""
    out = []
    eng = results.get("engine")
    if eng:
        labels, values = ["spark-lsp"], [eng["engine"]["decode_tok_s"]]
        for peer, d in (eng.get("peers") or {}).items():
            if d and d.get("decode_tok_s"):
                labels.append(peer.replace("onnxruntime-genai", "ort-genai"))
                values.append(d["decode_tok_s"])
        out.append(("engine", labels, values, "decode, same weights (tok/s)", "tokens/s"))
    edits = results.get("edits")
    if edits and edits.get("summary"):
        s = edits["summary"]
        labels = [f"{k}\nmedian" for k in s] + [f"{k}\nmin" for k in s]
        values = [s[k]["median_ratio"] for k in s] + [s[k]["min_ratio"] for k in s]
        out.append(("edits", labels, values, "speculative / plain decode", "ratio"))
    lsp = results.get("lsp")
    if lsp and lsp.get("latency_ms_median") is not None:
        out.append(("lsp", ["median", "p95"], [lsp["latency_ms_median"], lsp["latency_ms_p95"]],
                    "keystroke -> suggestion (ms)", "ms"))
    wafer = results.get("wafer")
    if wafer and wafer.get("dense_decode_tok_s"):
        out.append(("wafer", ["partitioned", "dense"], [wafer["partitioned_decode_tok_s"], wafer["dense_decode_tok_s"]],
                    f"emulated {wafer.get('grid', '')} mesh vs plain (tok/s)", "tokens/s"))
    return out


def draw(results: dict[str, Any], path: str | Path) -> Path:
    """Write the PNG; raises RuntimeError when matplotlib is missing or there is nothing to draw."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install 'spark-lsp[plot]'") from None
    ps = panels(results)
    if not ps:
        raise RuntimeError("no benchmark produced results to plot")
    fig, axes = plt.subplots(1, len(ps), figsize=(3.6 * len(ps), 3.4), squeeze=False)
    for ax, (name, labels, values, title, ylabel) in zip(axes[0], ps):
        _bars(ax, labels, values, title, ylabel)
        if name == "lsp":
            for i, key in enumerate(("median", "p95")):
                ax.hlines(LSP_TARGETS_MS[key], i - 0.4, i + 0.4, colors="#1c7ed6", linestyles="dashed")
        if name == "edits":
            ax.axhline(1.0, color="#1c7ed6", linestyle="dashed", linewidth=1)
    fig.suptitle("spark-lsp bench all" + (f" - {results['model']}" if results.get("model") else ""), fontsize=11)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
