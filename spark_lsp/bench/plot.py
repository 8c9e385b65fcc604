"""PNGs of `spark-lsp bench` runs: each benchmark's headline figures beside its peer or target.

`bench all --plot` draws one headline panel per benchmark; `bench NAME --plot` draws that
benchmark's own panels (``detail``).  Kept apart from the benchmarks so they stay plain JSON
producers; matplotlib (the `plot` extra) is imported only here, and only when a plot is asked for.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: Issue targets drawn as dashed lines (keystroke-to-suggestion latency, in ms).
LSP_TARGETS_MS = {"median": 25.0, "p95": 60.0}
#: Issue target 2 for quantised weights: decode vs our fp32, and greedy agreement with fp32 (%).
QUANT_TARGET_SPEEDUP, QUANT_TARGET_AGREEMENT = 2.0, 95.0
#: Panels whose bars are all our own engine (no peer to grey out).
_ALL_OURS = {
    "engine-ttft",
    "engine-precision",
    "engine-agreement",
    "edits-tasks",
    "wafer-ratios",
    "service-ray",
    "service-memory",
}
#: Issue 20: memory of the sessions sharing one engine, at most this many times one server's.
SHARED_MEMORY_TARGET = 1.3


def _bars(ax, labels: list[str], values: list[float], title: str, ylabel: str, colors=None) -> None:
    xs = range(len(values))
    bars = ax.bar(xs, values, color=colors or ["#d9480f"] + ["#868e96"] * (len(values) - 1))
    ax.set_xticks(list(xs), labels, fontsize=8)
    ax.set_title(title, fontsize=10)
    ax.set_ylabel(ylabel, fontsize=8)
    for b, v in zip(bars, values):
        ax.annotate(
            f"{v:,.0f}" if v >= 10 else f"{v:.2f}",
            (b.get_x() + b.get_width() / 2, b.get_height()),
            ha="center",
            va="bottom",
            fontsize=7,
        )


def _vs_peers(eng: dict[str, Any], key: str) -> tuple[list[str], list[float]]:
    labels, values = ["spark-lsp"], [eng["engine"][key]]
    for peer, d in (eng.get("peers") or {}).items():
        if d and d.get(key):
            labels.append(peer.replace("onnxruntime-genai", "ort-genai"))
            values.append(d[key])
    return labels, values


def panels(
    results: dict[str, Any], detail: bool = False
) -> list[tuple[str, list[str], list[float], str, str]]:
    """The (name, labels, values, title, ylabel) of each panel that `results` has data for.

    Each benchmark's first panel is its headline (the `bench all` figure); ``detail`` adds the
    panels a single benchmark's plot shows as well.  Per-precision panels appear whenever the
    engine benchmark measured more than fp32.
    """
    out = []
    eng = results.get("engine")
    if eng:
        out.append(
            ("engine", *_vs_peers(eng, "decode_tok_s"), "decode, same weights (tok/s)", "tokens/s")
        )
        e = eng["engine"]
        if detail and e.get("prefill_tok_s"):
            out.append(
                (
                    "engine-prefill",
                    *_vs_peers(eng, "prefill_tok_s"),
                    "prefill, same weights (tok/s)",
                    "tokens/s",
                )
            )
        if detail and e.get("ttft_cold_ms") is not None and e.get("ttft_reused_ms") is not None:
            out.append(
                (
                    "engine-ttft",
                    ["cold", "prefix\nreused"],
                    [e["ttft_cold_ms"], e["ttft_reused_ms"]],
                    "time to first token (ms)",
                    "ms",
                )
            )
        rows = eng.get("precisions") or {}
        if rows:
            out.append(
                (
                    "engine-precision",
                    list(rows),
                    [r["decode_tok_s"] for r in rows.values()],
                    "decode per precision (dashed: 2x fp32)",
                    "tokens/s",
                )
            )
            out.append(
                (
                    "engine-agreement",
                    list(rows),
                    [100 * r["greedy_agreement_rate"] for r in rows.values()],
                    "greedy agreement with fp32 (dashed: 95%)",
                    "%",
                )
            )
    edits = results.get("edits")
    if edits and edits.get("summary"):
        s = edits["summary"]
        labels = [f"{k}\nmedian" for k in s] + [f"{k}\nmin" for k in s]
        values = [s[k]["median_ratio"] for k in s] + [s[k]["min_ratio"] for k in s]
        out.append(("edits", labels, values, "speculative / plain decode", "ratio"))
        tasks = [t for t in edits.get("tasks") or [] if t.get("ratio") is not None]
        if detail and tasks:
            out.append(
                (
                    "edits-tasks",
                    [t["task"].replace("-", "\n", 1) for t in tasks],
                    [t["ratio"] for t in tasks],
                    "speculative / plain, per task",
                    "ratio",
                )
            )
    lsp = results.get("lsp")
    if lsp and lsp.get("latency_ms_median") is not None:
        out.append(
            (
                "lsp",
                ["median", "p95"],
                [lsp["latency_ms_median"], lsp["latency_ms_p95"]],
                "keystroke -> suggestion (ms)",
                "ms",
            )
        )
        if detail and lsp.get("cancel_latency_ms_median") is not None:
            out.append(
                (
                    "lsp-cancel",
                    ["median", "p95"],
                    [lsp["cancel_latency_ms_median"], lsp["cancel_latency_ms_p95"]],
                    "cancel -> engine stopped (ms)",
                    "ms",
                )
            )
    out += _service_panels(results.get("service"), detail)
    wafer = results.get("wafer")
    if wafer and wafer.get("dense_decode_tok_s"):
        out.append(
            (
                "wafer",
                ["partitioned", "dense"],
                [wafer["partitioned_decode_tok_s"], wafer["dense_decode_tok_s"]],
                f"emulated {wafer.get('grid', '')} mesh vs plain (tok/s)",
                "tokens/s",
            )
        )
        keys = {
            "ratio_of_medians": "median\ntok/s",
            "median_round_ratio": "per\nround",
            "cpu_ratio": "per\nCPU-s",
        }
        if detail and all(wafer.get(k) is not None for k in keys):
            out.append(
                (
                    "wafer-ratios",
                    list(keys.values()),
                    [wafer[k] for k in keys],
                    "partitioned / dense",
                    "ratio",
                )
            )
    return out


def _service_panels(svc: dict[str, Any] | None, detail: bool) -> list:
    """`bench service`: keystroke to suggestion and per-request overhead per transport, then
    (detail) the Ray runs' p95 and the shared-memory ratios."""
    if not svc:
        return []
    out = []
    t = {n: s for n, s in (svc.get("transports") or {}).items() if s.get("suggestion_ms")}
    if t:
        out.append(
            (
                "service",
                list(t),
                [s["suggestion_ms"]["p50"] for s in t.values()],
                "keystroke -> suggestion p50 (ms)",
                "ms",
            )
        )
        if detail:
            out.append(
                (
                    "service-overhead",
                    list(t),
                    [s["overhead_ms"]["p50"] for s in t.values()],
                    "request -> first byte - TTFT, p50 (ms)",
                    "ms",
                )
            )
    runs = (svc.get("ray") or {}).get("runs") or {}
    if detail and runs:
        out.append(
            (
                "service-ray",
                [_ray_label(name) for name in runs],
                [r["suggestion_ms"]["p95"] for r in runs.values()],
                "Ray Serve: suggestion p95 (ms)",
                "ms",
            )
        )
    memory = svc.get("memory") or {}
    if detail and memory:
        labels, values = [], []
        for model, m in memory.items():
            name = model.split("@")[0].rsplit("-", 1)[-1]  # synthetic-qwen2.5-coder-0.5b: 0.5b
            ratios = {
                "daemon": m.get("ratio_rss"),
                "host": (m.get("host") or {}).get("ratio_rss"),
                "host+d": (m.get("host_daemon") or {}).get("ratio_rss"),
            }
            for what, ratio in ratios.items():
                if ratio is not None:
                    labels.append(f"{name}\n{what}")
                    values.append(ratio)
        if values:
            out.append(("service-memory", labels, values, "4 sessions / one server, RSS", "ratio"))
    return out


