"""One client connection of the engine service, independent of the WebSocket library carrying it.

:class:`Session` is the protocol: it reads client messages, runs their generations on a models
backend (``engine.service.local.LocalModels`` in the daemon, the Ray Serve router in a cluster),
steers them, and decides what to send back.  How the messages travel is its subclass's:

- :class:`ThreadConnection` (the daemon, ``engine.service.server``): the thread that read a
  message handles it at once (a cancel stops its generation from the socket's reading thread),
  and each generation's own thread writes its tokens to the socket as it makes them, with no
  hand-over to another thread on either way.  Before each token the generation waits for the
  socket to take more (``credit``): a client that stops reading holds its own generations and
  fills nothing but the kernel's socket buffer; one that reads slowly slows only its connection.
- :class:`Connection` (asyncio; the Ray Serve ingress and protocol tests): messages go through a
  bounded outbox written by one sender task.  Each generation may have at most ``WINDOW``
  undelivered ``tokens`` messages (its thread waits for credit beyond that; when the client is
  behind, queued tokens of one generation are merged into one message, still holding their
  credits), and no message is read while ``CONTROL_WINDOW`` replies are undelivered.

Either way a slow client slows only its own generations and never grows the server's memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import select
import threading
import time
from array import array
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..config import ModelError
from . import model_files, steering
from . import protocol as P
from .cancel_flags import CancelFlags

log = logging.getLogger(__name__)

#: Undelivered ``tokens`` messages one generation may have before its thread waits (asyncio).
WINDOW = 32
#: Undelivered replies to control messages before the connection stops reading (asyncio).
CONTROL_WINDOW = 64
#: Generations one connection may run at once.
MAX_GENERATIONS = 32
#: Finished generation ids remembered (a late cancel of one is a no-op, a late steer fails).
RECENT_IDS = 1024
#: How often a generation waiting for a full socket looks at its cancel (ThreadConnection).
WAIT_SLICE_S = 0.005
#: A generation's tokens after its first are written at most this often: the ones made in between
#: go in its next ``tokens`` message (or with its ``done``).
COALESCE_S = 0.004


def _wake_waiter(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class Run:
    """One generation as the connection sees it: ids, what it streamed, the steering state.

    It is the generation's ``Sink`` (engine.service.local.Sink): its thread calls ``credit``,
    ``chunk`` and ``finish``, which the session's transport carries out."""

    def __init__(
        self,
        conn: Session,
        gid: str,
        model: str | None,
        prompt: list[int],
        params: Any,
        slot: str | None,
    ) -> None:
        self.conn = conn
        self.id = gid
        self.model = model
        self.prompt = prompt
        self.params = params
        self.slot = slot
        self.stream = steering.Stream()
        self.typed = ""
        self.pending_steers: list[str | None] = []
        self.cancelled = False  # the client cancelled it
        self.steered = False  # diverged: stop, and start the successor when it has stopped
        self.successor_id: str | None = None
        self.handle: Any = None
        self.early_stats: dict[str, Any] | None = None  # sent with its first tokens message
        self.stop_flag: Any = None  # the client's shared cancel flag (a ctypes word), if any
        self._credits = threading.Semaphore(WINDOW)  # undelivered tokens (asyncio Connection)
        self._credit_waiter: tuple[asyncio.AbstractEventLoop, asyncio.Future[None]] | None = None

    # -- the Sink interface, called from the generation's thread ---------------------------------
    def credit(self, stop: threading.Event, timeout: float) -> bool:
        return self.conn._credit(self, stop, timeout)

    async def acredit(self) -> None:
        """The asyncio form of ``credit`` for backends that stream on the event loop: wait,
        without polling, until a sent message (or ``stop``) gives a credit back."""
        while not self._credits.acquire(blocking=False):
            loop = asyncio.get_running_loop()
            waiter = loop.create_future()
            self._credit_waiter = (loop, waiter)
            try:
                if self._credits.acquire(blocking=False):  # released before the waiter was set
                    return
                await waiter
            finally:
                self._credit_waiter = None

    def chunk(self, token_id: int, text: str, stats: dict[str, Any] | None = None) -> None:
        if stats is not None:
            self.early_stats = P.early_stats(stats)
        self.conn._deliver(self.conn._on_chunk, self, token_id, text)

    def finish(
        self, finish_reason: str, stats: dict[str, Any], error: tuple[str, str] | None
    ) -> None:
        self.conn._deliver(self.conn._on_finish, self, finish_reason, stats, error)

    def release(self) -> None:
        self._credits.release()
        waiting = self._credit_waiter
        if waiting is not None:  # an `acredit` waits: wake it on its loop (from any thread)
            loop, waiter = waiting
            try:
                loop.call_soon_threadsafe(_wake_waiter, waiter)
            except RuntimeError:  # its loop is closed
                pass

    def stop(self) -> None:
        """Stop the generation (within one decode step); a thread waiting for credit wakes."""
        if self.handle is not None:
            self.handle.cancel()
        self.conn._wake(self)


