"""Inline completions as a service: typing-through, joining a running generation, debounce, and
the engine job. Free of any LSP library: handlers pass text and offsets in, get strings back.

Typing-through answers from the suggestion already shown while the user types what it suggests
(no model call). Joining: when the user types exactly what the model is writing, the generation
is kept and the new request answers from it. Each document has at most one generation: a newer
request supersedes the older (`Scheduler.submit`), a didChange that is not typed-along cancels it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from . import completions
from .backends import BackendError
from .completions import AUTOMATIC, INVOKED, Inflight, TypingThrough
from .errors import ContentModified, InvalidParams, RequestCancelled
from .scheduler import Cancelled, Job
from .state import ServerState

JOIN_GRACE_S = 0.25  # how long a generation the user types along with waits for its next request


class InlineCompletions:
    def __init__(self, state: ServerState, is_python: Callable[[str], bool]) -> None:
        self.state = state
        self.is_python = is_python  # whether a document (still open) is Python
        self.typing = TypingThrough()
        self.inflight: dict[str, Inflight] = {}

    async def complete(
        self,
        uri: str,
        text: str,
        offset: int,
        trigger: int,
        selected: tuple[int, int, str] | None = None,
    ) -> list[str]:
        """Suggestions for the cursor at `offset` (one unless the user invoked them).
        `selected`: the completion menu's chosen item (start, end, text), see
        `_complete_selected`."""
        st = self.state
        st.metrics.inline_requests += 1
        t0 = time.perf_counter()
        if not st.enabled or st.edit_running(uri):
            return []  # one generation per document: an edit is running
        try:
            if selected is not None:
                return await self._complete_selected(uri, text, offset, trigger, *selected)
            return await self._complete(uri, text, offset, trigger, t0)
        except asyncio.CancelledError:  # wherever it waited: debounce, model load or the engine
            st.metrics.cancelled += 1
            raise

    async def _complete(
        self, uri: str, text: str, offset: int, trigger: int, t0: float
    ) -> list[str]:
        st = self.state
        through = self.typing.answer(uri, text, offset)
        if through is not None and (trigger == AUTOMATIC or len(through) > 1):
            st.metrics.typing_through += 1
            inf = self.inflight.get(uri)
            if inf is None or inf.job.future.done() or inf.followed_by(text) is None:
                st.cancel(uri, "superseded", kind="completion")  # stale work is useless now
            # else: a suggestion answered early is still being written, and the user types it
            return _shown(through, trigger)
        joined = await self._join(uri, text, offset)
        if joined:
            return _shown(joined, trigger)
        if st.settings.debounce_ms and trigger == AUTOMATIC:
            await asyncio.sleep(st.settings.debounce_ms / 1000)
        items = await self._generate(uri, text, offset, trigger, t0)
        self.typing.remember(uri, text, offset, items)
        return _shown(items, trigger)

    async def _complete_selected(
        self, uri: str, text: str, offset: int, trigger: int, start: int, end: int, selected: str
    ) -> list[str]:
        """The completion menu has `selected` chosen for text[start:end]: suggest as if it were
        accepted; the items extend its text over that range, as the protocol requires."""
        if not start <= offset <= end:
            raise InvalidParams(
                "selectedCompletionInfo.range must be on the cursor's line and contain it"
            )
        new_text = text[:start] + selected + text[end:]
        items = await self._generate(uri, new_text, start + len(selected), trigger)
        return _shown([selected + it for it in items] or [selected], trigger)

    async def _join(self, uri: str, text: str, offset: int) -> list[str] | None:
        """The rest of a running generation's items when the user typed what it is writing."""
        inf = self.inflight.get(uri)
        if inf is None or inf.job.future.done() or inf.job.cancelled:
            return None
        typed = inf.followed_by(text)
        if typed is None or offset != inf.offset + len(typed):
            return None
        inf.expect_join = False
        early: asyncio.Future | None = None
        answer_ms = self.state.settings.answer_ms
        if inf.early is not None and answer_ms > 0:  # answered like a fresh request would be
            early = asyncio.get_running_loop().create_future()
            inf.early.join(
                typed,
                time.perf_counter() + answer_ms / 1000,
                lambda r: inf.job.call_soon(_settle, early, r),
            )
        result = await self._await(uri, inf, early)
        rest = [
            it[len(typed) :] for it in result.items if it.startswith(typed) and len(it) > len(typed)
        ]
        if rest:
            self.state.metrics.joined += 1
            self.typing.remember(uri, inf.text, inf.offset, result.items)
            self._upgrade_when_done(uri, inf)
        return rest or None

    def _upgrade_when_done(self, uri: str, inf: Inflight) -> None:
        """A suggestion answered before it was finished: once it is, typing-through serves the
        whole of it (`TypingThrough.upgrade`)."""
        job = inf.job
        if job.future.done() or inf.upgrading:
            return
        inf.upgrading = True
        job.future.add_done_callback(
            lambda f: (
                f.cancelled()
                or f.exception() is not None
                or self.typing.upgrade(uri, inf.text, inf.offset, [], f.result().items)
            )
        )

    async def _generate(
        self, uri: str, text: str, offset: int, trigger: int, t0: float | None = None
    ) -> list[str]:
        """A fresh completion on the engine thread (joinable while it runs). An automatic one may
        be answered before it is finished (`completions.EarlyAnswer`, the answerMs setting): the
        generation goes on, and its whole suggestion then serves typing-through."""
        st = self.state
        await st.ready()
        host, settings, python = st.host, st.settings, self.is_python(uri)
        st.observe(uri, text, text.count("\n", 0, offset))
        holder: dict = {}
        loop = asyncio.get_running_loop()
        early: asyncio.Future | None = None
        answer_at = None
        if trigger == AUTOMATIC and settings.answer_ms > 0:
            early = loop.create_future()
            answer_at = (t0 or time.perf_counter()) + settings.answer_ms / 1000

        def steps(job: Job):
            return completions.complete_steps(
                host.model,
                host.builder,
                job,
                text,
                offset,
                settings,
                trigger,
                host.params_cls,
                on_partial=lambda s: setattr(holder["inf"], "partial", s),
                python=python,
                neighbours=lambda budget, count: st.neighbours.select(uri, budget, count),
                answer_at=answer_at,
                on_answer=(lambda r: job.call_soon(_settle, early, r)) if early else None,
                t0=t0,
                on_early=lambda e: setattr(holder["inf"], "early", e),
            )

        job = Job(uri, steps, loop, kind="completion")
        inf = holder["inf"] = self.inflight[uri] = Inflight(job, text, offset)
        st.sched().submit(job)
        result = await self._await(uri, inf, early)
        if "answered" in result.stats:  # counted now, as shown; the status bar hears at its end
            st.metrics.record_generation(result.stats)
            self._status_when_done(job, result.stats)
        else:
            st.send_status("completion", result.stats)
        if not job.future.done():  # answered early: the whole suggestion serves typing-through
            st.metrics.answered_early += 1
            self._upgrade_when_done(uri, inf)
        return result.items

    def _status_when_done(self, job: Job, answer: dict) -> None:
        """Tell the status bar about a generation answered early (`answer`: that answer's stats,
        the engine's so far: no tokens counted yet, its time the answer's) once it has ended, with
        the engine's stats for the whole of it and the answer's `answered` and `answer_ms`. The
        metrics counted it when it was answered; one cancelled after its answer (the user typed
        something else) sends no status, as no cancelled generation does."""
        extra = {k: answer[k] for k in ("answered", "answer_ms") if k in answer}

        def done(f: asyncio.Future) -> None:
            if not f.cancelled() and f.exception() is None:
                self.state.send_status("completion", {**f.result().stats, **extra}, record=False)

        job.future.add_done_callback(done)

    async def _await(
        self, uri: str, inf: Inflight, early: asyncio.Future | None = None
    ) -> completions.Result:
        """Await a completion job shared by the requests that joined it, or its `early` answer
        if that comes first; a cancelled request (`$/cancelRequest`) cancels the job only if no
        other request still waits for it."""
        inf.waiters += 1
        try:
            if early is None:
                return await asyncio.shield(inf.job.future)
            done, _ = await asyncio.wait(
                (inf.job.future, early), return_when=asyncio.FIRST_COMPLETED
            )
            return (inf.job.future if inf.job.future in done else early).result()
        except asyncio.CancelledError:
            self._request_cancelled(inf)
            raise
        except Cancelled as exc:
            self.state.metrics.superseded += 1
            if str(exc) == "content modified":
                raise ContentModified(f"{uri} changed while the suggestion was computed") from None
            raise RequestCancelled(f"superseded ({exc})") from None
        except BackendError as exc:
            raise self.state.backend_failed(exc) from None
        except ValueError as exc:
            self.state.metrics.errors += 1
            raise InvalidParams(str(exc)) from None
        finally:
            inf.waiters -= 1
            if inf.job.future.done() and self.inflight.get(uri) is inf:
                del self.inflight[uri]

    def _request_cancelled(self, inf: Inflight) -> None:
        if inf.waiters > 1:
            return
        if inf.expect_join:
            # the user typed what the model is writing; editors cancel the old request before
            # sending the new one that will join, so give it a moment
            asyncio.get_running_loop().call_later(JOIN_GRACE_S, _cancel_unjoined, inf)
        else:
            inf.job.cancel("request cancelled")

    def on_change(self, uri: str, text: str | None) -> None:
        """The document changed (not by our own streamed edit): keep a generation the user types
        along with, cancel any other."""
        inf = self.inflight.get(uri)
        if (
            inf is not None
            and not inf.job.future.done()
            and text is not None
            and inf.followed_by(text) is not None
        ):
            inf.expect_join = True
            return  # the user is typing what the model is writing: keep generating
        self.state.cancel(uri, "content modified", kind="completion")

    def forget(self, uri: str) -> None:
        """The document closed."""
        self.typing.forget(uri)
        self.inflight.pop(uri, None)


def _settle(fut: asyncio.Future, value: object) -> None:
    if not fut.done():
        fut.set_result(value)


def _cancel_unjoined(inf: Inflight) -> None:
    if inf.waiters <= 0 and not inf.job.future.done():
        inf.job.cancel("request cancelled")


def _shown(items: list[str], trigger: int) -> list[str]:
    """All items for an Invoked request, the first for an Automatic one."""
    return items if trigger == INVOKED else items[:1]
