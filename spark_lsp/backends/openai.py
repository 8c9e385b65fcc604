"""Any OpenAI-compatible server: vLLM, SGLang, TGI, LM Studio, llama.cpp, llama-cpp-python.

Completions go to ``/v1/completions`` (SSE). FIM: when the model's family is known (from the
``fimTemplate`` setting or the model name) the prompt is laid out here with that family's tokens,
which works on every server (vLLM, SGLang and TGI have no ``suffix`` parameter); otherwise the
suffix is sent as ``suffix``, which servers that know the model's FIM tokens (llama-cpp-python,
OpenAI's legacy models) apply themselves. ``fimTemplate: "suffix"`` forces the parameter.
Instruction edits on chat models go to ``/v1/chat/completions``.
"""

from __future__ import annotations

from collections.abc import Callable

from . import templates
from .base import Request
from .http import Event, RemoteBackend, loads

_FINISH = {"stop": "stop", "length": "length", "eos": "stop"}


def _completion_events(payload: str) -> list[Event]:
    if payload == "[DONE]":
        return [Event(done=True)]
    obj = loads(payload)
    choices = obj.get("choices")
    if not isinstance(choices, list):
        raise ValueError(f"no 'choices' in {payload[:120]!r}")
    out = []
    for ch in choices[:1]:
        text = ch.get("text")
        if text is None and isinstance(ch.get("delta"), dict):  # chat
            text = ch["delta"].get("content")
        if text is not None and not isinstance(text, str):
            raise ValueError(f"'text' is not a string in {payload[:120]!r}")
        reason = ch.get("finish_reason")
        out.append(Event(text or "", finish_reason=_FINISH.get(reason, reason) if reason else None))
    usage = obj.get("usage")
    if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
        out.append(Event(stats={"server_tokens": usage["completion_tokens"]}))
    return out


class OpenAIBackend(RemoteBackend):
    kind = "openai"
    default_url = "http://127.0.0.1:8000"
    supports_chat = True

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.template = (
            None
            if self.fim_template == "suffix"
            else templates.resolve(self.fim_template, self.model, self.fim_format)
        )

    def _common(self, r: Request) -> dict:
        body: dict = {"max_tokens": r.max_tokens, "temperature": r.temperature, "stream": True}
        if self.model:
            body["model"] = self.model
        if r.top_p < 1.0:
            body["top_p"] = r.top_p
        if r.seed is not None:
            body["seed"] = r.seed
        return body

    def build(self, r: Request) -> tuple[str, dict, Callable[[str], list[Event]], bool]:
        body = self._common(r)
        stop = list(r.stop)
        if r.messages is not None:
            body["messages"] = list(r.messages)
            if stop:
                body["stop"] = stop
            return "/v1/chat/completions", body, _completion_events, True
        if r.suffix is None:
            body["prompt"] = r.prefix
        elif self.template is not None:
            body["prompt"] = self.template.render(r.prefix, r.suffix, r.extra, r.path)
            stop += [s for s in self.template.stop if s not in stop]
        else:
            body["prompt"], body["suffix"] = r.prefix, r.suffix
        if stop:
            body["stop"] = stop
        return "/v1/completions", body, _completion_events, True

    def status(self) -> dict:
        return {
            **super().status(),
            "fim": self.template.name if self.template else "suffix parameter",
        }
