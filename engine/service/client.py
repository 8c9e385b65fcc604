"""The asyncio client of the engine service: one WebSocket, many generations multiplexed on
it (:class:`EngineClient`; the bench, the protocol tests and asyncio callers).  The thread-side
client the language server uses is ``sync_client.SyncEngineClient``; what both share (errors,
prompt deltas, reading the server's messages) is in ``client_core``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus, WebSocketException

from ..params import GenerationParams
from . import protocol as P
from .client_core import (
    DIRECT_OPEN_S,
    DISCONNECTED,
    OPEN_TIMEOUT_S,
    Dispatch,
    EngineRequestError,
    EngineUnavailable,
    Piece,
    PromptDeltas,
    Received,
    direct_target,
    refused,
    ssl_for,
    unreachable,
)
from .model_files import Receiver

log = logging.getLogger(__name__)


class RemoteGeneration(Received):
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


class EngineClient(Dispatch):
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
        self._deltas = PromptDeltas(self.delta_slots)
        self._unsent: dict[str, dict[str, Any]] = {}  # id -> its generate, started, not sent
        self._gens: dict[str, RemoteGeneration] = {}
        self._steers: dict[str, asyncio.Future] = {}
        self._replies: dict[str, asyncio.Future] = {}
        self._receiving: dict[str, Receiver] = {}
        self._sending: set[asyncio.Future] = set()  # messages sent with nobody waiting
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
        open_timeout: float = OPEN_TIMEOUT_S,
        origin: str | None = None,
        prompt_deltas: bool = True,
        cafile: str | None = None,
        pinned_cert: str | None = None,
        direct: bool = True,
        keepalive_s: float | None = None,
    ) -> EngineClient:
        """Connect and shake hands.  A ``wss://`` URL's certificate is verified against the
        system's trust store and ``cafile`` (a PEM CA bundle), hostname included; or, given
        ``pinned_cert`` (a daemon's own certificate, from the user's record), is that one.

        ``direct``: where the service offers an endpoint of its own (``direct_target``), move
        there (same token and trust); stay if it cannot be reached.

        ``keepalive_s``: ping the service this often and give the connection up when a pong
        takes longer (None: the protocol's 20 s and 60 s, for editors on any network): a
        service that stops answering without closing its socket (a machine gone from the
        network, a stopped process) then ends every generation on it (``disconnected``)
        within two of these instead of 80 s."""
        options: dict[str, Any] = {
            "client": client,
            "origin": origin,
            "prompt_deltas": prompt_deltas,
            "cafile": cafile,
            "pinned_cert": pinned_cert,
            "keepalive_s": keepalive_s,
        }
        first = await cls._connect(url, token, open_timeout, **options)
        target = direct_target(url, first.hello) if direct else None
        if target is None:
            return first
        try:
            moved = await cls._connect(target, token, min(open_timeout, DIRECT_OPEN_S), **options)
        except EngineUnavailable as e:
            log.warning("engine service: staying on %s, its direct endpoint failed (%s)", url, e)
            return first
        await first.close()
        return moved

    @classmethod
    async def _connect(
        cls,
        url: str,
        token: str | None,
        open_timeout: float,
        *,
        client: str,
        origin: str | None,
        prompt_deltas: bool,
        cafile: str | None,
        pinned_cert: str | None,
        keepalive_s: float | None,
    ) -> EngineClient:
        """One connection to ``url`` and its handshake (``connect``'s options)."""
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        ssl_context = ssl_for(url, cafile, pinned_cert)
        socket_options = dict(P.SOCKET_OPTIONS)
        if keepalive_s is not None:
            socket_options.update(ping_interval=keepalive_s, ping_timeout=keepalive_s)
        try:
            ws = await connect(
                url,
                ssl=ssl_context,
                additional_headers=headers,
                open_timeout=open_timeout,
                **socket_options,
                origin=origin,
                proxy=None,
            )
        except InvalidStatus as e:
            raise refused(url, e) from None
        except (OSError, WebSocketException, asyncio.TimeoutError) as e:
            raise unreachable(url, e) from None
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
        """Start a generation on the service and return it once its ``generate`` is written.

        Cancelled while sending (a caller's own cancel, or its task stopping), the frame has
        already gone to the socket (websockets writes it before waiting for the buffer to
        drain), so the generation is cancelled on the service too: otherwise it would run to its
        end there with nobody reading it.  Its ``done`` then ends it here."""
        gen = self.start(prompt, params, slot=slot, model=model, id=id)
        try:
            await self._send(self._wire(gen.id))
        except EngineUnavailable:
            self._gens.pop(gen.id, None)
            self._deltas.accepted(gen.id)
            raise
        except asyncio.CancelledError:
            self._in_background(self._send_quietly({"type": "cancel", "id": gen.id}))
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
        sending most of it: ``PromptDeltas``)."""
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

    async def model_files(self, model: str | None = None) -> tuple[dict[str, Any], dict[str, str]]:
        """A served model's prompt files (``engine.service.model_files``): (the closing
        ``model_files`` message, the files by name), as SyncEngineClient.model_files."""
        rid = f"f{next(self._ids)}"
        fut = asyncio.get_running_loop().create_future()
        self._replies[rid] = fut
        self._receiving[rid] = Receiver()
        msg: dict[str, Any] = {"type": "model_files", "id": rid}
        if model is not None:
            msg["model"] = model
        await self._send(msg)
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
        self._receiving.clear()

    def _on_message(self, msg: dict[str, Any]) -> None:
        resend = self._apply(msg)
        if resend is not None:  # the server forgot the base
            self._in_background(self._send_quietly(resend))

    def _in_background(self, send: Awaitable[None]) -> None:
        """Send without a caller waiting (held here until sent: the loop holds tasks weakly)."""
        task = asyncio.ensure_future(send)
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)
