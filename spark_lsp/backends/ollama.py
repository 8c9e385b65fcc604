"""Ollama: ``/api/generate`` with ``suffix`` (NDJSON streaming), ``/api/chat`` for instructions.

FIM: by default the suffix goes in Ollama's ``suffix`` field and the model's Ollama template
lays out the prompt. With an explicit ``fimTemplate`` (or when Ollama answers that the model's
template "does not support insert") the prompt is rendered here with the family's FIM tokens and
sent with ``raw: true``, which skips Ollama's templating.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from . import templates
from .base import BackendError, Request
from .http import Event, RemoteBackend, loads

log = logging.getLogger(__name__)

_FINISH = {"stop": "stop", "length": "length"}


def _events(payload: str) -> list[Event]:
    obj = loads(payload)
    if "response" in obj:
        text = obj["response"]
    elif isinstance(obj.get("message"), dict):  # /api/chat
        text = obj["message"].get("content", "")
    elif obj.get("done"):
        text = ""
    else:
        raise ValueError(f"neither 'response' nor 'message' in {payload[:120]!r}")
    if not isinstance(text, str):
        raise ValueError(f"'response' is not a string in {payload[:120]!r}")
    if not obj.get("done"):
        return [Event(text)]
    stats = {k: obj[k] for k in ("eval_count", "prompt_eval_count") if isinstance(obj.get(k), int)}
    if "eval_count" in stats:
        stats["server_tokens"] = stats["eval_count"]
    reason = obj.get("done_reason")
    return [
        Event(
            text,
            done=True,
            finish_reason=_FINISH.get(reason, "stop"),
            tokens=1 if text else 0,
            stats=stats or None,
        )
    ]


class OllamaBackend(RemoteBackend):
    kind = "ollama"
    default_url = "http://127.0.0.1:11434"
    supports_chat = True

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        explicit = self.fim_template not in (None, "", "auto") or self.fim_format not in (
            None,
            "",
            "auto",
        )
        self.template = (
            templates.resolve(self.fim_template, self.model, self.fim_format) if explicit else None
        )
        self.raw = explicit

    def adapt(self, status: int, body: str) -> bool:
        """The model's Ollama template has no .Suffix ("does not support insert"): lay out FIM
        here and send raw prompts from now on, when the model's family is known."""
        if "does not support insert" not in body or self.raw:
            return False
        self.template = templates.resolve("auto", self.model)
        if self.template is None:
            return False
        log.info(
            "%s: %s has no FIM template in Ollama; sending raw %s FIM prompts",
            self.label,
            self.model,
            self.template.name,
        )
        self.raw = True
        return True

    def describe_http_error(self, status: int, body: str) -> str:
        msg = super().describe_http_error(status, body)
        if "does not support insert" in body:
            return f"{msg}; set 'fimTemplate' to the model's FIM layout (e.g. qwen, deepseek, starcoder)"
        return msg

    def build(self, r: Request) -> tuple[str, dict, Callable[[str], list[Event]], bool]:
        if not self.model:
            raise BackendError(
                "the ollama backend needs a model: set 'backendModel' (e.g. qwen2.5-coder:1.5b-base)"
            )
        options: dict = {"num_predict": r.max_tokens, "temperature": r.temperature}
        if r.top_p < 1.0:
            options["top_p"] = r.top_p
        if r.seed is not None:
            options["seed"] = r.seed
        stop = list(r.stop)
        body: dict = {"model": self.model, "stream": True, "options": options}
        if r.messages is not None:
            body["messages"] = list(r.messages)
            if stop:
                options["stop"] = stop
            return "/api/chat", body, _events, False
        if r.suffix is None:
            body["prompt"], body["raw"] = r.prefix, True
        elif self.raw and self.template is not None:
            body["prompt"], body["raw"] = (
                self.template.render(r.prefix, r.suffix, r.extra, r.path),
                True,
            )
            stop += [s for s in self.template.stop if s not in stop]
        else:
            body["prompt"], body["suffix"] = r.prefix, r.suffix
        if stop:
            options["stop"] = stop
        return "/api/generate", body, _events, False

    def status(self) -> dict:
        fim = f"raw {self.template.name}" if self.raw and self.template else "Ollama's suffix"
        return {**super().status(), "fim": fim}
