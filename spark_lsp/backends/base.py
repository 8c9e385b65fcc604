"""The backend interface: where suggestions and edits are generated.

Completions, code actions and live edits ask a :class:`Backend` for a :class:`Stream` of text and
read it until it ends or they cancel it; they never know whether the text comes from the
in-process engine (:mod:`.local`) or from a server (llama.cpp, Ollama, an OpenAI-compatible
endpoint, the engine service). That keeps typing-through, post-processing, supersede and cancel
identical for every backend.

The contract, which every implementation keeps:

* ``Backend.infill(request)`` starts one generation and returns at once; the work happens while
  the stream is read.  A :class:`Request` with ``suffix`` set asks for the middle between
  ``prefix`` and ``suffix`` (fill-in-the-middle); with ``suffix=None`` it continues ``prefix``;
  with ``messages`` set it asks a chat model (instruction edits), see ``Backend.supports_chat``.
* A stream is read from one thread. Each ``next()`` returns a :class:`Chunk`; a chunk with empty
  text means "nothing new yet": a remote stream waits at most a few milliseconds per call, so a
  slow server never holds up the other documents that share the reading thread.  Iteration ends
  with the generation; ``finish_reason`` then says why (``stop``, ``length``, ``cancelled``).
* ``Stream.cancel()`` is thread-safe, idempotent and returns at once.  The stream then ends at
  the next ``next()``, and the backend stops generating: the local engine aborts its ONNX Runtime
  run, a remote backend closes the HTTP stream, which aborts the request in llama.cpp, Ollama
  and vLLM (and calls an abort endpoint where the server has one).
* A failure (server down, timeout, HTTP error, a reply that is not the documented format) raises
  :class:`BackendError` from ``infill`` or ``next()``, with a message meant for the user.  While a
  remote backend is failing it refuses new requests at once (:class:`BackendUnavailable`) until
  its back-off delay has passed, so a dead server costs no retry storm.
* ``stream.stats``: figures of the generation (``new_tokens`` received, ``ttft_ms``,
  ``total_ms``, and what the server reports); ``Backend.status()``: a JSON-able summary for
  ``spark/status`` (kind, url, model, health, request and cancel counts, wasted tokens).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Iterator, Protocol


class BackendError(RuntimeError):
    """A backend failed; the message is shown to the user as is (it never contains a secret)."""


class BackendUnavailable(BackendError):
    """The backend failed recently and is in its back-off delay: no request was sent."""


@dataclass(frozen=True, slots=True)
class Chunk:
    """New text of a stream ("" when nothing arrived yet). ``token_id`` is -1 for remote text."""

    text: str
    token_id: int = -1


@dataclass(frozen=True)
class FileChunk:
    """Another open file, offered as context (llama.cpp ``input_extra``, repo-level FIM tokens)."""

    path: str
    text: str


@dataclass(frozen=True)
class Request:
    """What to generate. ``slot`` names the document, so a backend can keep its cache per document
    (the engine's KV slot; a llama.cpp slot kept by ``cache_prompt``)."""

    prefix: str = ""
    suffix: str | None = None            # None: continue `prefix` left to right
    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    slot: str | None = None
    extra: tuple[FileChunk, ...] = ()    # other open files, nearest first
    path: str = ""                       # the document's path (repo-level FIM prompts name it)
    messages: tuple[dict, ...] | None = None  # chat messages (instruction edits) instead of text
    draft: str | None = None             # text the output probably repeats (local speculation)
    prepared: Any = None                 # the backend's own prompt from its `builder` (local: ids)


class Stream(Protocol):
    """A generation in progress (see the module docstring for the contract)."""

    finish_reason: str | None
    stats: dict

    def __iter__(self) -> Iterator[Chunk]: ...
    def __next__(self) -> Chunk: ...
    def cancel(self) -> None: ...


class Backend(abc.ABC):
    """Generates text for the server; one instance per configured backend."""

    kind: str = "backend"            # 'local' | 'llamacpp' | 'ollama' | 'openai' | ...
    supports_chat: bool = False      # `Request.messages` accepted

    @property
    @abc.abstractmethod
    def name(self) -> str:
        """What the user sees in spark/status: the model (and where it runs)."""

    @abc.abstractmethod
    def infill(self, request: Request) -> Stream:
        """Start a generation (see the module docstring); raises BackendError."""

    def status(self) -> dict:
        """A JSON-able summary for spark/status."""
        return {"kind": self.kind, "name": self.name}

    def close(self) -> None:
        """Release connections and threads (idempotent)."""


@dataclass
class Counters:
    """Request accounting shared by the remote backends (spark/status, bench lsp)."""

    requests: int = 0
    cancelled: int = 0           # streams closed before the backend finished
    failed: int = 0
    tokens: int = 0              # tokens the backend streamed to us
    wasted_tokens: int = 0       # of those, tokens of cancelled streams (generated, never shown)
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"requests": self.requests, "cancelled": self.cancelled, "failed": self.failed,
                "tokens": self.tokens, "wasted_tokens": self.wasted_tokens, **self.extra}