class Session:
    """The protocol state of one client, whatever carries its messages.

    Subclasses say how messages leave (``_reply``: the answer to a client message; ``_emit``:
    an event of a generation; ``_tokens``), on which thread a generation's output is handled
    (``_deliver``), and how a generation waits for room (``_credit``, ``_wake``).  ``lock`` is
    held while the state changes (a no-op where one event loop does everything)."""

    lock: Any = contextlib.nullcontext()

    def __init__(
        self,
        models: Any,
        *,
        peer: str = "?",
        max_generations: int = MAX_GENERATIONS,
        flags_dir: Path | None = None,
    ) -> None:
        self.models = models
        self.peer = peer
        self.max_generations = max_generations
        # where shared cancel flags go (engine.service.cancel_flags); None: not offered (a
        # client on another machine, or a backend whose engines run in other processes)
        self.flags_dir = flags_dir
        self.flags: CancelFlags | None = None
        self.runs: dict[str, Run] = {}
        self.aliases: dict[str, str] = {}  # a steered-away id -> its successor's id
        self.recent: deque[str] = deque(maxlen=RECENT_IDS)
        # the prompts of the latest generations, bases of prompt deltas (compact int arrays)
        self.prompts: OrderedDict[str, array] = OrderedDict()
        self.greeted = False
        self.closing = False
        self._successors = 0

    # -- the transport's part --------------------------------------------------------------------
    def _reply(self, msg: dict[str, Any]) -> None:
        raise NotImplementedError

    def _emit(self, msg: dict[str, Any]) -> None:
        raise NotImplementedError

    def _tokens(self, run: Run, token_id: int, text: str) -> None:
        raise NotImplementedError

    def _deliver(self, fn: Callable[..., None], *args: Any) -> None:
        raise NotImplementedError

    def _credit(self, run: Run, stop: threading.Event, timeout: float) -> bool:
        raise NotImplementedError

    def _wake(self, run: Run) -> None:
        pass

    # -- reading -------------------------------------------------------------------------------
    def _message(self, raw: str | bytes) -> None:
        """One frame from the client.  Never raises for a bad message: it is answered instead."""
        try:
            msg = P.parse(P.decode(raw))
        except P.ProtocolError as e:
            with self.lock:
                self._reply(P.error(e.code, e.message, e.id))
            return
        with self.lock:
            try:
                self._dispatch(msg)
            except P.ProtocolError as e:
                self._reply(P.error(e.code, e.message, e.id))
            except Exception as e:  # a fault of ours: this message fails, the connection goes on
                log.exception("engine client %s: %s failed", self.peer, type(msg).__name__)
                self._reply(
                    P.error(P.ENGINE_ERROR, f"{type(e).__name__}: {e}", getattr(msg, "id", None))
                )

    def _dispatch(self, msg: Any) -> None:
        if isinstance(msg, P.Hello):
            return self._hello(msg)
        if not self.greeted:
            raise P.ProtocolError(P.HELLO_REQUIRED, "send 'hello' first", getattr(msg, "id", None))
        if isinstance(msg, P.Generate):
            return self._generate(msg)
        if isinstance(msg, P.Cancel):
            run = self._live(msg.id)
            if run is not None:
                run.cancelled = True
                run.stop()
            return None
        if isinstance(msg, P.Steer):
            return self._steer(msg)
        if isinstance(msg, P.Status):
            reply = {
                "type": "status",
                "models": self.models.status(),
                "generations": len(self.runs),
            }
            if msg.id is not None:
                reply["id"] = msg.id
            return self._reply(reply)
        if isinstance(msg, P.ModelFiles):
            return self._model_files(msg)
        raise AssertionError(msg)

    def _model_files(self, msg: P.ModelFiles) -> None:
        """Send a model's prompt files (``engine.service.model_files``), in chunks."""
        for part in self._file_parts(msg):
            self._reply(part)

    def _file_parts(self, msg: P.ModelFiles) -> list[dict[str, Any]]:
        """The messages that answer ``msg``, the files read (a GGUF's made from its header)."""
        try:
            name, files, digest = self.models.prompt_files(msg.model)
        except KeyError:
            raise P.ProtocolError(P.UNKNOWN_MODEL, self._no_model(msg.model), msg.id) from None
        except (ModelError, OSError) as e:
            raise P.ProtocolError(P.UNAVAILABLE, str(e), msg.id) from None
        log.info("engine client %s: sending the prompt files of %s", self.peer, name)
        return list(model_files.chunks(msg.id, name, files, digest))

    def _no_model(self, name: str | None) -> str:
        return f"no model {name!r}; this server has {[m['name'] for m in self.models.describe()]}"

    def _hello(self, msg: P.Hello) -> None:
        common = sorted(set(msg.versions) & set(P.SUPPORTED_VERSIONS))
        if not common:
            raise P.ProtocolError(
                P.UNSUPPORTED_VERSION,
                f"protocol versions {list(msg.versions)} are not supported; "
                f"this server speaks {list(P.SUPPORTED_VERSIONS)}",
            )
        self.greeted = True
        log.info(
            "engine client %s: hello (%s, protocol %d)",
            self.peer,
            msg.client or "unnamed",
            common[-1],
        )
        capabilities: dict[str, Any] = {
            "steer": True,
            "cancel": True,
            "token_ids": True,
            "text_prompts": True,
            "max_message_bytes": P.MAX_MESSAGE_BYTES,
            "prompt_delta": P.PROMPT_MEMORY,
            "max_generations": self.max_generations,
            "params": list(P.PARAM_NAMES),
        }
        if msg.cancel_flags and self.flags_dir is not None and self.flags is None:
            try:
                self.flags = CancelFlags.create(self.flags_dir)
            except OSError as e:
                log.warning("engine client %s: no shared cancel flags: %s", self.peer, e)
        if self.flags is not None:
            capabilities["cancel_flags"] = {"path": str(self.flags.path), "count": self.flags.count}
        extra = getattr(self.models, "capabilities", None)  # the backend's own (Ray: ``direct``)
        if extra is not None:
            capabilities.update(extra())
        self._reply(
            {
                "type": "hello",
                "protocol": common[-1],
                "server": "spark-lsp-engine",
                "models": self.models.describe(),
                "capabilities": capabilities,
            }
        )

    def _generate(self, msg: P.Generate) -> None:
        if self.closing:
            raise P.ProtocolError(P.SHUTTING_DOWN, "the engine service is shutting down", msg.id)
        if msg.id in self.runs or msg.id in self.aliases:
            raise P.ProtocolError(P.DUPLICATE_ID, f"generation {msg.id!r} is still running", msg.id)
        if msg.cancel_flag is not None and (
            self.flags is None or msg.cancel_flag >= self.flags.count
        ):
            raise P.ProtocolError(
                P.BAD_MESSAGE,
                f"no shared cancel flag {msg.cancel_flag} on this connection"
                + (f" (it has {self.flags.count})" if self.flags is not None else ""),
                msg.id,
            )
        if len(self.runs) >= self.max_generations:
            raise P.ProtocolError(
                P.TOO_MANY,
                f"at most {self.max_generations} generations at once per connection",
                msg.id,
            )
        prompt = msg.prompt
        if isinstance(prompt, P.PromptDelta):
            base = self.prompts.get(prompt.base)
            if base is None:
                raise P.ProtocolError(
                    P.UNKNOWN_BASE,
                    f"no prompt of generation {prompt.base!r} is kept on this connection "
                    f"(the last {P.PROMPT_MEMORY} are); send the whole prompt",
                    msg.id,
                )
            try:
                prompt = prompt.apply(base)
            except ValueError as e:
                raise P.ProtocolError(P.BAD_PROMPT, str(e), msg.id) from None
        try:
            ids = self.models.encode(msg.model, prompt)
        except KeyError:
            raise P.ProtocolError(P.UNKNOWN_MODEL, self._no_model(msg.model), msg.id) from None
        except (ValueError, ModelError) as e:
            raise P.ProtocolError(P.BAD_PROMPT, str(e), msg.id) from None
        self._remember(msg.id, prompt if isinstance(prompt, array) else ids)
        run = Run(self, msg.id, msg.model, ids, msg.params, msg.slot)
        if msg.cancel_flag is not None and self.flags is not None:
            run.stop_flag = self.flags.word(msg.cancel_flag)
            self.flags.unlink()  # the client has mapped it: its name is needed no more
        self._start(run)

    def _remember(self, gid: str, ids: Sequence[int]) -> None:
        """Keep a generation's prompt as a base for the deltas of later ones (the latest
        PROMPT_MEMORY of this connection), as the client sent it: a delta's base is the
        client's prompt, not what the engine made of it."""
        self.prompts.pop(gid, None)
        self.prompts[gid] = ids if isinstance(ids, array) else array("i", ids)
        while len(self.prompts) > P.PROMPT_MEMORY:
            self.prompts.popitem(last=False)

    def _start(self, run: Run) -> None:
        self.runs[run.id] = run
        try:
            run.handle = self.models.start(run.model, run.prompt, run.params, run.slot, run)
        except (ValueError, ModelError) as e:
            del self.runs[run.id]
            self._emit(P.done(run.id, "error", {}, error={"code": P.BAD_PROMPT, "message": str(e)}))

    def _live(self, gid: str) -> Run | None:
        """The running generation for an id, following steer successors."""
        for _ in range(64):
            nxt = self.aliases.get(gid)
            if nxt is None or nxt not in self.runs:
                break  # no successor, or it has not started yet (its predecessor is stopping)
            gid = nxt
        return self.runs.get(gid)

    # -- steering ------------------------------------------------------------------------------
    def _steer(self, msg: P.Steer) -> None:
        run = self._live(msg.id)
        if run is None:
            self._reply(
                P.steer_event(
                    msg.id, msg.steer, P.FAILED, text=msg.text, reason="the generation has ended"
                )
            )
            return
        self._reply(P.steer_event(run.id, msg.steer, P.ACCEPTED))
        if run.steered:  # stopping already: the text joins the successor's prompt
            run.typed += msg.text
            self._reply(
                P.steer_event(
                    run.id, msg.steer, P.COMMITTED, outcome=P.STOPPED, successor=run.successor_id
                )
            )
            return
        run.typed += msg.text
        run.pending_steers.append(msg.steer)
        self._judge(run, final=False)

    def _judge(self, run: Run, final: bool) -> None:
        """Commit the pending steers of ``run`` if the stream decides them (``final``: it ended)."""
        if not run.pending_steers or run.steered:
            return
        verdict = steering.judge(run.typed, run.stream.text)
        if verdict == steering.PENDING and not final:
            return
        if verdict == steering.MATCH:
            for sid in run.pending_steers:
                self._emit(
                    P.steer_event(
                        run.id, sid, P.COMMITTED, outcome=P.CONTINUED, matched=len(run.typed)
                    )
                )
            run.pending_steers.clear()
            return
        # diverged (or typed past the end of a finished generation): stop it, a successor follows
        self._successors += 1
        run.steered = True
        run.successor_id = f"{run.id}~{self._successors}"
        for sid in run.pending_steers:
            self._emit(
                P.steer_event(
                    run.id, sid, P.COMMITTED, outcome=P.STOPPED, successor=run.successor_id
                )
            )
        run.pending_steers.clear()
        self.aliases[run.id] = run.successor_id
        if not final:
            run.stop()

    def _start_successor(self, run: Run) -> None:
        tok = self.models.tokenizer(run.model)
        ids = steering.successor_prompt(
            run.prompt, run.stream, run.typed, tok.encode, run.params.healed_prefix
        )
        params = replace(run.params, healed_prefix="") if run.params.healed_prefix else run.params
        try:
            ids = self.models.encode(run.model, ids)
        except (ValueError, ModelError) as e:
            self.aliases.pop(run.id, None)
            self._emit(
                P.done(
                    run.successor_id, "error", {}, error={"code": P.BAD_PROMPT, "message": str(e)}
                )
            )
            return
        succ = Run(self, run.successor_id, run.model, ids, params, run.slot)
        succ.stop_flag = run.stop_flag  # the client's flag stays its generation chain's
        self._start(succ)

    # -- output from the generations (on the thread ``_deliver`` chose, with ``lock`` held) ----
    def _on_chunk(self, run: Run, token_id: int, text: str) -> None:
        if run.steered:  # stopped by a steer: what it generates past the divergence is dropped
            run.release()
            return
        run.stream.push(token_id, text)
        self._tokens(run, token_id, text)
        if run.pending_steers:
            self._judge(run, final=False)

    def _on_finish(
        self, run: Run, reason: str, stats: dict[str, Any], error: tuple[str, str] | None
    ) -> None:
        if run.pending_steers and error is None:
            self._judge(run, final=True)
        if run.steered:
            reason = "steered" if reason == "cancelled" else reason
        self.runs.pop(run.id, None)
        self.recent.append(run.id)
        err = {"code": error[0], "message": error[1]} if error else None
        self._emit(P.done(run.id, reason, stats, successor=run.successor_id, error=err))
        if run.steered and not (self.closing or run.cancelled):
            self._start_successor(run)
        elif run.steered:  # cancelled while stopping for a steer: the successor never starts
            self.aliases.pop(run.id, None)
            self._emit(P.done(run.successor_id, "cancelled", {}))
        if len(self.aliases) > RECENT_IDS:  # forget the oldest steer chains
            for key in list(self.aliases)[: len(self.aliases) - RECENT_IDS]:
                del self.aliases[key]


