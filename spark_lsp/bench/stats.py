"""The timing rows of `spark-lsp bench service` and their summaries: one row per keystroke
(first byte, the engine's TTFT, the overhead between them, the whole suggestion, prompt reuse),
shared by its transport comparison and its Ray runs."""

from __future__ import annotations

import statistics
from typing import Any

from ..status import percentile as pct  # the server's metrics' percentile, for every bench


def summary(rows: list[dict]) -> dict[str, Any]:
    """p50, p95 and mean of each timing column of `rows`, the mean request size and the share
    of prompt tokens reused."""

    def col(k):
        return [r[k] for r in rows if r.get(k) is not None]

    out: dict[str, Any] = {"keystrokes": len(rows)}
    for k in ("first_byte_ms", "ttft_ms", "overhead_ms", "suggestion_ms", "engine_ms"):
        xs = col(k)
        out[k] = {
            "p50": pct(xs, 0.5),
            "p95": pct(xs, 0.95),
            "mean": statistics.fmean(xs) if xs else None,
        }
    sizes = col("request_bytes")
    out["request_bytes_mean"] = statistics.fmean(sizes) if sizes else None
    pt = sum(r.get("prompt_tokens", 0) for r in rows)
    out["prefix_reuse"] = sum(r.get("reused_tokens", 0) for r in rows) / pt if pt else None
    return out


def keystroke_row(t0: float, t_first: float | None, t_end: float, stats: dict) -> dict:
    """One keystroke's row: its request at `t0`, first text at `t_first`, end at `t_end`
    (perf_counter seconds), and the engine's `done` stats."""
    t_first = t_first if t_first is not None else t_end
    first = (t_first - t0) * 1e3
    ttft = float(stats.get("ttft_ms", 0.0))
    return {
        "first_byte_ms": first,
        "ttft_ms": ttft,
        "overhead_ms": first - ttft if first is not None else None,
        "suggestion_ms": (t_end - t0) * 1e3,
        "engine_ms": stats.get("total_ms"),  # the engine's own time, request taken -> its end
        "prompt_tokens": stats.get("prompt_tokens", 0),
        "reused_tokens": stats.get("reused_tokens", 0),
    }


def percentiles(xs: list[float]) -> dict:
    """p50, p95 and the count of `xs`."""
    return {"p50": pct(xs, 0.5), "p95": pct(xs, 0.95), "n": len(xs)}


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, None where either is unknown or b is 0."""
    return a / b if a is not None and b else None
