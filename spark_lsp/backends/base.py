"""Remote backends: the server's `Model` seam (`spark_lsp.model_host`) served by another server.

The services generate through a `model_host.Model`: ``generate(ids, params, slot, cancel=...,
text=...)`` returns a stream of text chunks that its `CancelToken` stops. The in-process engine
(`model_host.LocalModel`) reads the token ids; a remote backend (llama.cpp, Ollama, an
OpenAI-compatible server, the engine service) tokenises on its side and reads ``text``, a
:class:`TextPrompt`: the prefix and suffix the ids encode (fill-in-the-middle), or the chat
messages of an instruction edit. Completions, code actions and live edits cannot tell them apart,
so typing-through, post-processing, supersede and cancel are the same for every backend.

What a remote stream promises on top of the `model_host.Stream` contract:

* ``next()`` returns a chunk with empty text when nothing arrived yet: it waits at most a few
  milliseconds, so a slow server never holds up the other documents that share the reading
  thread (the scheduler's engine thread);
* ``cancel()`` (or the request's `CancelToken`) closes the HTTP stream at once, which makes
  llama.cpp, Ollama and vLLM stop generating; ``stop()`` does the same for a stream whose output
  is complete (its tokens were used, so they do not count as wasted);
* a failure (server down, timeout, HTTP error, a reply that is not the documented format) raises
  :class:`BackendError` with a message for the user; while a backend is failing, new requests
  are refused at once (:class:`BackendUnavailable`) until its back-off delay has passed;
* ``stats``: ``new_tokens`` received, ``ttft_ms``, ``total_ms`` and what the server reports.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class BackendError(RuntimeError):
    """A backend failed; the message is shown to the user as is (it never contains a secret)."""

    expected = True  # an outside failure, reported to the user: no traceback in the log


class BackendUnavailable(BackendError):
    """The backend failed recently and is in its back-off delay: no request was sent."""


@dataclass(frozen=True, slots=True)
class Chunk:
    """New text of a stream ("" when nothing arrived yet)."""

    text: str


@dataclass(frozen=True)
class FileChunk:
    """Another open file, offered as context (llama.cpp ``input_extra``, repo-level FIM tokens)."""

    path: str
    text: str


@dataclass(frozen=True)
class TextPrompt:
    """What a prompt's token ids encode, for a model that tokenises on its side."""

    prefix: str = ""
    suffix: str | None = None  # None: continue `prefix` left to right
    messages: tuple[dict, ...] | None = None  # chat messages (instruction edits) instead of text
    extra: tuple[FileChunk, ...] = ()  # other open files, nearest first (repo-level context)
    path: str = ""  # the document's path (repo-level FIM prompts name it)


@dataclass(frozen=True)
class Request:
    """One generation as a remote client sends it: the text and how to decode it."""

    prefix: str = ""
    suffix: str | None = None
    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    extra: tuple[FileChunk, ...] = ()
    path: str = ""
    messages: tuple[dict, ...] | None = None

    @classmethod
    def of(cls, text: TextPrompt, params: Any) -> Request:
        """From a TextPrompt and `engine.GenerationParams`-like decoding parameters."""
        return cls(
            prefix=text.prefix,
            suffix=text.suffix,
            messages=text.messages,
            extra=text.extra,
            path=text.path,
            max_tokens=int(params.max_new_tokens),
            temperature=float(params.temperature),
            top_p=float(getattr(params, "top_p", 1.0)),
            seed=getattr(params, "seed", None),
            stop=tuple(getattr(params, "stop", ()) or ()),
        )


@dataclass
class Counters:
    """Request accounting of a remote backend (spark/metrics, bench lsp)."""

    requests: int = 0
    cancelled: int = 0  # streams closed before the backend finished
    failed: int = 0
    tokens: int = 0  # tokens the backend streamed to us
    wasted_tokens: int = 0  # of those, tokens of cancelled streams (generated, never shown)
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {
            "requests": self.requests,
            "cancelled": self.cancelled,
            "failed": self.failed,
            "tokens": self.tokens,
            "wasted_tokens": self.wasted_tokens,
            **self.extra,
        }
