"""What the engine service's two clients (``client.EngineClient``, asyncio;
``sync_client.SyncEngineClient``, threads) share: their errors, how they open a connection's TLS
and move to a service's direct endpoint, and how they read the server's messages into their
generations (``Dispatch``), prompt deltas included.

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

import logging
import urllib.parse
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from websockets.exceptions import InvalidMessage, InvalidStatus

from . import protocol as P
from . import tls
from .address import is_loopback
from .cancel_flags import CancelFlags
from .model_files import ModelFilesError, Receiver

log = logging.getLogger(__name__)

DISCONNECTED = "disconnected"
#: Seconds a client waits for a connection and its handshake, unless told otherwise.
OPEN_TIMEOUT_S = 10.0
#: Seconds a move to a service's direct endpoint may take to connect before the client stays
#: where it is (a firewalled port drops the connection attempt instead of refusing it).
DIRECT_OPEN_S = 3.0


class EngineUnavailable(ConnectionError):
    """The engine service cannot be reached (or refused us: wrong token, origin, version)."""


def ssl_for(url: str, cafile: str | None, pinned: str | None = None) -> Any:
    """The client SSL context of a ``wss://`` URL (None for ``ws://``): ``pinned``, the one
    certificate to trust, else the trust store and ``cafile``.  A file that cannot be used is
    an EngineUnavailable that says why."""
    if not tls.is_secure(url):
        return None
    try:
        return tls.pinned_context(pinned) if pinned else tls.client_context(cafile)
    except tls.TLSConfigError as e:
        raise EngineUnavailable(f"cannot connect to the engine service at {url}: {e}") from None


def on_this_machine(url: str) -> bool:
    host = urllib.parse.urlsplit(url).hostname
    return host is not None and is_loopback(host)


def open_flags(offer: Any) -> CancelFlags | None:
    """The daemon's shared cancel flags from its ``hello`` offer (None: none offered, or they
    cannot be used: then cancels go by message only)."""
    if not isinstance(offer, dict):
        return None
    try:
        return CancelFlags.open(str(offer.get("path")), offer.get("count"))
    except (OSError, ValueError) as e:
        log.info("engine service: shared cancel flags not used: %s", e)
        return None


def unreachable(url: str, exc: BaseException) -> EngineUnavailable:
    """The EngineUnavailable of a connection that failed with ``exc`` (a TLS failure says what
    failed and how to trust the server's certificate)."""
    why = tls.failure(url, exc)
    if why is None and isinstance(exc, InvalidMessage) and not tls.is_secure(url):
        why = (
            f"cannot reach the engine service at {url}: {exc} (if it serves TLS, use its "
            "wss:// URL)"
        )
    return EngineUnavailable(why or f"cannot reach the engine service at {url}: {exc}")


def refused(url: str, exc: InvalidStatus) -> EngineUnavailable:
    """The EngineUnavailable of a connection the service refused with an HTTP status."""
    code = exc.response.status_code
    why = {401: "wrong or missing token", 403: "origin refused"}.get(code, "refused")
    return EngineUnavailable(f"engine service at {url} refused the connection: HTTP {code} ({why})")


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


class Received:
    """What the clients' dispatcher (:class:`Dispatch`) records of one generation: ``text``,
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


class PromptDeltas:
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


class Dispatch:
    """The client side of the protocol's server messages, for :class:`EngineClient` (asyncio)
    and :class:`SyncEngineClient` (threads): what each message does to the generations
    (``_gens``), steers (``_steers``) and replies (``_replies``) the client waits on."""

    _generation: Any  # the generation class the client makes for a steer's successor
    _gens: dict[str, Any]
    _steers: dict[str, Any]
    _replies: dict[str, Any]
    _receiving: dict[str, Receiver]  # model_files requests: their chunks so far
    _deltas: PromptDeltas
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
        elif kind in ("model_file", "model_files"):
            self._model_files(kind, gid, msg)
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
            self._receiving.pop(gid, None)
            if fut is not None and not fut.done():
                fut.set_exception(err)
            if gen is None and fut is None:
                self.last_error = err
        return None

    def _model_files(self, kind: str, gid: Any, msg: dict[str, Any]) -> None:
        """A chunk (``model_file``) or the end (``model_files``) of the answer to a
        ``model_files`` request: the request's future gets (the closing message, the files), or
        the ModelFilesError of files that cannot be taken."""
        receiver = self._receiving.get(gid)
        if receiver is None:
            return
        try:
            if kind == "model_file":
                receiver.add(msg)
                return
            result: Any = (msg, receiver.finish(msg))
        except ModelFilesError as e:
            result = e
        del self._receiving[gid]
        fut = self._replies.pop(gid, None)
        if fut is not None and not fut.done():
            if isinstance(result, ModelFilesError):
                fut.set_exception(result)
            else:
                fut.set_result(result)