class _Held:
    """A generation's tokens not sent yet, and when it last sent some: the coalescing state both
    transports keep (``COALESCE_S``)."""

    __slots__ = ("queued", "text", "ids", "releases", "timer")

    def __init__(self) -> None:
        self.queued: float | None = None  # when tokens last left (None: none yet)
        self.text = ""
        self.ids: list[int] = []
        self.releases: list[Callable[[], None]] = []
        self.timer: asyncio.TimerHandle | None = None

    def add(self, token_id: int, text: str, release: Callable[[], None] | None = None) -> None:
        self.text += text
        self.ids.append(token_id)
        if release is not None:
            self.releases.append(release)

    def due(self, now: float) -> bool:
        """The tokens may leave now: the generation's first, or COALESCE_S after the last."""
        return self.queued is None or now - self.queued >= COALESCE_S

    def take(self) -> tuple[str, list[int], list[Callable[[], None]]]:
        """What waits (text, ids, credit releases), and nothing left held."""
        out = (self.text, self.ids, self.releases)
        self.text, self.ids, self.releases = "", [], []
        return out


class ThreadConnection(Session):
    """A session whose messages are handled on the thread that read them and whose generations
    write their own output (the daemon).

    ``send(text)`` writes one text frame from the calling thread (blocking while the socket is
    full; it raises once the connection is closed); ``send_batch(texts)``, where the transport
    has it, writes several frames with one socket write (a generation's held tokens and the
    message after them: each write wakes the client, which on a busy machine may take the
    writer's core before its second write); ``sock`` is the socket under it, watched for room
    before each token.  ``handle`` is called by the socket's reading thread."""

    def __init__(
        self,
        models: Any,
        send: Callable[[str], None],
        sock: Any,
        *,
        send_batch: Callable[[Sequence[str]], None] | None = None,
        peer: str = "?",
        max_generations: int = MAX_GENERATIONS,
        flags_dir: Path | None = None,
    ) -> None:
        super().__init__(models, peer=peer, max_generations=max_generations, flags_dir=flags_dir)
        self.lock = threading.RLock()
        self._ended = threading.Condition(self.lock)  # notified when a generation ends
        self._send = send
        self._send_batch = send_batch
        self._sock = sock
        self.dead = False  # a write failed: the client is gone
        self._held: dict[str, _Held] = {}  # generation id -> tokens not written yet

    def handle(self, raw: str | bytes) -> None:
        self._message(raw)

    # -- the transport ---------------------------------------------------------------------------
    def _write(self, *msgs: dict[str, Any]) -> None:
        """Send messages in this order, together where the transport can (with ``lock`` held,
        so messages leave in the order decided)."""
        if self.dead:
            return
        try:
            if len(msgs) > 1 and self._send_batch is not None:
                self._send_batch([P.encode(m) for m in msgs])
            else:
                for m in msgs:
                    self._send(P.encode(m))
        except Exception as e:  # ConnectionClosed, OSError: the client is gone
            log.debug("engine client %s: write failed: %s", self.peer, e)
            self._lost()

    def _reply(self, msg: dict[str, Any]) -> None:
        """Send ``msg``, after the tokens its generation holds (in the same write)."""
        held = self._take_held(msg.get("id"))
        if held is not None:
            self._write(held, msg)
        else:
            self._write(msg)

    _emit = _reply

    def _tokens(self, run: Run, token_id: int, text: str) -> None:
        """A generation's first token leaves at once; later ones at most every COALESCE_S (a
        write, and the client's wake-up to read it, per token would take the cores from the
        engine on a small machine): those made in between wait for the next write, which the
        generation's next token or its end makes."""
        held = self._held.get(run.id)
        if held is None:
            held = self._held[run.id] = _Held()
        held.add(token_id, text)
        now = time.monotonic()
        if held.due(now):
            first = held.queued is None
            held.queued = now
            text, ids, _ = held.take()
            msg = P.tokens(run.id, text, ids)
            if first and run.early_stats:
                msg["stats"] = run.early_stats
            self._write(msg)

    def _take_held(self, gid: str | None) -> dict[str, Any] | None:
        """The ``tokens`` message of what ``gid`` holds (then held no more), or None."""
        held = self._held.get(gid) if gid is not None else None
        if held is None or not held.ids:
            return None
        text, ids, _ = held.take()
        return P.tokens(gid, text, ids)

    def _deliver(self, fn: Callable[..., None], *args: Any) -> None:
        with self.lock:
            fn(*args)
            if not self.runs:
                self._ended.notify_all()

    def _on_finish(
        self, run: Run, reason: str, stats: dict[str, Any], error: tuple[str, str] | None
    ) -> None:
        super()._on_finish(run, reason, stats, error)
        self._held.pop(run.id, None)  # its `done` flushed what was held

    def _credit(self, run: Run, stop: threading.Event, timeout: float) -> bool:
        """Wait until the socket takes more (at most ``timeout`` s, looking at ``stop``)."""
        deadline = time.monotonic() + timeout
        while not self.dead:
            try:
                _, ready, _ = select.select((), (self._sock,), (), WAIT_SLICE_S)
            except (OSError, ValueError):  # the socket is closed
                return True  # the write fails, the generation stops
            if ready:
                return True
            if stop.is_set() or time.monotonic() >= deadline:
                return False
        return True

    def _lost(self) -> None:
        self.dead = True
        for run in list(self.runs.values()):
            run.stop()

    def close(self, drain_s: float = 5.0) -> None:
        """Cancel every generation and wait (up to ``drain_s``) for their ``done`` messages;
        remove the shared cancel flags (generations still stopping keep their mapping)."""
        deadline = time.monotonic() + drain_s
        with self.lock:
            self.closing = True
            for run in list(self.runs.values()):
                run.stop()
            while self.runs:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._ended.wait(left)
            if self.flags is not None:
                self.flags.close()
                self.flags = None


