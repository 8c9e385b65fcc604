"""The engine service's client for callers that live in threads (the language server's engine
thread), with no event loop: the calling thread writes its requests, the socket's reading
thread feeds its :class:`SyncGeneration` objects, which iterate, cancel and report like the
in-process ``engine.Generation``.  What it shares with the asyncio client is in
``client_core``.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from websockets.exceptions import ConnectionClosed, InvalidStatus, WebSocketException
from websockets.sync.client import connect as sync_connect

from ..params import GenerationParams
from . import protocol as P
from .client_core import (
    DIRECT_OPEN_S,
    DISCONNECTED,
    OPEN_TIMEOUT_S,
    Dispatch,
    EngineRequestError,
    EngineUnavailable,
    PromptDeltas,
    Received,
    direct_target,
    on_this_machine,
    open_flags,
    refused,
    ssl_for,
    unreachable,
)
from .direct import DirectClientConnection
from .model_files import Receiver

log = logging.getLogger(__name__)


class SyncGeneration(Received):
    """A generation of a :class:`SyncEngineClient`, shaped like ``engine.Generation``: iterate
    for chunks (``token_id``, ``text``), ``cancel()`` from any thread, then read ``text``,
    ``tokens``, ``finish_reason``, ``stats``.  ``successor`` is set when a steer stopped it.

    The client's reading thread appends each piece to this object's queue, which the consuming
    thread reads: one hand-over between the socket and the consumer."""

    successor: SyncGeneration | None

    def __init__(self, owner: SyncEngineClient, gid: str) -> None:
        super().__init__()
        self._owner = owner
        self._id = gid
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._cancelled = False
        self._consumed = False  # the consumer has read the end
        self._callbacks: list[Callable[[], None]] | None = []  # None once it has ended
        self._callbacks_lock = threading.Lock()

    def on_done(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` when the generation ends (now, if it has): on the client's reading
        thread, or the thread that closes the client."""
        with self._callbacks_lock:
            if self._callbacks is not None:
                self._callbacks.append(fn)
                return
        fn()

    # -- fed by the client's reading thread ------------------------------------------------------
    def _piece(self, text: str, ids: list[int]) -> None:
        self._queue.put(_Chunk(ids[-1] if ids else -1, text))

    def _ended(self) -> None:
        self._queue.put(None)
        with self._callbacks_lock:
            callbacks, self._callbacks = self._callbacks or [], None
        for fn in callbacks:
            try:
                fn()
            except Exception:  # a callback's failure must not stop the reading thread
                log.exception("a generation's done callback failed")

    # -- the consumer's side ---------------------------------------------------------------------
    def __iter__(self) -> Iterator[_Chunk]:
        while True:
            item = self._queue.get()
            if item is None:
                self._consumed = True
                return
            yield item

    def poll(self, timeout: float) -> _Chunk | None:
        """The next chunk, or None when none arrived within ``timeout`` s; StopIteration at the end
        (for a consumer that serves other work between chunks)."""
        if self._consumed:
            raise StopIteration
        try:
            item = self._queue.get(timeout=timeout)
        except queue.Empty:
            return None
        if item is None:
            self._consumed = True
            raise StopIteration
        return item

    def result(self) -> str:
        for _ in self:
            pass
        return self.text

    def cancel(self) -> None:
        """Ask the service to stop it (from any thread: the message leaves from this one). With
        a shared cancel flag the engine stops as soon as the flag is set; the message follows."""
        self._cancelled = True
        if self.finish_reason is None:
            self._owner._trip(self)
            self._owner._send_quietly({"type": "cancel", "id": self._id})

    def steer(self, text: str, timeout: float | None = None) -> dict[str, Any]:
        """Send typed ``text``; returns the committed (or failed) ``steer`` event."""
        return self.steer_nowait(text).result(timeout)

    def steer_nowait(self, text: str) -> concurrent.futures.Future:
        """Send a steer from any thread; the future holds its committed (or failed) event."""
        return self._owner._steer(self._id, text)

    @property
    def id(self) -> str:
        return self._id

    @property
    def cancelled(self) -> bool:
        return self._cancelled or self.finish_reason == "cancelled"


@dataclass(frozen=True, slots=True)
class _Chunk:
    token_id: int
    text: str


