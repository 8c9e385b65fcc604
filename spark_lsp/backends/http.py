"""What the remote backends share: one pooled HTTP client on an I/O thread, streams that a
cancel closes, the API key, and back-off after failures.

Why an I/O thread with an asyncio loop: a stream is read by the scheduler's engine thread one
chunk at a time, interleaved with other documents; the HTTP reading itself runs on this loop, so a
blocking read never stalls another document, and a cancel is a task cancellation that closes the
connection at once (httpx drops a connection whose body was not read to the end, which is what
tells llama.cpp, Ollama and vLLM to stop generating).

Why one ``httpx.AsyncClient`` per backend: it keeps its connections alive between requests
(HTTP/1.1 keep-alive), so a keystroke costs no TCP or TLS handshake.  A cancelled stream's
connection is closed (the server must see the disconnect); the next request opens a new one.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from engine.cancel import CancelToken

from .base import BackendError, BackendUnavailable, Chunk, Counters, Request, TextPrompt
from .text_prompt import EstimatedTokens

if TYPE_CHECKING:
    import httpx

log = logging.getLogger(__name__)

#: How long one `next()` waits for text before handing the engine thread to other documents.
POLL_S = 0.01


def read_api_key(env: str | None, file: str | None) -> str | None:
    """The API key from the environment variable `env` or the file `file` (first line), or None.
    Raises BackendError naming the variable or file (never the key) when it cannot be read."""
    if env:
        value = os.environ.get(env)
        if value is None or not value.strip():
            raise BackendError(
                f"the API key variable {env} (setting 'backendApiKeyEnv') is not set"
            )
        return value.strip()
    if file:
        try:
            value = Path(file).expanduser().read_text(encoding="utf-8").strip().splitlines()
        except OSError as exc:
            raise BackendError(
                f"cannot read the API key file {file} (setting 'backendApiKeyFile'): "
                f"{exc.strerror or exc}"
            ) from None
        if not value or not value[0].strip():
            raise BackendError(f"the API key file {file} (setting 'backendApiKeyFile') is empty")
        return value[0].strip()
    return None


class Health:
    """Failures in a row and the back-off they earn: 0.5 s, 1 s, 2 s ... capped at `cap_s`.
    A request in the delay is refused without touching the network (no retry storm)."""

    def __init__(
        self, base_s: float = 0.5, cap_s: float = 30.0, clock: Callable[[], float] = time.monotonic
    ):
        self.base_s, self.cap_s, self._clock = base_s, cap_s, clock
        self.failures = 0
        self.retry_at = 0.0
        self.last_error: str | None = None
        self._lock = threading.Lock()

    @property
    def ok(self) -> bool:
        return self.failures == 0

    def delay(self) -> float:
        """Seconds left before the next request may be sent (0: now)."""
        return max(0.0, self.retry_at - self._clock())

    def failed(self, message: str) -> bool:
        """Record a failure; True when it is the first of a run (the one to tell the user)."""
        with self._lock:
            self.failures += 1
            self.last_error = message
            self.retry_at = self._clock() + min(self.cap_s, self.base_s * 2 ** (self.failures - 1))
            return self.failures == 1

    def succeeded(self) -> bool:
        """Record a success; True when it ends a run of failures."""
        with self._lock:
            was_down = self.failures > 0
            self.failures, self.retry_at, self.last_error = 0, 0.0, None
            return was_down

    def as_dict(self) -> dict:
        return {
            "ok": self.ok,
            "failures": self.failures,
            "last_error": self.last_error,
            "retry_in_s": round(self.delay(), 2),
        }


@dataclass
class Event:
    """One parsed message of a streamed reply."""

    text: str = ""
    done: bool = False
    finish_reason: str | None = None
    tokens: int | None = None  # tokens this event carries, when the server says (else 1 if text)
    stats: dict | None = None  # figures the server reports at the end


class HttpStream:
    """A remote generation: the reply is read on the backend's loop, chunks are handed over
    through a queue. Implements the `Stream` contract of `base`."""

    def __init__(self, backend: RemoteBackend, request: Request) -> None:
        self._backend = backend
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._cancelled = threading.Event()
        self._ended = False
        self._kept = False
        self.finish_reason: str | None = None
        self.text = ""
        self.stats: dict = {"new_tokens": 0, "ttft_ms": 0.0, "total_ms": 0.0}
        self._t0 = time.perf_counter()
        self._future = asyncio.run_coroutine_threadsafe(self._run(request), backend._loop)

    # -- reading (backend loop) ----------------------------------------------------------------
    async def _run(self, request: Request) -> None:
        import httpx  # loaded by the backend's __init__ already

        b = self._backend
        try:
            await self._read(request, retry=True)
        except asyncio.CancelledError:
            self._q.put(("end", "cancelled", 0))
            raise
        except BackendError as exc:
            self._q.put(("error", exc, 0))
        except httpx.TimeoutException:
            self._q.put(
                (
                    "error",
                    BackendError(
                        f"{b.label} did not answer within {b.timeout_s:g} s (setting 'backendTimeoutS')"
                    ),
                    0,
                )
            )
        except httpx.HTTPError as exc:
            self._q.put(("error", BackendError(f"{b.label} is unreachable: {_short(exc)}"), 0))
        except Exception as exc:  # a reply that is not the documented format
            log.debug("bad reply from %s", b.label, exc_info=True)
            self._q.put(
                (
                    "error",
                    BackendError(f"{b.label} sent a reply spark-lsp cannot read: {_short(exc)}"),
                    0,
                )
            )

    async def _read(self, request: Request, retry: bool) -> None:
        b = self._backend
        path, body, parse, sse = b.build(request)
        async with b.client.stream("POST", path, json=body) as resp:
            if resp.status_code >= 400:
                detail = (await resp.aread()).decode("utf-8", "replace")
                if retry and b.adapt(resp.status_code, detail):
                    return await self._read(request, retry=False)  # the backend changed its request
                raise BackendError(b.describe_http_error(resp.status_code, detail))
            finish, ended = None, False  # OpenAI-style streams give the reason before their end
            async for line in resp.aiter_lines():
                payload = _payload(line, sse)
                if payload is None or ended:
                    continue  # read the reply to its end: then the connection goes back to the pool
                for ev in parse(payload):
                    if ev.text:
                        self._q.put(("text", ev.text, ev.tokens if ev.tokens is not None else 1))
                    if ev.stats:
                        self._q.put(("stats", ev.stats, 0))
                    finish = ev.finish_reason or finish
                    if ev.done:
                        ended = True
                        break
        # after the reply is read to its end and the connection is back in the pool, so the
        # next request (often right after this one) reuses it
        self._q.put(("end", finish or "stop", 0))

    # -- the Stream contract (consumer thread) -------------------------------------------------
    def __iter__(self) -> HttpStream:
        return self

    def __next__(self) -> Chunk:
        if self._ended:
            raise StopIteration
        if self._cancelled.is_set():
            self._end("cancelled")
            raise StopIteration
        try:
            kind, value, n = self._q.get(timeout=POLL_S)
        except queue.Empty:
            return Chunk("")
        if kind == "text":
            if not self.stats["new_tokens"]:
                self.stats["ttft_ms"] = (time.perf_counter() - self._t0) * 1e3
            self.stats["new_tokens"] += n
            self.text += value
            return Chunk(value)
        if kind == "stats":
            self.stats.update(value)
            return Chunk("")
        if kind == "wake":  # cancel() woke us up
            self._end("cancelled")
            raise StopIteration
        if kind == "error":
            self._end("error", value)
            raise value
        self._end(value)
        raise StopIteration

    def stop(self) -> None:
        """End early because the output is complete: a cancel whose tokens were used."""
        self._kept = True
        self.cancel()

    def cancel(self) -> None:
        if self._cancelled.is_set() or self._ended:
            return
        self._cancelled.set()
        self._future.cancel()  # thread-safe: cancels the reading task, which closes the connection
        self._q.put(("wake", None, 0))

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def _end(self, reason: str, error: BackendError | None = None) -> None:
        self._ended = True
        self.finish_reason = reason
        self.stats["total_ms"] = (time.perf_counter() - self._t0) * 1e3
        self._backend._settle(self, reason, error)


def _payload(line: str, sse: bool) -> str | None:
    """The message of one line of a streamed reply (SSE `data:` payload or NDJSON line), or None."""
    line = line.strip()
    if not line:
        return None
    if sse:
        if not line.startswith("data:"):
            if line.startswith((":", "event:", "id:", "retry:")):
                return None  # SSE comments and other fields
            raise ValueError(f"not a server-sent event: {line[:120]!r}")
        line = line[5:].strip()
    return line


def _short(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:300]


def loads(payload: str) -> dict:
    """One JSON object of a stream; ValueError with the offending text otherwise."""
    try:
        obj = json.loads(payload)
    except json.JSONDecodeError:
        raise ValueError(f"not JSON: {payload[:120]!r}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"not a JSON object: {payload[:120]!r}")
    if "error" in obj and obj["error"]:
        err = obj["error"]
        msg = err.get("message") if isinstance(err, dict) else err
        raise BackendError(f"the server reported an error: {str(msg)[:300]}")
    return obj


class RemoteBackend:
    """An HTTP server that generates text, as a `model_host.Model`; subclasses say how a request
    is sent and read."""

    kind = "remote"
    default_url = "http://127.0.0.1:8080"
    supports_chat = False  # TextPrompt.messages accepted
    context: int | None = None  # the server's model context is not known here
    config = None  # nor its architecture (no wafer projection)

    def __init__(
        self,
        url: str | None = None,
        model: str | None = None,
        *,
        api_key: str | None = None,
        timeout_s: float = 30.0,
        connect_timeout_s: float = 3.0,
        health: Health | None = None,
        fim_template: str | None = None,
        fim_format: str | None = None,
    ) -> None:
        self.url = (url or self.default_url).rstrip("/")
        self.model = model
        self.timeout_s = timeout_s
        self.fim_template = fim_template
        self.fim_format = fim_format  # the engine's fimFormat setting: a family, or auto
        self.health = health or Health()
        self.counters = Counters()
        self.tokenizer = EstimatedTokens()  # what the prompt builder counts with
        #: called with (ok, message) when the backend starts failing (once per run of failures)
        #: and when it answers again; from the thread that reads the stream
        self.on_health: Callable[[bool, str], None] | None = None
        # httpx loads with the first remote backend, not with the server: a language server whose
        # model is in-process or in the engine service stays without it
        import httpx

        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=f"spark-{self.kind}-io", daemon=True
        )
        self._thread.start()
        self._lock = threading.Lock()
        self._closed = False

        async def make() -> httpx.AsyncClient:
            return httpx.AsyncClient(
                base_url=self.url,
                headers=headers,
                timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s),
                limits=httpx.Limits(
                    max_connections=16, max_keepalive_connections=8, keepalive_expiry=300
                ),
            )

        self.client: httpx.AsyncClient = asyncio.run_coroutine_threadsafe(
            make(), self._loop
        ).result()

    @property
    def label(self) -> str:
        return f"the {self.kind} backend at {self.url}"

    @property
    def where(self) -> str:
        return f"{self.kind} {self.url}"

    @property
    def name(self) -> str:
        return f"{self.model or self.kind} @ {self.url}"

    def __repr__(self) -> str:  # never shows the API key
        return f"{type(self).__name__}(url={self.url!r}, model={self.model!r})"

    # -- subclasses ----------------------------------------------------------------------------
    def build(self, request: Request) -> tuple[str, dict, Callable[[str], list[Event]], bool]:
        """(path, JSON body, payload parser, is SSE) for `request`."""
        raise NotImplementedError

    def adapt(self, status: int, body: str) -> bool:
        """An HTTP error that the backend can work around by sending the request differently
        (e.g. Ollama's "does not support insert"): True when it changed how it builds requests,
        and the request is sent once more."""
        return False

    def describe_http_error(self, status: int, body: str) -> str:
        detail = body.strip()
        try:
            obj = json.loads(detail)
            err = obj.get("error", obj) if isinstance(obj, dict) else obj
            detail = err.get("message", detail) if isinstance(err, dict) else str(err)
        except (ValueError, AttributeError):
            pass
        return f"{self.label} answered HTTP {status}: {str(detail)[:300]}"

    # -- the Model seam ------------------------------------------------------------------------
    def generate(
        self,
        ids: list[int],
        params,
        slot: str,
        *,
        cancel: CancelToken,
        speculative: bool = False,
        draft: str | None = None,
        text: TextPrompt | None = None,
    ) -> HttpStream:
        """Stream the generation `text` asks for, decoded as `params` say (the token ids are
        the engine's; the server tokenises itself); `cancel` closes the stream."""
        if text is None:
            raise BackendError(f"{self.label} needs the prompt's text (TextPrompt), not token ids")
        stream = self.infill(Request.of(text, params))
        cancel.on_cancel(lambda reason: stream.cancel())
        return stream

    def infill(self, request: Request) -> HttpStream:
        """Start one request (no network I/O in the caller's thread)."""
        if self._closed:
            raise BackendError(f"{self.label} is closed")
        wait = self.health.delay()
        if wait > 0:
            raise BackendUnavailable(f"{self.health.last_error} (next try in {wait:.1f} s)")
        try:
            self.build(request)  # a request this backend cannot send fails here, in the caller
        except BackendError as exc:
            self._failed(exc)
            raise
        with self._lock:
            self.counters.requests += 1
        return HttpStream(self, request)

    def _settle(self, stream: HttpStream, reason: str, error: BackendError | None) -> None:
        with self._lock:
            n = int(stream.stats.get("new_tokens", 0))
            self.counters.tokens += n
            if reason == "cancelled":
                self.counters.cancelled += 1
                if not stream._kept:
                    self.counters.wasted_tokens += n
            if error is not None:
                self.counters.failed += 1
        if error is not None:
            self._failed(error)
        elif reason != "cancelled" and self.health.succeeded() and self.on_health is not None:
            self.on_health(True, f"{self.label} answers again")

    def _failed(self, error: BackendError) -> None:
        if self.health.failed(str(error)) and self.on_health is not None:
            self.on_health(False, str(error))

    def status(self) -> dict:
        return {
            "kind": self.kind,
            "name": self.name,
            "url": self.url,
            "model": self.model,
            "health": self.health.as_dict(),
            **self.counters.as_dict(),
        }

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            asyncio.run_coroutine_threadsafe(self.client.aclose(), self._loop).result(timeout=5)
        except Exception:
            pass

        async def stop() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self._loop.shutdown_asyncgens()

        try:
            asyncio.run_coroutine_threadsafe(stop(), self._loop).result(timeout=5)
        except Exception:
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._loop.close()
