"""The `spark/status` notification (for editors' status bars) and the server's running metrics."""

from __future__ import annotations

import collections
import logging
import statistics
from dataclasses import dataclass, field
from typing import Any

from .settings import Settings

log = logging.getLogger(__name__)
STATUS_METHOD = "spark/status"
METRICS_METHOD = "spark/metrics"


def _num(v: Any, nd: int = 2) -> float | None:
    try:
        return round(float(v), nd)
    except (TypeError, ValueError):
        return None


def wafer_projection(engine: Any, settings: Settings) -> dict | None:
    """Projected decode speed on the emulated wafer for this model, if the engine's wafer package
    offers a performance model; None otherwise (it is optional)."""
    try:
        from engine.wafer import perf  # noqa: F401  (optional module)
    except Exception:
        return None
    try:
        fn = getattr(perf, "project_decode", None)
        if fn is None:
            return None
        kw = {}
        if settings.wafer_chip:
            kw["chip"] = settings.wafer_chip
        if settings.wafer_grid:
            kw["grid"] = settings.wafer_grid
        out = fn(engine.config, **kw)
        if isinstance(out, dict):
            return out
        return {"decode_tok_s": _num(out, 1)}
    except Exception as exc:  # a projection must never break a completion
        log.debug("wafer projection failed: %s", exc)
        return None


def status_payload(model: str, kind: str, stats: dict, wafer: dict | None) -> dict:
    out = {
        "model": model,
        "kind": kind,
        "tokensPerSecond": _num(stats.get("decode_tok_s"), 1),
        "ttftMs": _num(stats.get("ttft_ms")),
        "promptTokens": stats.get("prompt_tokens"),
        "reusedPromptTokens": stats.get("reused_tokens"),
        "newTokens": stats.get("new_tokens"),
        "totalMs": _num(stats.get("total_ms")),
        "finishReason": stats.get("finish_reason"),
    }
    if wafer:
        out["wafer"] = wafer
        if "decode_tok_s" in wafer:
            out["waferDecodeTokensPerSecond"] = wafer["decode_tok_s"]
    return out


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    k = min(len(xs) - 1, max(0, int(round(q / 100 * (len(xs) - 1)))))
    return round(xs[k], 3)


@dataclass
class Metrics:
    """Counters the bench and the demo read through `spark/metrics`."""

    inline_requests: int = 0
    typing_through: int = 0
    model_calls: int = 0
    prefix_cache_hits: int = 0        # model calls whose prompt reused cached tokens
    prompt_tokens: int = 0
    reused_tokens: int = 0
    cancelled: int = 0
    superseded: int = 0
    errors: int = 0
    edits: int = 0
    live_flushes: int = 0
    ttft_ms: collections.deque = field(default_factory=lambda: collections.deque(maxlen=2000))
    server_ms: collections.deque = field(default_factory=lambda: collections.deque(maxlen=2000))

    def record_generation(self, stats: dict) -> None:
        self.model_calls += 1
        p, r = stats.get("prompt_tokens") or 0, stats.get("reused_tokens") or 0
        self.prompt_tokens += int(p)
        self.reused_tokens += int(r)
        if r:
            self.prefix_cache_hits += 1
        if stats.get("ttft_ms") is not None:
            self.ttft_ms.append(float(stats["ttft_ms"]))

    def snapshot(self, cancel_latencies_ms: list[float]) -> dict:
        return {
            "inlineRequests": self.inline_requests,
            "typingThrough": self.typing_through,
            "modelCalls": self.model_calls,
            "prefixCacheHits": self.prefix_cache_hits,
            "promptTokens": self.prompt_tokens,
            "reusedTokens": self.reused_tokens,
            "cancelled": self.cancelled,
            "superseded": self.superseded,
            "errors": self.errors,
            "edits": self.edits,
            "liveFlushes": self.live_flushes,
            "ttftMsMedian": round(statistics.median(self.ttft_ms), 3) if self.ttft_ms else None,
            "cancelLatencyMs": list(cancel_latencies_ms),
            "cancelLatencyMsMedian": _pct(cancel_latencies_ms, 50),
            "cancelLatencyMsP95": _pct(cancel_latencies_ms, 95),
        }
