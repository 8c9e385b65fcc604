"""One client connection of the engine service, independent of the WebSocket library carrying it.

A :class:`Connection` reads client messages (``handle``), runs their generations on a models
backend (``engine.service.local.LocalModels`` in the daemon, the Ray Serve router in a cluster)
and writes server messages through one sender task.  The outbox is bounded: each generation may
have at most ``window`` undelivered ``tokens`` messages (its thread waits for credit beyond
that; when the client is behind, queued tokens of one generation are merged into one message,
still holding their credits),
and replies to control messages wait for room, which stops the reading of further messages.  A
slow client therefore slows only its own generations and never grows the server's memory.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from array import array
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

from ..config import ModelError
from . import protocol as P
from . import steering

log = logging.getLogger(__name__)

#: Undelivered ``tokens`` messages one generation may have before its thread waits.
WINDOW = 32
#: Undelivered replies to control messages before the connection stops reading.
CONTROL_WINDOW = 64
#: Generations one connection may run at once.
MAX_GENERATIONS = 32
#: Finished generation ids remembered (a late cancel of one is a no-op, a late steer fails).
RECENT_IDS = 1024


class _Outbox:
    """The messages waiting for the sender, with credit bookkeeping (used on the event loop only)."""

    def __init__(self) -> None:
        self.items: deque[list[Any]] = deque()  # [message, release callbacks]
        self.ready = asyncio.Event()
        self.control = asyncio.Semaphore(CONTROL_WINDOW)

    def put(self, msg: dict[str, Any], release: Callable[[], None] | None = None) -> None:
        self.items.append([msg, [release] if release else []])
        self.ready.set()

    def merge_tokens(
        self, gid: str, text: str, ids: list[int], release: Callable[[], None]
    ) -> bool:
        """Append to the last queued message when it is ``tokens`` of the same generation."""
        if not self.items:
            return False
        last = self.items[-1]
        msg = last[0]
        if msg.get("type") != "tokens" or msg.get("id") != gid:
            return False
        msg["text"] += text
        msg["ids"].extend(ids)
        last[1].append(release)  # the credit comes back when the merged message is sent
        return True


class Run:
    """One generation as the connection sees it: ids, what it streamed, the steering state."""

    def __init__(
        self,
        conn: Connection,
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
        self._credits = threading.Semaphore(WINDOW)
        self._loop = conn.loop

    # -- the Sink interface (engine.service.local.Sink), called from the generation's thread -----
    def credit(self, stop: threading.Event, timeout: float) -> bool:
        return self._credits.acquire(timeout=timeout)

    async def acredit(self) -> None:
        """The asyncio form of ``credit`` for backends that stream on the event loop."""
        while not self._credits.acquire(blocking=False):
            await asyncio.sleep(0.002)

    def chunk(self, token_id: int, text: str) -> None:
        self._call(self.conn._on_chunk, self, token_id, text)

    def finish(
        self, finish_reason: str, stats: dict[str, Any], error: tuple[str, str] | None
    ) -> None:
        self._call(self.conn._on_finish, self, finish_reason, stats, error)

    def release(self) -> None:
        self._credits.release()

    def stop(self) -> None:
        """Stop the generation; a thread waiting for credit wakes at once (the extra credit is
        never used: the generation ends)."""
        self.handle.cancel()
        self._credits.release()

    def _call(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: the process is exiting
            pass


class Connection:
    """Protocol state of one client; ``send`` writes one text frame (awaits while the peer is slow)."""

    def __init__(
        self,
        models: Any,
        send: Callable[[str], Awaitable[None]],
        *,
        peer: str = "?",
        max_generations: int = MAX_GENERATIONS,
    ) -> None:
        self.models = models
        self._send = send
        self.peer = peer
        self.max_generations = max_generations
        self.loop = asyncio.get_running_loop()
        self.outbox = _Outbox()
        self.runs: dict[str, Run] = {}
        self.aliases: dict[str, str] = {}  # a steered-away id -> its successor's id
        self.recent: deque[str] = deque(maxlen=RECENT_IDS)
        # the prompts of the latest generations, bases of prompt deltas (compact int arrays)
        self.prompts: OrderedDict[str, array] = OrderedDict()
        self.greeted = False
        self.closing = False
        self._sender = asyncio.ensure_future(self._send_loop())
        self._successors = 0

    # -- reading -------------------------------------------------------------------------------
    async def handle(self, raw: str | bytes) -> None:
        """One frame from the client.  Never raises for a bad message: it is answered instead."""
        try:
            msg = P.parse(P.decode(raw))
            await self._dispatch(msg)
        except P.ProtocolError as e:
            await self.reply(P.error(e.code, e.message, e.id))

    async def reply(self, msg: dict[str, Any]) -> None:
        """Queue a control reply, waiting while CONTROL_WINDOW of them are undelivered."""
        await self.outbox.control.acquire()
        self.outbox.put(msg, self.outbox.control.release)

    async def _dispatch(self, msg: Any) -> None:
        if isinstance(msg, P.Hello):
            return await self._hello(msg)
        if not self.greeted:
            raise P.ProtocolError(P.HELLO_REQUIRED, "send 'hello' first", getattr(msg, "id", None))
        if isinstance(msg, P.Generate):
            return await self._generate(msg)
        if isinstance(msg, P.Cancel):
            run = self._live(msg.id)
            if run is not None:
                run.cancelled = True
                run.stop()
            return None
        if isinstance(msg, P.Steer):
            return await self._steer(msg)
        if isinstance(msg, P.Status):
            reply = {
                "type": "status",
                "models": self.models.status(),
                "generations": len(self.runs),
            }
            if msg.id is not None:
                reply["id"] = msg.id
            return await self.reply(reply)
        raise AssertionError(msg)

    async def _hello(self, msg: P.Hello) -> None:
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
        await self.reply(
            {
                "type": "hello",
                "protocol": common[-1],
                "server": "spark-lsp-engine",
                "models": self.models.describe(),
                "capabilities": {
                    "steer": True,
                    "cancel": True,
                    "token_ids": True,
                    "text_prompts": True,
                    "max_message_bytes": P.MAX_MESSAGE_BYTES,
                    "prompt_delta": P.PROMPT_MEMORY,
                    "max_generations": self.max_generations,
                    "params": list(P.PARAM_NAMES),
                },
            }
        )

    async def _generate(self, msg: P.Generate) -> None:
        if self.closing:
            raise P.ProtocolError(P.SHUTTING_DOWN, "the engine service is shutting down", msg.id)
        if msg.id in self.runs or msg.id in self.aliases:
            raise P.ProtocolError(P.DUPLICATE_ID, f"generation {msg.id!r} is still running", msg.id)
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
            raise P.ProtocolError(
                P.UNKNOWN_MODEL,
                f"no model {msg.model!r}; this server has "
                f"{[m['name'] for m in self.models.describe()]}",
                msg.id,
            ) from None
        except (ValueError, ModelError) as e:
            raise P.ProtocolError(P.BAD_PROMPT, str(e), msg.id) from None
        self._remember(msg.id, ids)
        self._start(Run(self, msg.id, msg.model, ids, msg.params, msg.slot))

    def _remember(self, gid: str, ids: list[int]) -> None:
        """Keep a generation's prompt as a base for the deltas of later ones (the latest
        PROMPT_MEMORY of this connection)."""
        self.prompts.pop(gid, None)
        self.prompts[gid] = array("i", ids)
        while len(self.prompts) > P.PROMPT_MEMORY:
            self.prompts.popitem(last=False)

    def _start(self, run: Run) -> None:
        self.runs[run.id] = run
        try:
            run.handle = self.models.start(run.model, run.prompt, run.params, run.slot, run)
        except (ValueError, ModelError) as e:
            del self.runs[run.id]
            self.outbox.put(
                P.done(run.id, "error", {}, error={"code": P.BAD_PROMPT, "message": str(e)})
            )

    def _live(self, gid: str) -> Run | None:
        """The running generation for an id, following steer successors."""
        for _ in range(64):
            nxt = self.aliases.get(gid)
            if nxt is None or nxt not in self.runs:
                break  # no successor, or it has not started yet (its predecessor is stopping)
            gid = nxt
        return self.runs.get(gid)

    # -- steering ------------------------------------------------------------------------------
    async def _steer(self, msg: P.Steer) -> None:
        run = self._live(msg.id)
        if run is None:
            await self.reply(
                P.steer_event(
                    msg.id, msg.steer, P.FAILED, text=msg.text, reason="the generation has ended"
                )
            )
            return
        await self.reply(P.steer_event(run.id, msg.steer, P.ACCEPTED))
        if run.steered:  # stopping already: the text joins the successor's prompt
            run.typed += msg.text
            await self.reply(
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
                self.outbox.put(
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
            self.outbox.put(
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
            self.outbox.put(
                P.done(
                    run.successor_id, "error", {}, error={"code": P.BAD_PROMPT, "message": str(e)}
                )
            )
            return
        succ = Run(self, run.successor_id, run.model, ids, params, run.slot)
        self._start(succ)

    # -- output from the generations (event loop) ----------------------------------------------
    def _on_chunk(self, run: Run, token_id: int, text: str) -> None:
        if run.steered:  # stopped by a steer: what it generates past the divergence is dropped
            run.release()
            return
        run.stream.push(token_id, text)
        if not self.outbox.merge_tokens(run.id, text, [token_id], run.release):
            self.outbox.put(P.tokens(run.id, text, [token_id]), run.release)
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
        self.outbox.put(P.done(run.id, reason, stats, successor=run.successor_id, error=err))
        if run.steered and not (self.closing or run.cancelled):
            self._start_successor(run)
        elif run.steered:  # cancelled while stopping for a steer: the successor never starts
            self.aliases.pop(run.id, None)
            self.outbox.put(P.done(run.successor_id, "cancelled", {}))
        if len(self.aliases) > RECENT_IDS:  # forget the oldest steer chains
            for key in list(self.aliases)[: len(self.aliases) - RECENT_IDS]:
                del self.aliases[key]

    # -- writing -------------------------------------------------------------------------------
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

    async def close(self, drain_s: float = 5.0) -> None:
        """Cancel every generation, deliver their ``done`` messages (up to ``drain_s``), stop."""
        self.closing = True
        for run in list(self.runs.values()):
            run.stop()
        deadline = self.loop.time() + drain_s
        while (
            (self.runs or self.outbox.items)
            and self.loop.time() < deadline
            and not self._sender.done()
        ):
            await asyncio.sleep(0.01)
        self._sender.cancel()
        try:
            await self._sender
        except (asyncio.CancelledError, Exception):
            pass
        for run in list(self.runs.values()):  # still running after drain_s: released from credits
            for _ in range(WINDOW):
                run.release()
