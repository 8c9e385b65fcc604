"""A client of the engine service: one WebSocket, many generations multiplexed on it.

:class:`EngineClient` is the asyncio client.  :class:`SyncEngineClient` is the client of callers
that live in threads (the language server's engine thread), with no event loop: the calling
thread writes its requests, the socket's reading thread feeds its :class:`SyncGeneration`
objects, which iterate, cancel and report like the in-process ``engine.Generation``.

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
import logging
import queue
import threading
import urllib.parse
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import (
    ConnectionClosed,
    InvalidMessage,
    InvalidStatus,
    WebSocketException,
)
from websockets.sync.client import connect as sync_connect

from ..params import GenerationParams
from . import protocol as P
from . import tls
from .address import is_loopback
from .cancel_flags import CancelFlags
from .direct import DirectClientConnection

log = logging.getLogger(__name__)

DISCONNECTED = "disconnected"
#: Seconds a move to a service's direct endpoint may take to connect before the client stays
#: where it is (a firewalled port drops the connection attempt instead of refusing it).
DIRECT_OPEN_S = 3.0


class EngineUnavailable(ConnectionError):
    """The engine service cannot be reached (or refused us: wrong token, origin, version)."""


def _ssl_for(url: str, cafile: str | None, pinned: str | None = None) -> Any:
    """The client SSL context of a ``wss://`` URL (None for ``ws://``): ``pinned``, the one
    certificate to trust, else the trust store and ``cafile``.  A file that cannot be used is
    an EngineUnavailable that says why."""
    if not tls.is_secure(url):
        return None
    try:
        return tls.pinned_context(pinned) if pinned else tls.client_context(cafile)
    except tls.TLSConfigError as e:
        raise EngineUnavailable(f"cannot connect to the engine service at {url}: {e}") from None


def _on_this_machine(url: str) -> bool:
    host = urllib.parse.urlsplit(url).hostname
    return host is not None and is_loopback(host)


def _open_flags(offer: Any) -> CancelFlags | None:
    """The daemon's shared cancel flags from its ``hello`` offer (None: none offered, or they
    cannot be used: then cancels go by message only)."""
    if not isinstance(offer, dict):
        return None
    try:
        return CancelFlags.open(str(offer.get("path")), offer.get("count"))
    except (OSError, ValueError) as e:
        log.info("engine service: shared cancel flags not used: %s", e)
        return None


def _unreachable(url: str, exc: BaseException) -> EngineUnavailable:
    """The EngineUnavailable of a connection that failed with ``exc`` (a TLS failure says what
    failed and how to trust the server's certificate)."""
    why = tls.failure(url, exc)
    if why is None and isinstance(exc, InvalidMessage) and not tls.is_secure(url):
        why = (
            f"cannot reach the engine service at {url}: {exc} (if it serves TLS, use its "
            "wss:// URL)"
        )
    return EngineUnavailable(why or f"cannot reach the engine service at {url}: {exc}")


def direct_target(url: str, hello: dict[str, Any]) -> str | None:
    """The endpoint a service's ``hello`` offers instead of ``url`` (capability ``direct``: a Ray
    Serve ingress replica's own socket, which skips Serve's proxy), or None: none offered, the
    same, or not of ``url``'s scheme (a ``wss://`` service is never left for ``ws://``, which
    would send the token in the clear)."""
    target = hello.get("capabilities", {}).get("direct")
    if not isinstance(target, str) or target.rstrip("/") == url.rstrip("/"):
        return None
    here, there = urllib.parse.urlsplit(url).scheme, urllib.parse.urlsplit(target).scheme
    if there != here or there not in ("ws", "wss"):
        log.warning("engine service at %s offered %s: not followed (scheme)", url, target)
        return None
    return target


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


class _Received:
    """What the clients' dispatcher (:class:`_Dispatch`) records of one generation: ``text``,
    ``tokens``, ``finish_reason``, ``stats``, ``error`` and ``successor``.  Subclasses say how a
    piece (``_piece``) and the end (``_ended``) reach their consumer."""

    def __init__(self) -> None:
        self.text = ""
        self.tokens: list[int] = []
        self.finish_reason: str | None = None
        self.stats: dict[str, Any] = {}
        self.error: dict[str, str] | None = None
        self.successor: Any = None
        self._flag: int | None = None  # its shared cancel flag (SyncEngineClient), if any
        self._unread_steers: set[str] = set()  # steers sent that the server has not read yet

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def _push(self, text: str, ids: list[int]) -> None:
        self.text += text
        self.tokens.extend(ids)
        self._piece(text, ids)

    def _finish(
        self, reason: str, stats: dict[str, Any], error: dict[str, str] | None = None
    ) -> None:
        if self.finish_reason is not None:
            return
        self.stats = stats  # before finish_reason: another thread may read them once it is set
        self.error = error
        self.finish_reason = reason
        self._ended()

    def _piece(self, text: str, ids: list[int]) -> None:
        raise NotImplementedError

    def _ended(self) -> None:
        raise NotImplementedError


class RemoteGeneration(_Received):
    """A generation running in the service: ``async for piece in gen``, then ``text``,
    ``tokens``, ``finish_reason``, ``stats``.  ``successor`` is set when a steer stopped it."""

    successor: RemoteGeneration | None

    def __init__(self, client: EngineClient, gid: str) -> None:
        super().__init__()
        self.client = client
        self.id = gid
        self._events: asyncio.Queue[Piece | None] = asyncio.Queue()
        self._listener: Callable[[Piece | None], None] | None = None
        self._done = asyncio.Event()

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

    def _piece(self, text: str, ids: list[int]) -> None:
        self._emit(Piece(text, ids))

    def _ended(self) -> None:
        self._emit(None)
        self._done.set()


class _PromptDeltas:
    """Which prompt each slot last sent (the base of the next one's delta), and the whole
    ``generate`` of each request sent as a delta until the server accepts it (``unknown_base``:
    it is sent again whole).  ``slots``: how many slots' prompts the server keeps (0: none)."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self._bases: OrderedDict[str, tuple[str, list[int], bytes | None]] = OrderedDict()
        # slot -> id, ids, the ids packed (protocol.pack_ids)
        self._whole: dict[str, dict[str, Any]] = {}  # id -> its generate with the whole prompt

    def wire(self, gid: str, msg: dict[str, Any]) -> dict[str, Any]:
        """The message to send for ``msg``: its prompt as a delta of the slot's last prompt when
        that saves sending most of it.  Records the prompt as the slot's next base."""
        prompt, slot = msg["prompt"], msg.get("slot")
        if not self.slots or slot is None or isinstance(prompt, str):
            return msg
        base = self._bases.pop(slot, None)
        packed = P.pack_ids(prompt)
        self._bases[slot] = (gid, prompt, packed)
        while len(self._bases) > self.slots:
            self._bases.popitem(last=False)
        if base is None:
            return msg
        both = (base[2], packed) if base[2] is not None and packed is not None else None
        head, middle, tail = P.prompt_delta(base[1], prompt, both)
        if len(middle) * 2 > len(prompt):  # mostly new: the whole prompt is as short
            return msg
        self._whole[gid] = msg
        return {**msg, "prompt": {"base": base[0], "head": head, "ids": middle, "tail": tail}}

    def accepted(self, gid: str | None) -> dict[str, Any] | None:
        """The server answered ``gid``: forget (and return) its whole message."""
        return self._whole.pop(gid, None) if gid is not None else None

    def clear(self) -> None:
        self._whole.clear()


class _Dispatch:
    """The client side of the protocol's server messages, for :class:`EngineClient` (asyncio)
    and :class:`SyncEngineClient` (threads): what each message does to the generations
    (``_gens``), steers (``_steers``) and replies (``_replies``) the client waits on."""

    _generation: Any  # the generation class the client makes for a steer's successor
    _gens: dict[str, Any]
    _steers: dict[str, Any]
    _replies: dict[str, Any]
    _deltas: _PromptDeltas
    last_error: Exception | None
    _flags: CancelFlags | None = None

    def _ended_flag(self, gen: Any) -> None:
        """``gen`` has ended: its shared cancel flag goes to its steer successor (the daemon
        stops the successor by the same flag), or is free again."""
        i, gen._flag = gen._flag, None
        if i is None or self._flags is None:
            return
        if gen.successor is not None and gen.successor._flag is None:
            gen.successor._flag = i
        else:
            self._flags.release(i)

    def _apply(self, msg: dict[str, Any]) -> dict[str, Any] | None:
        """Apply one server message to the generations, steers and replies waiting for it;
        returns a message to send again (the whole prompt, when the server forgot a delta's
        base), if any.  Shared by both clients so they read the protocol the same way."""
        kind = msg.get("type")
        gid = msg.get("id")
        if kind == "tokens":
            self._deltas.accepted(gid)
            gen = self._gens.get(gid)
            if gen is not None:
                early = msg.get("stats")
                if isinstance(early, dict) and not gen.stats:
                    gen.stats = dict(early)  # until `done` brings them all
                gen._push(msg.get("text", ""), list(msg.get("ids", ())))
        elif kind == "done":
            self._deltas.accepted(gid)
            gen = self._gens.pop(gid, None)
            if gen is not None:
                succ = msg.get("successor")
                if succ is not None and gen.successor is None:
                    gen.successor = self._gens.get(succ)
                self._ended_flag(gen)
                gen._finish(
                    msg.get("finish_reason", "error"), msg.get("stats", {}), msg.get("error")
                )
        elif kind == "steer":
            steered = self._gens.get(gid)
            if steered is not None:  # the server has read it (accepted, committed or failed)
                steered._unread_steers.discard(msg.get("steer"))
            if msg.get("state") == P.COMMITTED and msg.get("outcome") == P.STOPPED:
                succ = msg.get("successor")
                gen = self._gens.get(gid)
                if succ and succ not in self._gens:
                    self._gens[succ] = self._generation(self, succ)
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
            whole = self._deltas.accepted(gid) if gid else None
            if msg.get("code") == P.UNKNOWN_BASE and whole is not None and gid in self._gens:
                return whole  # the server forgot the base: the whole prompt again
            err = EngineRequestError(msg.get("code", "error"), msg.get("message", ""))
            gen = self._gens.pop(gid, None) if gid else None
            if gen is not None:
                self._ended_flag(gen)
                gen._finish("error", {}, {"code": err.code, "message": err.message})
            fut = self._replies.pop(gid, None) if gid else None
            if fut is not None and not fut.done():
                fut.set_exception(err)
            if gen is None and fut is None:
                self.last_error = err
        return None


class EngineClient(_Dispatch):
    """One connection to an engine service; ``hello`` holds the server's handshake reply."""

    _generation = RemoteGeneration

    def __init__(
        self,
        ws: ClientConnection,
        hello: dict[str, Any],
        url: str = "",
        *,
        prompt_deltas: bool = True,
    ) -> None:
        self.ws = ws
        self.url = url  # where it is connected (a direct endpoint it moved to)
        self.hello = hello
        self.models: list[dict[str, Any]] = hello.get("models", [])
        memory = hello.get("capabilities", {}).get("prompt_delta", 0)
        #: how many slots' last prompts are kept as delta bases (0: the server takes none)
        self.delta_slots = int(memory) if prompt_deltas and isinstance(memory, int) else 0
        self._deltas = _PromptDeltas(self.delta_slots)
        self._unsent: dict[str, dict[str, Any]] = {}  # id -> its generate, started, not sent
        self._gens: dict[str, RemoteGeneration] = {}
        self._steers: dict[str, asyncio.Future] = {}
        self._replies: dict[str, asyncio.Future] = {}
        self._resends: set[asyncio.Future] = set()  # whole prompts re-sent after unknown_base
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
        cafile: str | None = None,
        pinned_cert: str | None = None,
        direct: bool = True,
    ) -> EngineClient:
        """Connect and shake hands.  A ``wss://`` URL's certificate is verified against the
        system's trust store and ``cafile`` (a PEM CA bundle), hostname included; or, given
        ``pinned_cert`` (a daemon's own certificate, from the user's record), is that one.

        ``direct``: where the service offers an endpoint of its own (``direct_target``), move
        there (same token and trust); stay if it cannot be reached."""
        first = await cls._connect(
            url, token, client, open_timeout, origin, prompt_deltas, cafile, pinned_cert
        )
        target = direct_target(url, first.hello) if direct else None
        if target is None:
            return first
        try:
            moved = await cls._connect(
                target,
                token,
                client,
                min(open_timeout, DIRECT_OPEN_S),
                origin,
                prompt_deltas,
                cafile,
                pinned_cert,
            )
        except EngineUnavailable as e:
            log.info("engine service: staying on %s (%s)", url, e)
            return first
        await first.close()
        return moved

    @classmethod
    async def _connect(
        cls,
        url: str,
        token: str | None,
        client: str,
        open_timeout: float,
        origin: str | None,
        prompt_deltas: bool,
        cafile: str | None,
        pinned_cert: str | None,
    ) -> EngineClient:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        ssl_context = _ssl_for(url, cafile, pinned_cert)
        try:
            ws = await connect(
                url,
                ssl=ssl_context,
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
            raise _unreachable(url, e) from None
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
        return cls(ws, reply, url, prompt_deltas=prompt_deltas)

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
            await self._send(self._wire(gen.id))
        except EngineUnavailable:
            self._gens.pop(gen.id, None)
            self._deltas.accepted(gen.id)
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
        self._unsent[gid] = msg
        return gen

    def send_generate(self, gen: RemoteGeneration) -> asyncio.Future:
        """Send a ``start``ed generation without waiting (a lost connection ends it)."""
        return asyncio.ensure_future(self._send_quietly(self._wire(gen.id)))

    async def _send_quietly(self, msg: dict[str, Any]) -> None:
        try:
            await self._send(msg)
        except EngineUnavailable:  # _send ended every generation (this one too)
            pass

    def _wire(self, gid: str) -> dict[str, Any]:
        """The message to send for a started generation (its prompt as a delta when that saves
        sending most of it: ``_PromptDeltas``)."""
        msg = self._unsent.pop(gid, None)
        if msg is None:
            raise EngineUnavailable("the generation was ended before it was sent")
        return self._deltas.wire(gid, msg)

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
        self._unsent.clear()
        self._deltas.clear()
        for fut in [*self._steers.values(), *self._replies.values()]:
            if not fut.done():
                fut.set_exception(EngineUnavailable(reason))
        self._steers.clear()
        self._replies.clear()

    def _on_message(self, msg: dict[str, Any]) -> None:
        resend = self._apply(msg)
        if resend is not None:  # the server forgot the base
            task = asyncio.ensure_future(self._send_quietly(resend))
            self._resends.add(task)  # the loop holds tasks weakly: kept until sent
            task.add_done_callback(self._resends.discard)


class SyncGeneration(_Received):
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


class SyncEngineClient(_Dispatch):
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
        open_timeout: float = 10.0,
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
        self._ids = itertools.count(1)
        self._deltas = _PromptDeltas(0)
        self.closed = False
        self.close_reason = ""
        self.last_error: EngineRequestError | None = None  # the last error no request claimed
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        ssl_context = _ssl_for(url, cafile, pinned_cert)
        try:
            self.ws = sync_connect(
                url,
                ssl=ssl_context,
                additional_headers=headers,
                open_timeout=open_timeout,
                compression=None,
                max_size=P.MAX_FRAME_BYTES,
                origin=origin,
                ping_interval=20,
                ping_timeout=60,
                close_timeout=2,
                proxy=None,
                create_connection=DirectClientConnection,
                legacy=True,  # the connection itself (this client closes it)
            )
        except InvalidStatus as e:
            code = e.response.status_code
            why = {401: "wrong or missing token", 403: "origin refused"}.get(code, "refused")
            raise EngineUnavailable(
                f"engine service at {url} refused the connection: HTTP {code} ({why})"
            ) from None
        except (OSError, WebSocketException, TimeoutError) as e:
            raise _unreachable(url, e) from None
        self._hello: concurrent.futures.Future = concurrent.futures.Future()
        self.ws.attach(self._on_raw, self._on_close)
        hello = {"type": "hello", "protocol": list(P.SUPPORTED_VERSIONS), "client": client}
        if cancel_flags and _on_this_machine(url):
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
        self._deltas = _PromptDeltas(
            int(memory) if prompt_deltas and isinstance(memory, int) else 0
        )
        self._flags = _open_flags(reply.get("capabilities", {}).get("cancel_flags"))

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
            wait = min(options.get("open_timeout", 10.0), DIRECT_OPEN_S)
            moved = cls(target, token, **{**options, "open_timeout": wait})
        except EngineUnavailable as e:
            log.info("engine service: staying on %s (%s)", url, e)
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
