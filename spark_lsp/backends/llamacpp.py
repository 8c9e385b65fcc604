"""llama.cpp's server (``llama-server``): ``/infill`` for FIM, ``/completion``, chat through
``/v1/chat/completions``.

``/infill`` lays out the FIM prompt on the server with the model's own FIM tokens; other open
files go in ``input_extra`` (llama.cpp turns them into repo-level context), and ``cache_prompt``
keeps the slot's KV cache, so a keystroke only prefills what changed. Replies stream as SSE;
closing the connection makes the server stop the slot's generation.
"""

from __future__ import annotations

from collections.abc import Callable

from .base import Request
from .http import Event, RemoteBackend, loads
from .openai import _completion_events

_FINISH = {"eos": "stop", "word": "stop", "limit": "length"}


def _events(payload: str) -> list[Event]:
    obj = loads(payload)
    text = obj.get("content", "")
    if not isinstance(text, str):
        raise ValueError(f"'content' is not a string in {payload[:120]!r}")
    if not obj.get("stop"):
        return [Event(text)]
    stats = {}
    if isinstance(obj.get("tokens_predicted"), int):
        stats["server_tokens"] = obj["tokens_predicted"]
    if isinstance(obj.get("tokens_cached"), int):
        stats["server_cached_tokens"] = obj["tokens_cached"]
    timings = obj.get("timings")
    if isinstance(timings, dict):
        for k in ("prompt_n", "prompt_ms", "predicted_n", "predicted_ms"):
            if isinstance(timings.get(k), (int, float)):
                stats[f"server_{k}"] = timings[k]
    return [
        Event(
            text,
            done=True,
            finish_reason=_FINISH.get(obj.get("stop_type"), "stop"),
            tokens=1 if text else 0,
            stats=stats or None,
        )
    ]


class LlamaCppBackend(RemoteBackend):
    kind = "llamacpp"
    default_url = "http://127.0.0.1:8080"
    supports_chat = True

    def build(self, r: Request) -> tuple[str, dict, Callable[[str], list[Event]], bool]:
        body: dict = {
            "n_predict": r.max_tokens,
            "temperature": r.temperature,
            "stream": True,
            "cache_prompt": True,
        }
        if r.top_p < 1.0:
            body["top_p"] = r.top_p
        if r.seed is not None:
            body["seed"] = r.seed
        if r.stop:
            body["stop"] = list(r.stop)
        if r.messages is not None:
            chat = {
                "messages": list(r.messages),
                "max_tokens": r.max_tokens,
                "temperature": r.temperature,
                "stream": True,
                **({"stop": list(r.stop)} if r.stop else {}),
            }
            if self.model:
                chat["model"] = self.model
            return "/v1/chat/completions", chat, _completion_events, True
        if r.suffix is None:
            body["prompt"] = r.prefix
            return "/completion", body, _events, True
        body.update(input_prefix=r.prefix, input_suffix=r.suffix, prompt="")
        if r.extra:
            body["input_extra"] = [{"filename": c.path, "text": c.text} for c in r.extra]
        return "/infill", body, _events, True
