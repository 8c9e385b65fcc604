"""A client of the engine service: one WebSocket, many generations multiplexed on it.

:class:`EngineClient` is the asyncio client.  :class:`SyncEngineClient` runs one in a background
event loop for callers that live in threads (it returns :class:`SyncGeneration` objects that
iterate, cancel and report like the in-process ``engine.Generation``).

A lost connection ends every generation in flight with finish_reason ``error`` (error code
``disconnected``) and makes later calls raise :class:`EngineUnavailable`; reconnecting is the
caller's decision.

Prompt deltas: when the server keeps prompts (``hello`` capability ``prompt_delta``), a token-id
prompt on a slot is sent as an edit of the previous prompt this client sent on that slot (the
common head and tail are named, not sent), so a keystroke's request carries a few ids instead of
the whole context; a base the server no longer holds is answered ``unknown_base`` and the client
sends the whole prompt again under the same id.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import queue
import threading
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
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
        self._listener: Callable[[Piece | None], None] | None = None
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

    def listen(self, fn: Callable[[Piece | None], None]) -> None:
        """Hand every piece (then None at the end) to ``fn`` instead of the async iterator, from
        the reader (call on the event loop; pieces already received are handed over first)."""
        while not self._events.empty():
            fn(self._events.get_nowait())
        self._listener = fn

    # -- fed by the client's reader -------------------------------------------------------------
    def _emit(self, item: Piece | None) -> None:
        if self._listener is not None:
            self._listener(item)
        else:
            self._events.put_nowait(item)

    def _push(self, text: str, ids: list[int]) -> None:
        self.text += text
        self.tokens.extend(ids)
        self._emit(Piece(text, ids))

    def _finish(
        self, reason: str, stats: dict[str, Any], error: dict[str, str] | None = None
    ) -> None:
        if self.finish_reason is not None:
            return
        self.finish_reason = reason
        self.stats = stats
        self.error = error
        self._emit(None)
        self._done.set()


class EngineClient:
    """One connection to an engine service; ``hello`` holds the server's handshake reply."""

    def __init__(
        self, ws: ClientConnection, hello: dict[str, Any], *, prompt_deltas: bool = True
    ) -> None:
        self.ws = ws
        self.hello = hello
        self.models: list[dict[str, Any]] = hello.get("models", [])
        memory = hello.get("capabilities", {}).get("prompt_delta", 0)
        #: how many slots' last prompts are kept as delta bases (0: the server takes none)
        self.delta_slots = int(memory) if prompt_deltas and isinstance(memory, int) else 0
        self._bases: OrderedDict[str, tuple[str, list[int]]] = OrderedDict()  # slot -> id, ids
        self._whole: dict[str, dict[str, Any]] = {}  # id -> its generate with the whole prompt
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
        prompt_deltas: bool = True,
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
        return cls(ws, reply, prompt_deltas=prompt_deltas)

    def new_id(self) -> str:
        """A generation id unused on this connection (callable from any thread)."""
        return f"g{next(self._ids)}"

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
        gen = self.start(prompt, params, slot=slot, model=model, id=id)
        try:
            await self._send(self._wire(gen.id, self._whole.get(gen.id)))
        except EngineUnavailable:
            self._gens.pop(gen.id, None)
            self._whole.pop(gen.id, None)
            raise
        return gen

    def start(
        self,
        prompt: str | Sequence[int],
        params: GenerationParams | None = None,
        *,
        slot: str | None = None,
        model: str | None = None,
        id: str | None = None,
        listener: Callable[[Piece | None], None] | None = None,
    ) -> RemoteGeneration:
        """Register a generation and build its ``generate`` message (sent by ``generate``, or by
        ``send_generate`` for callers that must not wait for the socket)."""
        if self.closed:
            raise EngineUnavailable(
                f"the engine connection is closed ({self.close_reason or 'closed'})"
            )
        gid = id or self.new_id()
        gen = RemoteGeneration(self, gid)
        if listener is not None:
            gen.listen(listener)
        self._gens[gid] = gen
        msg: dict[str, Any] = {
            "type": "generate",
            "id": gid,
            "prompt": prompt if isinstance(prompt, str) else list(map(int, prompt)),
        }
        if params is not None:
            msg["params"] = P.params_to_json(params)
        if slot is not None:
            msg["slot"] = slot
        if model is not None:
            msg["model"] = model
        self._whole[gid] = msg
        return gen

    def send_generate(self, gen: RemoteGeneration) -> asyncio.Future:
        """Send a ``start``ed generation without waiting (a lost connection ends it)."""
        return asyncio.ensure_future(
            self._send_quietly(self._wire(gen.id, self._whole.get(gen.id)))
        )

    async def _send_quietly(self, msg: dict[str, Any]) -> None:
        try:
            await self._send(msg)
        except EngineUnavailable:  # _send ended every generation (this one too)
            pass

    def _wire(self, gid: str, msg: dict[str, Any] | None) -> dict[str, Any]:
        """The message to send for ``msg``: its prompt as a delta of the slot's last prompt when
        that saves sending most of it.  Records the prompt as the slot's next base."""
        if msg is None:
            raise EngineUnavailable("the generation was ended before it was sent")
        prompt, slot = msg["prompt"], msg.get("slot")
        if not self.delta_slots or slot is None or isinstance(prompt, str):
            self._whole.pop(gid, None)
            return msg
        base = self._bases.pop(slot, None)
        self._bases[slot] = (gid, prompt)
        while len(self._bases) > self.delta_slots:
            self._bases.popitem(last=False)
        if base is None:
            self._whole.pop(gid, None)
            return msg
        head, middle, tail = P.prompt_delta(base[1], prompt)
        if len(middle) * 2 > len(prompt):  # mostly new: the whole prompt is as short
            self._whole.pop(gid, None)
            return msg
        delta = {"base": base[0], "head": head, "ids": middle, "tail": tail}
        return {**msg, "prompt": delta}  # _whole keeps msg until the server accepts the delta

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
        self._whole.clear()
        for fut in [*self._steers.values(), *self._replies.values()]:
            if not fut.done():
                fut.set_exception(EngineUnavailable(reason))
        self._steers.clear()
        self._replies.clear()

    def _on_message(self, msg: dict[str, Any]) -> None:
        kind = msg.get("type")
        gid = msg.get("id")
        if kind == "tokens":
            self._whole.pop(gid, None)
            gen = self._gens.get(gid)
            if gen is not None:
                gen._push(msg.get("text", ""), list(msg.get("ids", ())))
        elif kind == "done":
            self._whole.pop(gid, None)
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
            whole = self._whole.pop(gid, None) if gid else None
            if msg.get("code") == P.UNKNOWN_BASE and whole is not None and gid in self._gens:
                asyncio.ensure_future(self._send_quietly(whole))  # the server forgot the base
                return
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
    ``text``, ``tokens``, ``finish_reason``, ``stats``.

    The client's reader hands each piece straight to this object's queue (no task between the
    socket and the consuming thread); the remote generation is attached on the event loop before
    its first piece can arrive."""

    def __init__(
        self, owner: SyncEngineClient, gid: str, remote: RemoteGeneration | None = None
    ) -> None:
        self._owner = owner
        self._id = gid
        self._remote = remote
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._cancelled = False
        self._ended = False
        self._successor: SyncGeneration | None = None
        if remote is not None:  # a steer successor: pieces may have arrived already
            owner._soon(remote.listen, self._on_piece)

    def _on_piece(self, piece: Piece | None) -> None:
        """From the client's reader (event loop thread)."""
        if piece is None:
            self._queue.put(None)
        else:
            self._queue.put(_Chunk(piece.ids[-1] if piece.ids else -1, piece.text))

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
        """Ask the service to stop it (from any thread; the message is sent by the event loop)."""
        self._cancelled = True
        self._owner._soon(self._send_cancel)

    def _send_cancel(self) -> None:
        if self._remote is not None and not self._remote.done:
            client = self._owner.client
            asyncio.ensure_future(client._send_quietly({"type": "cancel", "id": self._id}))

    def steer(self, text: str, timeout: float | None = None) -> dict[str, Any]:
        return self._owner._call(self._steer(text), timeout)

    def steer_nowait(self, text: str) -> concurrent.futures.Future:
        """Send a steer from any thread; the future holds its committed (or failed) event."""
        return self._owner._submit(self._steer(text))

    async def _steer(self, text: str) -> dict[str, Any]:
        return await self._remote.steer(text)

    @property
    def id(self) -> str:
        return self._id

    @property
    def cancelled(self) -> bool:
        return self._cancelled or self.finish_reason == "cancelled"

    @property
    def done(self) -> bool:
        return self._remote is not None and self._remote.done

    @property
    def text(self) -> str:
        return self._remote.text if self._remote is not None else ""

    @property
    def tokens(self) -> list[int]:
        return self._remote.tokens if self._remote is not None else []

    @property
    def finish_reason(self) -> str | None:
        return self._remote.finish_reason if self._remote is not None else None

    @property
    def stats(self) -> dict[str, Any]:
        return self._remote.stats if self._remote is not None else {}

    @property
    def error(self) -> dict[str, str] | None:
        return self._remote.error if self._remote is not None else None

    @property
    def successor(self) -> SyncGeneration | None:
        remote = self._remote.successor if self._remote is not None else None
        if self._successor is None and remote is not None:
            self._successor = SyncGeneration(self._owner, remote.id, remote)
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
        """Start a generation; returns at once (the event loop sends it, the caller's thread
        never waits for the socket).  EngineUnavailable when the connection is known lost."""
        client = self.client
        if client.closed:
            raise EngineUnavailable(
                f"the engine connection is closed ({client.close_reason or 'closed'})"
            )
        sync = SyncGeneration(self, client.new_id())
        prompt = (
            prompt if isinstance(prompt, str) else list(prompt)
        )  # the caller may reuse its list
        slot = None if slot is None else str(slot)
        self._soon(self._start, sync, prompt, params, slot, model)
        return sync

    def _start(self, sync: SyncGeneration, prompt, params, slot, model) -> None:
        """On the event loop: register the generation, attach ``sync``, send without waiting."""
        client = self.client
        try:
            remote = client.start(
                prompt, params, slot=slot, model=model, id=sync.id, listener=sync._on_piece
            )
        except EngineUnavailable as exc:
            remote = RemoteGeneration(client, sync.id)
            remote.listen(sync._on_piece)
            remote._finish("error", {}, {"code": DISCONNECTED, "message": str(exc)})
        sync._remote = remote
        if not remote.done:
            client.send_generate(remote)

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

    def _soon(self, fn, *args) -> None:
        """Run ``fn(*args)`` on the event loop (nothing when the client is closed)."""
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed
            pass

    def _call(self, coro, timeout: float | None):
        return self._submit(coro).result(timeout)

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5.0)
        if not self._thread.is_alive():
            self._loop.close()
