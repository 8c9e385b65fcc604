"""A client of the engine service: one WebSocket, many generations multiplexed on it.

:class:`EngineClient` is the asyncio client.  :class:`SyncEngineClient` runs one in a background
event loop for callers that live in threads (it returns :class:`SyncGeneration` objects that
iterate, cancel and report like the in-process ``engine.Generation``).

A lost connection ends every generation in flight with finish_reason ``error`` (error code
``disconnected``) and makes later calls raise :class:`EngineUnavailable`; reconnecting is the
caller's decision.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus, WebSocketException

from ..params import GenerationParams
from . import protocol as P

DISCONNECTED = "disconnected"


class EngineUnavailable(ConnectionError):
    """The engine service cannot be reached (or refused us: wrong token, origin, version)."""


class EngineRequestError(RuntimeError):
    """The service answered a request with an ``error`` message."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


@dataclass(frozen=True, slots=True)
class Piece:
    """One ``tokens`` message: the text and the token ids it carried."""

    text: str
    ids: list[int]


class RemoteGeneration:
    """A generation running in the service: ``async for piece in gen``, then ``text``,
    ``tokens``, ``finish_reason``, ``stats``.  ``successor`` is set when a steer stopped it."""

    def __init__(self, client: EngineClient, gid: str) -> None:
        self.client = client
        self.id = gid
        self.text = ""
        self.tokens: list[int] = []
        self.finish_reason: str | None = None
        self.stats: dict[str, Any] = {}
        self.error: dict[str, str] | None = None
        self.successor: RemoteGeneration | None = None
        self._events: asyncio.Queue[Piece | None] = asyncio.Queue()
        self._done = asyncio.Event()

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    async def __aiter__(self) -> AsyncIterator[Piece]:
        while True:
            item = await self._events.get()
            if item is None:
                return
            yield item

    async def wait(self) -> RemoteGeneration:
        await self._done.wait()
        return self

    async def result(self) -> str:
        await self.wait()
        return self.text

    async def cancel(self) -> None:
        """Ask the service to stop (it does within one decode step); ``done`` follows."""
        if not self.done:
            await self.client._send({"type": "cancel", "id": self.id})

    async def steer(self, text: str) -> dict[str, Any]:
        """Send typed ``text``; returns the committed (or failed) ``steer`` event."""
        return await self.client._steer(self.id, text)

    # -- fed by the client's reader -------------------------------------------------------------
    def _push(self, text: str, ids: list[int]) -> None:
        self.text += text
        self.tokens.extend(ids)
        self._events.put_nowait(Piece(text, ids))

    def _finish(
        self, reason: str, stats: dict[str, Any], error: dict[str, str] | None = None
    ) -> None:
        if self.finish_reason is not None:
            return
        self.finish_reason = reason
        self.stats = stats
        self.error = error
        self._events.put_nowait(None)
        self._done.set()