class _Outbox:
    """The messages waiting for the sender, with credit bookkeeping (used on the event loop only)."""

    def __init__(self) -> None:
        self.items: deque[list[Any]] = deque()  # [message, release callbacks]
        self.ready = asyncio.Event()
        self.control = 0  # undelivered replies to control messages
        self.room = asyncio.Event()  # set while control < CONTROL_WINDOW
        self.room.set()

    def put(self, msg: dict[str, Any], release: Callable[[], None] | None = None) -> None:
        self.items.append([msg, [release] if release else []])
        self.ready.set()

    def put_control(self, msg: dict[str, Any]) -> None:
        self.reserve()
        self.put(msg, self.unreserve)

    def reserve(self) -> None:
        """Count one more undelivered reply (one queued, or a request still being answered)."""
        self.control += 1
        if self.control >= CONTROL_WINDOW:
            self.room.clear()

    def unreserve(self) -> None:
        self.control -= 1
        if self.control < CONTROL_WINDOW:
            self.room.set()

    def put_tokens(
        self,
        gid: str,
        text: str,
        ids: list[int],
        releases: list[Callable[[], None]],
        stats: dict[str, Any] | None = None,
    ) -> None:
        """Queue tokens of ``gid`` (``stats``: the early stats its first tokens carry):
        appended to the last queued message when it is ``tokens`` of the same generation (the
        sender is behind), else a new message."""
        last = self.items[-1] if self.items else None
        if last is not None and last[0].get("type") == "tokens" and last[0].get("id") == gid:
            last[0]["text"] += text
            last[0]["ids"].extend(ids)
            last[1].extend(releases)  # the credits come back when the merged message is sent
            return
        msg = P.tokens(gid, text, list(ids))
        if stats:
            msg["stats"] = stats
        self.items.append([msg, list(releases)])
        self.ready.set()


