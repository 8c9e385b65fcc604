"""The `spark/status` notification (for editors' status bars) and the server's running metrics."""

from __future__ import annotations

import collections
import logging
import statistics
import threading
from dataclasses import dataclass, field
from typing import Any

from engine.projection import ChipError, load_chip, project_model

from .settings import Settings, SettingsError

log = logging.getLogger(__name__)
STATUS_METHOD = "spark/status"
METRICS_METHOD = "spark/metrics"
#: request {uri} -> {uri, version, text}: the server's copy of a document (a client compares it)
DOCUMENT_METHOD = "spark/document"


def _num(v: Any, nd: int = 2) -> float | None:
    try:
        return round(float(v), nd)
    except (TypeError, ValueError):
        return None


class WaferProjector:
    """Projected decode speed of the loaded model on a wafer (``engine.projection.project_model``,
    the analytic performance model). Computed once per (model, chip, grid) in a background thread,
    since searching region sizes can take a while; None until ready."""

    def __init__(self) -> None:
        self._cache: dict[tuple, dict | None] = {}
        self._lock = threading.Lock()

    @staticmethod
    def check_chip(name: str) -> None:
        """SettingsError unless `name` is a chip the projection knows (no check without it)."""
        try:
            load_chip(name)
        except ChipError as exc:
            raise SettingsError(f"setting 'waferChip': {exc}") from None

    def get(self, model: Any, settings: Settings) -> dict | None:
        """The projection for `model` (a model_host.Model whose `config` is known), else None."""
        if getattr(model, "config", None) is None:
            return None
        # sessions sharing one engine (model_host.SharedModel.shared) share its projection
        key = (id(getattr(model, "shared", model)), settings.wafer_chip, settings.wafer_region)
        with self._lock:
            if key in self._cache:
                return self._cache[key]
            self._cache[key] = None
        threading.Thread(
            target=self._compute,
            args=(key, model, settings),
            daemon=True,
            name="spark-wafer-projection",
        ).start()
        return None

    def _compute(self, key: tuple, model: Any, settings: Settings) -> None:
        try:  # background work: yield the CPU to the engine and the editor's requests (Linux)
            import os

            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (AttributeError, OSError):
            pass
        try:
            out = project_model(
                model.config,
                chip=settings.wafer_chip or "wse3",
                grid=settings.wafer_region,
                name=model.name,
            )
        except Exception as exc:  # a projection must never break a completion
            log.warning("wafer projection failed: %s", exc)
            out = {"error": str(exc)}
        with self._lock:
            self._cache[key] = out


def status_payload(
    model: str, kind: str, stats: dict, wafer: dict | None, where: str | None = None
) -> dict:
    """A finished generation's figures; `where` it ran (`Model.where`)."""
    out = {
        "model": model,
        "kind": kind,
        "engine": where,
        "tokensPerSecond": _num(stats.get("decode_tok_s"), 1),
        "ttftMs": _num(stats.get("ttft_ms")),
        "promptTokens": stats.get("prompt_tokens"),
        "reusedPromptTokens": stats.get("reused_tokens"),
        "newTokens": stats.get("new_tokens"),
        "totalMs": _num(stats.get("total_ms")),
        "finishReason": stats.get("finish_reason"),
    }
    if stats.get("answered"):  # answered before it was finished: when, and with what
        out["answered"] = stats["answered"]
        out["answerMs"] = _num(stats.get("answer_ms"))
    if wafer:
        out["wafer"] = wafer
        if wafer.get("decode_tok_s") is not None:
            out["waferDecodeTokensPerSecond"] = wafer["decode_tok_s"]
    return out


def percentile(xs: list[float], q: float) -> float | None:
    """The `q` quantile (0..1) of `xs`, interpolated linearly between the two nearest ranks (numpy's
    default, and `statistics.median` at 0.5): the one percentile of the server's metrics and of
    every bench, so what `spark/metrics` and a bench report agree; None for none."""
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * min(1.0, max(0.0, q))
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _rounded(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


@dataclass
class Metrics:
    """Counters the bench and the demo read through `spark/metrics`."""

    inline_requests: int = 0
    typing_through: int = 0
    joined: int = 0  # requests answered by joining a generation already running
    answered_early: int = 0  # automatic requests answered before their suggestion was finished
    accepted: int = 0  # suggestions the user accepted (the items' command ran)
    accepted_chars: int = 0
    model_calls: int = 0
    prefix_cache_hits: int = 0  # model calls whose prompt reused cached tokens
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
            "joinedGeneration": self.joined,
            "answeredEarly": self.answered_early,
            "accepted": self.accepted,
            "acceptedChars": self.accepted_chars,
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
            "cancelLatencyMsMedian": _rounded(percentile(cancel_latencies_ms, 0.5)),
            "cancelLatencyMsP95": _rounded(percentile(cancel_latencies_ms, 0.95)),
        }