class EngineClient:
    """One connection to an engine service; ``hello`` holds the server's handshake reply."""

    def __init__(self, ws: ClientConnection, hello: dict[str, Any]) -> None:
        self.ws = ws
        self.hello = hello
        self.models: list[dict[str, Any]] = hello.get("models", [])
        self._gens: dict[str, RemoteGeneration] = {}
        self._steers: dict[str, asyncio.Future] = {}
        self._replies: dict[str, asyncio.Future] = {}
        self._ids = itertools.count(1)
        self.closed = False
        self.close_reason = ""
        self.last_error: EngineRequestError | None = None  # the last error no request claimed
        self._reader = asyncio.ensure_future(self._read())

    @classmethod
    async def connect(
        cls,
        url: str,
        token: str | None = None,
        *,
        client: str = "spark-lsp",
        open_timeout: float = 10.0,
        origin: str | None = None,
    ) -> EngineClient:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        try:
            ws = await connect(
                url,
                additional_headers=headers,
                open_timeout=open_timeout,
                compression=None,
                max_size=P.MAX_FRAME_BYTES,
                origin=origin,
                ping_interval=20,
                ping_timeout=60,
                proxy=None,
            )
        except InvalidStatus as e:
            code = e.response.status_code
            why = {401: "wrong or missing token", 403: "origin refused"}.get(code, "refused")
            raise EngineUnavailable(
                f"engine service at {url} refused the connection: HTTP {code} ({why})"
            ) from None
        except (OSError, WebSocketException, asyncio.TimeoutError) as e:
            raise EngineUnavailable(f"cannot reach the engine service at {url}: {e}") from None
        try:
            await ws.send(
                P.encode(
                    {"type": "hello", "protocol": list(P.SUPPORTED_VERSIONS), "client": client}
                )
            )
            reply = P.decode(await asyncio.wait_for(ws.recv(), open_timeout))
        except (ConnectionClosed, asyncio.TimeoutError, P.ProtocolError) as e:
            await ws.close()
            raise EngineUnavailable(f"engine service at {url}: no handshake ({e})") from None
        if reply.get("type") != "hello":
            await ws.close()
            raise EngineUnavailable(
                f"engine service at {url}: {reply.get('code')}: {reply.get('message')}"
            )
        return cls(ws, reply)

    def model(self, name: str | None = None) -> dict[str, Any]:
        """The ``hello`` entry of a model (the default, first one, when ``name`` is None)."""
        for m in self.models:
            if name is None or m.get("name") == name:
                return m
        raise KeyError(name)

    async def generate(
        self,
        prompt: str | Sequence[int],
        params: GenerationParams | None = None,
        *,
        slot: str | None = None,
        model: str | None = None,
        id: str | None = None,
    ) -> RemoteGeneration:
        gid = id or f"g{next(self._ids)}"
        gen = RemoteGeneration(self, gid)
        self._gens[gid] = gen
        msg: dict[str, Any] = {
            "type": "generate",
            "id": gid,
            "prompt": prompt if isinstance(prompt, str) else [int(t) for t in prompt],
        }
        if params is not None:
            msg["params"] = P.params_to_json(params)
        if slot is not None:
            msg["slot"] = slot
        if model is not None:
            msg["model"] = model
        try:
            await self._send(msg)
        except EngineUnavailable:
            self._gens.pop(gid, None)
            raise
        return gen

    async def status(self) -> dict[str, Any]:
        rid = f"s{next(self._ids)}"
        fut = asyncio.get_running_loop().create_future()
        self._replies[rid] = fut
        await self._send({"type": "status", "id": rid})
        return await fut

    async def send_raw(self, data: str | bytes) -> None:
        """Send a frame as is (protocol tests)."""
        await self.ws.send(data)

    async def close(self) -> None:
        self.closed = True
        await self.ws.close()
        self._reader.cancel()
        try:
            await self._reader
        except (asyncio.CancelledError, Exception):
            pass
        self._fail_all("the client closed the connection")

    # -- internals ------------------------------------------------------------------------------
    async def _send(self, msg: dict[str, Any]) -> None:
        if self.closed:
            raise EngineUnavailable(
                f"the engine connection is closed ({self.close_reason or 'closed'})"
            )
        try:
            await self.ws.send(P.encode(msg))
        except ConnectionClosed as e:
            self._lost(str(e))
            raise EngineUnavailable(f"the engine connection was lost: {e}") from None

    async def _steer(self, gid: str, text: str) -> dict[str, Any]:
        sid = f"t{next(self._ids)}"
        fut = asyncio.get_running_loop().create_future()
        self._steers[sid] = fut
        await self._send({"type": "steer", "id": gid, "text": text, "steer": sid})
        return await fut

    async def _read(self) -> None:
        reason = "the engine service closed the connection"
        try:
            async for raw in self.ws:
                self._on_message(P.decode(raw))
        except ConnectionClosed as e:
            reason = f"the engine connection was lost: {e}"
        except P.ProtocolError as e:
            reason = f"the engine service sent a bad message: {e}"
            await self.ws.close()
        self._lost(reason)

    def _lost(self, reason: str) -> None:
        if not self.closed:
            self.closed = True
            self.close_reason = reason
        self._fail_all(reason)

    def _fail_all(self, reason: str) -> None:
        err = {"code": DISCONNECTED, "message": reason}
        for gen in list(self._gens.values()):
            gen._finish("error", {}, err)
        self._gens.clear()
        for fut in [*self._steers.values(), *self._replies.values()]:
            if not fut.done():
                fut.set_exception(EngineUnavailable(reason))
        self._steers.clear()
        self._replies.clear()

    def _on_message(self, msg: dict[str, Any]) -> None:
        kind = msg.get("type")
        gid = msg.get("id")
        if kind == "tokens":
            gen = self._gens.get(gid)
            if gen is not None:
                gen._push(msg.get("text", ""), list(msg.get("ids", ())))
        elif kind == "done":
            gen = self._gens.pop(gid, None)
            if gen is not None:
                succ = msg.get("successor")
                if succ is not None and gen.successor is None:
                    gen.successor = self._gens.get(succ)
                gen._finish(
                    msg.get("finish_reason", "error"), msg.get("stats", {}), msg.get("error")
                )
        elif kind == "steer":
            if msg.get("state") == P.COMMITTED and msg.get("outcome") == P.STOPPED:
                succ = msg.get("successor")
                gen = self._gens.get(gid)
                if succ and succ not in self._gens:
                    self._gens[succ] = RemoteGeneration(self, succ)
                if gen is not None and succ:
                    gen.successor = self._gens[succ]
            if msg.get("state") in (P.COMMITTED, P.FAILED):
                fut = self._steers.pop(msg.get("steer"), None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
        elif kind == "status":
            fut = self._replies.pop(msg.get("id"), None)
            if fut is not None and not fut.done():
                fut.set_result(msg)
        elif kind == "error":
            err = EngineRequestError(msg.get("code", "error"), msg.get("message", ""))
            gen = self._gens.pop(gid, None) if gid else None
            if gen is not None:
                gen._finish("error", {}, {"code": err.code, "message": err.message})
            fut = self._replies.pop(gid, None) if gid else None
            if fut is not None and not fut.done():
                fut.set_exception(err)
            if gen is None and fut is None:
                self.last_error = err


class SyncGeneration:
    """A thread-side view of a :class:`RemoteGeneration`, shaped like ``engine.Generation``:
    iterate for chunks (``token_id``, ``text``), ``cancel()`` from any thread, then read
    ``text``, ``tokens``, ``finish_reason``, ``stats``."""

    def __init__(self, owner: SyncEngineClient, remote: RemoteGeneration) -> None:
        self._owner = owner
        self._remote = remote
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._cancelled = False
        self._ended = False
        self._successor: SyncGeneration | None = None
        owner._submit(self._pump())

    async def _pump(self) -> None:
        async for piece in self._remote:
            tid = piece.ids[-1] if piece.ids else -1
            self._queue.put(_Chunk(tid, piece.text))
        self._queue.put(None)

    def __iter__(self) -> Iterator[_Chunk]:
        while True:
            item = self._queue.get()
            if item is None:
                self._ended = True
                return
            yield item

    def poll(self, timeout: float) -> _Chunk | None:
        """The next chunk, or None when none arrived within ``timeout`` s; StopIteration at the end
        (for a consumer that serves other work between chunks)."""
        if self._ended:
            raise StopIteration
        try:
            item = self._queue.get(timeout=timeout)
        except queue.Empty:
            return None
        if item is None:
            self._ended = True
            raise StopIteration
        return item

    def result(self) -> str:
        for _ in self:
            pass
        return self.text

    def cancel(self) -> None:
        self._cancelled = True
        self._owner._submit(self._remote.cancel())

    def steer(self, text: str, timeout: float | None = None) -> dict[str, Any]:
        return self._owner._call(self._remote.steer(text), timeout)

    @property
    def id(self) -> str:
        return self._remote.id

    @property
    def cancelled(self) -> bool:
        return self._cancelled or self._remote.finish_reason == "cancelled"

    @property
    def done(self) -> bool:
        return self._remote.done

    @property
    def text(self) -> str:
        return self._remote.text

    @property
    def tokens(self) -> list[int]:
        return self._remote.tokens

    @property
    def finish_reason(self) -> str | None:
        return self._remote.finish_reason

    @property
    def stats(self) -> dict[str, Any]:
        return self._remote.stats

    @property
    def error(self) -> dict[str, str] | None:
        return self._remote.error

    @property
    def successor(self) -> SyncGeneration | None:
        if self._successor is None and self._remote.successor is not None:
            self._successor = SyncGeneration(self._owner, self._remote.successor)
        return self._successor


@dataclass(frozen=True, slots=True)
class _Chunk:
    token_id: int
    text: str


class SyncEngineClient:
    """An :class:`EngineClient` on its own event-loop thread, for callers in ordinary threads."""

    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        client: str = "spark-lsp",
        open_timeout: float = 10.0,
    ) -> None:
        self.url = url
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="spark-engine-client", daemon=True
        )
        self._thread.start()
        try:
            self.client: EngineClient = self._call(
                EngineClient.connect(url, token, client=client, open_timeout=open_timeout), None
            )
        except BaseException:
            self._stop_loop()
            raise

    @property
    def hello(self) -> dict[str, Any]:
        return self.client.hello

    @property
    def closed(self) -> bool:
        return self.client.closed

    @property
    def close_reason(self) -> str:
        return self.client.close_reason

    def generate(
        self,
        prompt: str | Sequence[int],
        params: GenerationParams | None = None,
        slot: Any = None,
        model: str | None = None,
    ) -> SyncGeneration:
        remote = self._call(
            self.client.generate(
                prompt, params, slot=None if slot is None else str(slot), model=model
            ),
            30.0,
        )
        return SyncGeneration(self, remote)

    def status(self, timeout: float = 10.0) -> dict[str, Any]:
        return self._call(self.client.status(), timeout)

    def close(self) -> None:
        if self._loop.is_closed():
            return
        try:
            self._call(self.client.close(), 5.0)
        except Exception:
            pass
        self._stop_loop()

    # -- internals ------------------------------------------------------------------------------
    def _submit(self, coro) -> asyncio.Future:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _call(self, coro, timeout: float | None):
        return self._submit(coro).result(timeout)

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5.0)
        if not self._thread.is_alive():
            self._loop.close()