class Connection(Session):
    """A session on an asyncio event loop; ``send`` writes one text frame (awaits while the peer
    is slow).  Generations hand their output to the loop; one sender task writes the outbox."""

    def __init__(
        self,
        models: Any,
        send: Callable[[str], Awaitable[None]],
        *,
        peer: str = "?",
        max_generations: int = MAX_GENERATIONS,
    ) -> None:
        super().__init__(models, peer=peer, max_generations=max_generations)
        self._send = send
        self.loop = asyncio.get_running_loop()
        self.outbox = _Outbox()
        self._held: dict[str, _Held] = {}
        self._progress = asyncio.Event()  # a generation ended or a message went out (``close``)
        self._sender = asyncio.ensure_future(self._send_loop())
        self._files_lock = asyncio.Lock()  # one `model_files` answered at a time
        self._files_tasks: set[asyncio.Task] = set()

    async def handle(self, raw: str | bytes) -> None:
        """One frame from the client, read once fewer than CONTROL_WINDOW replies wait."""
        await self.outbox.room.wait()
        self._message(raw)

    # -- the transport ---------------------------------------------------------------------------
    def _model_files(self, msg: P.ModelFiles) -> None:
        """As the session's, with the files read on a worker thread: the event loop goes on
        serving every other client meanwhile (a GGUF's files take a few hundred ms to make).
        One request is answered at a time, and each one waiting counts as an undelivered reply:
        a client that asks again and again without reading the answers is no longer read (flow
        control), rather than having the service read and hold a tokenizer per request."""
        self.outbox.reserve()
        task = asyncio.ensure_future(self._answer_files(msg))
        self._files_tasks.add(task)
        task.add_done_callback(self._files_tasks.discard)

    async def _answer_files(self, msg: P.ModelFiles) -> None:
        try:
            async with self._files_lock:
                try:
                    parts = await self.loop.run_in_executor(None, self._file_parts, msg)
                except P.ProtocolError as e:
                    parts = [P.error(e.code, e.message, e.id)]
                except Exception as e:  # never a request left unanswered
                    log.exception("reading the model files failed")
                    parts = [P.error(P.UNAVAILABLE, f"{type(e).__name__}: {e}", msg.id)]
                for part in parts:
                    self._reply(part)
        finally:
            self.outbox.unreserve()

    def _reply(self, msg: dict[str, Any]) -> None:
        self._flush(msg.get("id"))
        self.outbox.put_control(msg)

    def _emit(self, msg: dict[str, Any]) -> None:
        self._flush(msg.get("id"))
        self.outbox.put(msg)

    def _tokens(self, run: Run, token_id: int, text: str) -> None:
        """As ThreadConnection's: a generation's first token is queued at once, later ones at
        most every COALESCE_S (a timer queues what came in between, or the generation's next
        message does).  Behind Ray Serve every message crosses the proxy as its own Ray call,
        whose cost, not the engine, bounds how many editors the ingress serves."""
        held = self._held.get(run.id)
        if held is None:
            held = self._held[run.id] = _Held()
        held.add(token_id, text, run.release)
        if held.due(self.loop.time()):
            self._flush(run.id, run.early_stats if held.queued is None else None)
        elif held.timer is None:
            held.timer = self.loop.call_at(held.queued + COALESCE_S, self._flush, run.id)

    def _flush(self, gid: str | None, stats: dict[str, Any] | None = None) -> None:
        """Queue the tokens of ``gid`` that wait (before any other message about it); ``stats``:
        the generation's early stats, with its first tokens."""
        held = self._held.get(gid) if gid is not None else None
        if held is None:
            return
        if held.timer is not None:
            held.timer.cancel()
            held.timer = None
        if held.ids:
            held.queued = self.loop.time()
            self.outbox.put_tokens(gid, *held.take(), stats=stats)

    def _on_finish(
        self, run: Run, reason: str, stats: dict[str, Any], error: tuple[str, str] | None
    ) -> None:
        super()._on_finish(run, reason, stats, error)  # its `done` queued what was held
        held = self._held.pop(run.id, None)
        if held is not None and held.timer is not None:
            held.timer.cancel()
        self._progress.set()

    def _deliver(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: the process is exiting
            pass

    def _credit(self, run: Run, stop: threading.Event, timeout: float) -> bool:
        return run._credits.acquire(timeout=timeout)

    def _wake(self, run: Run) -> None:
        run.release()  # never used: the generation ends (an `acredit` wakes)

    async def _send_loop(self) -> None:
        box = self.outbox
        while True:
            while not box.items:
                box.ready.clear()
                await box.ready.wait()
            msg, releases = box.items.popleft()
            try:
                await self._send(P.encode(msg))
            finally:
                for release in releases:
                    release()
                self._progress.set()

    async def close(self, drain_s: float = 5.0) -> None:
        """Cancel every generation, deliver their ``done`` messages (up to ``drain_s``), stop."""
        self.closing = True
        for run in list(self.runs.values()):
            run.stop()
        for held in self._held.values():
            if held.timer is not None:
                held.timer.cancel()
        for task in list(self._files_tasks):  # files nobody will read
            task.cancel()
        deadline = self.loop.time() + drain_s
        while (self.runs or self.outbox.items) and not self._sender.done():
            left = deadline - self.loop.time()
            if left <= 0:
                break
            self._progress.clear()  # woken by the next ended generation or message sent
            try:
                await asyncio.wait_for(self._progress.wait(), left)
            except asyncio.TimeoutError:
                break
        self._sender.cancel()
        try:
            await self._sender
        except (asyncio.CancelledError, Exception):
            pass
        for run in list(self.runs.values()):  # still running after drain_s: released from credits
            for _ in range(WINDOW):
                run.release()