def _ray_label(run: str) -> str:
    """``replicas=2,threads=1,editors=16,proxy`` -> ``2r 1t`` / ``16e`` / ``proxy``."""
    parts = run.split(",")
    kv = dict(p.split("=", 1) for p in parts if "=" in p)
    head = f"{kv.get('replicas', '?')}r" + (f" {kv['threads']}t" if "threads" in kv else "")
    return "\n".join([head, f"{kv.get('editors', '?')}e", *(p for p in parts if "=" not in p)])


def require() -> None:
    """Raise RuntimeError (with the install line) when matplotlib is missing: checked before a
    long benchmark run rather than after it."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install matplotlib") from None


def plotter_for_run(name: str, given: Callable | None) -> Callable | None:
    """The ``plot(results, FILE)`` a ``bench NAME --plot`` run draws with (``given``: the one
    the dispatcher handed it, else this module's), checked before the run, not after it: None,
    with the install line on stderr, when matplotlib is missing."""
    try:
        require()
    except RuntimeError as exc:
        print(f"spark-lsp bench {name}: --plot: {exc}", file=sys.stderr)
        return None
    return given or plotter(name)


def plotter(name: str) -> Callable[[dict[str, Any], str | Path], Path]:
    """``plot(results, path)`` for one benchmark's JSON (what ``bench NAME --plot`` passes to it)."""

    def plot(res: dict[str, Any], path: str | Path) -> Path:
        model = res.get("model")
        return draw(
            {name: res},
            path,
            title=f"spark-lsp bench {name}" + (f" - {Path(str(model)).name}" if model else ""),
            detail=True,
        )

    return plot


def draw(
    results: dict[str, Any], path: str | Path, title: str | None = None, detail: bool = False
) -> Path:
    """Write the PNG; raises RuntimeError when matplotlib is missing or there is nothing to draw."""
    require()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ps = panels(results, detail)
    if not ps:
        raise RuntimeError("no benchmark produced results to plot")
    rows = -(-len(ps) // 4)  # at most 4 panels a row, rows filled evenly
    cols = -(-len(ps) // rows)
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 3.4 * rows), squeeze=False)
    flat = list(axes.flat)
    for ax in flat[len(ps) :]:
        ax.set_visible(False)
    for ax, (name, labels, values, title_, ylabel) in zip(flat, ps):
        _bars(
            ax,
            labels,
            values,
            title_,
            ylabel,
            ["#d9480f"] * len(values) if name in _ALL_OURS else None,
        )
        if name == "lsp":
            for i, key in enumerate(("median", "p95")):
                ax.hlines(
                    LSP_TARGETS_MS[key], i - 0.4, i + 0.4, colors="#1c7ed6", linestyles="dashed"
                )
        if name == "service-memory":
            ax.axhline(SHARED_MEMORY_TARGET, color="#1c7ed6", linestyle="dashed", linewidth=1)
        if name in ("edits", "edits-tasks", "wafer-ratios"):
            ax.axhline(1.0, color="#1c7ed6", linestyle="dashed", linewidth=1)
        if name == "engine-precision" and labels and labels[0] == "fp32":
            ax.axhline(
                QUANT_TARGET_SPEEDUP * values[0], color="#1c7ed6", linestyle="dashed", linewidth=1
            )
        if name == "engine-agreement":
            ax.axhline(QUANT_TARGET_AGREEMENT, color="#1c7ed6", linestyle="dashed", linewidth=1)
    if title is None:
        title = "spark-lsp bench all" + (f" - {results['model']}" if results.get("model") else "")
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