class SyncEngineClient(Dispatch):
    """One connection to an engine service for callers in ordinary threads (the language
    server's engine thread), without an event loop: a request, a cancel or a steer is written
    by the thread that makes it, and the socket's reading thread hands each message to its
    generation (``engine.service.direct``).  ``cafile`` and ``pinned_cert``: as
    ``EngineClient.connect``'s."""

    _generation = SyncGeneration

    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        client: str = "spark-lsp",
        open_timeout: float = OPEN_TIMEOUT_S,
        origin: str | None = None,
        prompt_deltas: bool = True,
        cafile: str | None = None,
        pinned_cert: str | None = None,
        cancel_flags: bool = True,
    ) -> None:
        """``cancel_flags``: on a daemon of this machine, cancel through flags shared in memory
        (``engine.service.cancel_flags``) as well as by message."""
        self.url = url
        self._lock = threading.Lock()  # the state below (taken by the reading thread too)
        self._send_lock = threading.Lock()  # generate messages leave in the order they are built
        self._gens: dict[str, SyncGeneration] = {}
        self._steers: dict[str, concurrent.futures.Future] = {}
        self._replies: dict[str, concurrent.futures.Future] = {}
        self._receiving: dict[str, Receiver] = {}
        self._ids = itertools.count(1)
        self._deltas = PromptDeltas(0)
        self.closed = False
        self.close_reason = ""
        self.last_error: EngineRequestError | None = None  # the last error no request claimed
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        ssl_context = ssl_for(url, cafile, pinned_cert)
        try:
            self.ws = sync_connect(
                url,
                ssl=ssl_context,
                additional_headers=headers,
                open_timeout=open_timeout,
                **P.SOCKET_OPTIONS,
                origin=origin,
                proxy=None,
                create_connection=DirectClientConnection,
                legacy=True,  # the connection itself (this client closes it)
            )
        except InvalidStatus as e:
            raise refused(url, e) from None
        except (OSError, WebSocketException, TimeoutError) as e:
            raise unreachable(url, e) from None
        self._hello: concurrent.futures.Future = concurrent.futures.Future()
        self.ws.attach(self._on_raw, self._on_close)
        hello = {"type": "hello", "protocol": list(P.SUPPORTED_VERSIONS), "client": client}
        if cancel_flags and on_this_machine(url):
            hello["cancel_flags"] = True
        try:
            self.ws.send(P.encode(hello))
            reply = self._hello.result(open_timeout)
        except (ConnectionClosed, concurrent.futures.TimeoutError, EngineUnavailable) as e:
            self.ws.close()
            raise EngineUnavailable(f"engine service at {url}: no handshake ({e})") from None
        if reply.get("type") != "hello":
            self.ws.close()
            raise EngineUnavailable(
                f"engine service at {url}: {reply.get('code')}: {reply.get('message')}"
            )
        self.hello = reply
        self.models: list[dict[str, Any]] = reply.get("models", [])
        memory = reply.get("capabilities", {}).get("prompt_delta", 0)
        self._deltas = PromptDeltas(int(memory) if prompt_deltas and isinstance(memory, int) else 0)
        self._flags = open_flags(reply.get("capabilities", {}).get("cancel_flags"))

    @classmethod
    def open(
        cls, url: str, token: str | None = None, *, direct: bool = True, **options: Any
    ) -> SyncEngineClient:
        """Connect to ``url`` (``options``: the constructor's) and, where the service offers an
        endpoint of its own (``direct_target``), move there (same token and trust); stay if it
        cannot be reached."""
        first = cls(url, token, **options)
        target = direct_target(url, first.hello) if direct else None
        if target is None:
            return first
        try:
            wait = min(options.get("open_timeout", OPEN_TIMEOUT_S), DIRECT_OPEN_S)
            moved = cls(target, token, **{**options, "open_timeout": wait})
        except EngineUnavailable as e:
            log.warning("engine service: staying on %s, its direct endpoint failed (%s)", url, e)
            return first
        first.close()
        return moved

    def generate(
        self,
        prompt: str | Sequence[int],
        params: GenerationParams | None = None,
        slot: Any = None,
        model: str | None = None,
    ) -> SyncGeneration:
        """Start a generation; the request leaves from this thread before it returns.
        EngineUnavailable when the connection is known lost (a loss while sending ends the
        generation with finish_reason ``error``, code ``disconnected``)."""
        msg: dict[str, Any] = {
            "type": "generate",
            "prompt": prompt if isinstance(prompt, str) else list(map(int, prompt)),
        }
        if params is not None:
            msg["params"] = P.params_to_json(params)
        if slot is not None:
            msg["slot"] = str(slot)
        if model is not None:
            msg["model"] = model
        with self._send_lock:
            with self._lock:
                if self.closed:
                    raise EngineUnavailable(
                        f"the engine connection is closed ({self.close_reason or 'closed'})"
                    )
                gid = f"g{next(self._ids)}"
                msg["id"] = gid
                gen = self._gens[gid] = SyncGeneration(self, gid)
                flag = self._flags.arm() if self._flags is not None else None
                if flag is not None:
                    msg["cancel_flag"] = gen._flag = flag
                wire = self._deltas.wire(gid, msg)
            self._send_quietly(wire)
        return gen

    def status(self, timeout: float = 10.0) -> dict[str, Any]:
        rid = f"s{next(self._ids)}"
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._replies[rid] = fut
        self._send_quietly({"type": "status", "id": rid})
        return fut.result(timeout)

    def model_files(
        self, model: str | None = None, timeout: float = 120.0
    ) -> tuple[dict[str, Any], dict[str, str]]:
        """A served model's prompt files (``engine.service.model_files``): (the closing
        ``model_files`` message, the files by name).  EngineRequestError when the service
        refuses, ModelFilesError when what it sent cannot be taken."""
        rid = f"f{next(self._ids)}"
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._replies[rid] = fut
            self._receiving[rid] = Receiver()
        msg: dict[str, Any] = {"type": "model_files", "id": rid}
        if model is not None:
            msg["model"] = model
        self._send_quietly(msg)
        return fut.result(timeout)

    def close(self) -> None:
        with self._lock:
            if not self.closed:
                self.closed = True
                self.close_reason = "the client closed the connection"
        self.ws.close()
        self._fail_all("the client closed the connection")
        with self._lock:
            flags, self._flags = self._flags, None
        if flags is not None:
            flags.close()

    def _trip(self, gen: SyncGeneration) -> None:
        """Set ``gen``'s shared cancel flag (under the lock that frees flags: never another's),
        unless a steer of it is still unread by the server: the flag would overtake it, and the
        cancel must come after it, as its message does."""
        with self._lock:
            if (
                gen._flag is not None
                and gen.finish_reason is None
                and not gen._unread_steers
                and self._flags is not None
            ):
                self._flags.trip(gen._flag)

    # -- internals ------------------------------------------------------------------------------
    def _send_quietly(self, msg: dict[str, Any]) -> None:
        """Send from the calling thread; a lost connection ends every generation instead."""
        try:
            self.ws.send(P.encode(msg))
        except (ConnectionClosed, OSError) as e:
            self._lost(f"the engine connection was lost: {e}")

    def _steer(self, gid: str, text: str) -> concurrent.futures.Future:
        sid = f"t{next(self._ids)}"
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self.closed:
                fut.set_exception(EngineUnavailable(self.close_reason or "closed"))
                return fut
            self._steers[sid] = fut
            gen = self._gens.get(gid)
            if gen is not None:
                gen._unread_steers.add(sid)
        self._send_quietly({"type": "steer", "id": gid, "text": text, "steer": sid})
        return fut

    def _on_close(self) -> None:
        self._lost("the engine service closed the connection")

    def _lost(self, reason: str) -> None:
        with self._lock:
            if not self.closed:
                self.closed = True
                self.close_reason = reason
            reason = self.close_reason
        if not self._hello.done():
            try:
                self._hello.set_exception(EngineUnavailable(reason))
            except concurrent.futures.InvalidStateError:  # the reply came just now
                pass
        self._fail_all(reason)

    def _fail_all(self, reason: str) -> None:
        err = {"code": DISCONNECTED, "message": reason}
        with self._lock:
            gens = list(self._gens.values())
            futs = [*self._steers.values(), *self._replies.values()]
            self._gens.clear()
            self._steers.clear()
            self._replies.clear()
            self._receiving.clear()
            self._deltas.clear()
        for gen in gens:
            gen._finish("error", {}, err)
        for fut in futs:
            if not fut.done():
                fut.set_exception(EngineUnavailable(reason))

    def _on_raw(self, raw: bytes) -> None:
        """A message from the service (on the socket's reading thread)."""
        try:
            msg = P.decode(raw)
        except P.ProtocolError as e:
            self._lost(f"the engine service sent a bad message: {e}")
            self.ws.close()
            return
        if not self._hello.done():
            try:
                self._hello.set_result(msg)
            except concurrent.futures.InvalidStateError:  # the connection was lost just now
                pass
            return
        resend = None
        with self._lock:
            resend = self._apply(msg)
        if resend is not None:
            self._send_quietly(resend)
