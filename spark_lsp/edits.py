"""Code-action edits as a service: plan, generate on the engine thread, and either return the edit
or stream it into the document live (`live_edits.LiveEdit`), stopped when the user types or
cancels. Free of any LSP library: the editor is reached through `Editor`.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from engine.cancel import CancelToken

from . import actions
from .backends import BackendError
from .completions import prompt_budget
from .documents import Pos, line_ending, minimal_edits, normalize_eol, position_at
from .errors import InvalidParams, RequestCancelled, ServerError
from .live_edits import LiveEdit, Steering
from .scheduler import Cancelled, Job, run_job
from .state import ServerState, edit_key

log = logging.getLogger("spark_lsp")

RangeEdits = list[tuple[Pos, Pos, str]]


@dataclass(frozen=True)
class Target:
    """The document region an action edits, as the handler validated it."""

    uri: str
    text: str
    version: int | None
    start: int
    end: int
    line: int  # the range's first line (the cursor's, for action availability)
    enc: str = "utf-16"  # the negotiated position encoding
    python: bool | None = None  # the document is Python (None: not known, guessed from the text)


class Refused(InvalidParams):
    """The action's result failed the edit checks (after its retry): nothing was applied."""


class Edits:
    def __init__(self, state: ServerState) -> None:
        self.state = state

    @staticmethod
    def available(text: str, start: int, end: int, line: int, only: list[str] | None) -> list[str]:
        """The actions on offer for the range, limited to the kinds in `only` (and sub-kinds)."""
        out = []
        for name in actions.available(text, start, end, line):
            kind = actions.KINDS[name]
            if not only or any(kind == k or kind.startswith(f"{k}.") for k in only):
                out.append(name)
        return out

    async def plan(self, name: str, t: Target, instruction: str | None = None) -> actions.EditPlan:
        """The plan of action `name` on the target; counts the edit."""
        st = self.state
        await st.ready()
        builder = st.host.builder
        try:
            p = actions.plan(
                name,
                t.text,
                t.start,
                t.end,
                t.line,
                st.settings.max_edit_tokens,
                instruction,
                count_tokens=lambda s: len(builder.tokenizer.encode(s)),
                chat=st.host.chat if name == actions.INSTRUCT else None,
                chat_messages=name == actions.INSTRUCT
                and st.host.chat is None
                and bool(getattr(st.host.model, "supports_chat", False)),
                python=t.python,
            )
        except actions.ActionError as exc:
            raise InvalidParams(str(exc)) from None
        if t.uri in st.live:
            raise ServerError(f"an edit is already streaming into {t.uri}; cancel it first")
        st.metrics.edits += 1
        return p

    async def compute(self, t: Target, p: actions.EditPlan) -> RangeEdits:
        """The whole edit at once: minimal edits (positions in the target's text)."""
        region, stats = await self.job(t.uri, p)
        self.state.send_status(f"edit:{p.action}", stats)
        region = normalize_eol(
            region, line_ending(t.text)
        )  # the document's line ending, as streamed edits
        return [
            (position_at(t.text, e.start, t.enc), position_at(t.text, e.end, t.enc), e.new_text)
            for e in minimal_edits(t.text[p.start : p.end], region, base=p.start)
        ]

    async def apply(self, name: str, t: Target, instruction: str | None = None) -> dict:
        """Run action `name` and put its result in the document: streamed live when the liveEdits
        setting is on, else applied as one edit. Returns the outcome for the command's result."""
        p = await self.plan(name, t, instruction)
        if self.state.settings.live_edits:
            return await self.stream(t, p)
        applied = await self.state.editor.apply_edit(t.uri, await self.compute(t, p), None, None)
        return {"outcome": "done" if applied else "rejected", "flushes": 1, "complete": applied}

    async def job(
        self,
        uri: str,
        p: actions.EditPlan,
        on_text=None,
        parent: CancelToken | None = None,
        steering: Steering | None = None,
        lead: str = "",
    ) -> tuple[str, dict]:
        """Generate the plan's region text on the engine thread; `on_text(raw)` sees the output
        so far (on the event loop); cancelling `parent` (a live edit's token) stops it;
        `steering` takes the user's typing to the generation (a live edit's); the output starts
        with `lead` (run_plan_steps)."""
        st = self.state
        host, speculative = st.host, st.settings.speculative
        budget = prompt_budget(host.model, st.settings.context_tokens, p.max_tokens)
        st.cancel(uri, "an edit started", kind="completion")  # one generation per document

        def steps(j: Job):
            feed = (lambda s: j.call_soon(on_text, s)) if on_text else None
            return actions.run_plan_steps(
                host.model,
                host.builder,
                j,
                p,
                host.params_cls,
                budget,
                on_text=feed,
                speculative=speculative,
                lead=lead,
            )

        job = Job(
            edit_key(uri), steps, asyncio.get_running_loop(), kind="edit", slot=uri, parent=parent
        )
        job.steering = steering
        try:
            return await run_job(st.sched(), job)
        except Cancelled as exc:
            raise RequestCancelled(f"edit stopped: {exc}") from None
        except actions.EditRefused as exc:
            # the result would have damaged the code: the user is told why, nothing is applied
            st.editor.show_error(str(exc))
            st.send_status(f"edit:{p.action}", {**exc.stats, "refused": exc.reason})
            raise Refused(str(exc)) from None
        except actions.ActionError as exc:
            raise InvalidParams(str(exc)) from None
        except BackendError as exc:
            raise st.backend_failed(exc) from None

    async def stream(self, t: Target, p: actions.EditPlan) -> dict:
        """Stream the plan's output into the document; returns a summary for the command result."""
        return await _Stream(self, t, p).run()

    def cancel_session(self, session: LiveEdit, reason: str) -> bool:
        """The user cancelled a live edit: stop its generation and every edit it has not sent yet
        (its final write too, when the generation has already finished); False if nothing was left
        to stop."""
        return session.cancel(reason)  # its token is the parent of the edit's engine job

    def cancel(self, uri: str, reason: str) -> int:
        """Stop the completion and the edit of document `uri`; how many were stopped."""
        n = int(self.state.cancel(uri, reason))
        session = self.state.live.get(uri)
        if (
            session is not None
        ):  # also when its generation has finished, its final write not yet sent
            return n + self.cancel_session(session, reason)
        return n + self.state.cancel(edit_key(uri), reason)

    def on_change(self, uri: str, text: str | None, version: int | None) -> bool:
        """Feed a didChange to the live edit of `uri`; True if it was our own edit coming back."""
        session = self.state.live.get(uri)
        return session is not None and text is not None and session.on_did_change(text, version)


#: Successors a live edit starts for typing that came after its generation ended.
LATE_SUCCESSORS = 8


class _Stream:
    """One streamed edit: the generation on the engine thread, flushed into the document at the
    liveEditHz setting, ended by the user typing, a cancel, or a rejected edit."""

    def __init__(self, edits: Edits, t: Target, p: actions.EditPlan) -> None:
        st = self.state = edits.state
        self.edits, self.t, self.p = edits, t, p
        self.key = edit_key(t.uri)
        self.session = LiveEdit(
            t.uri,
            t.text,
            p.start,
            p.end,
            position_at(t.text, p.start, t.enc),
            enc=t.enc,
            version=t.version,
        )
        # the user's typing in the generated text steers the model, when it can be steered and
        # the client refuses our edits made for a text the user has changed since
        model = st.host.model
        if p.steerable and getattr(model, "steerable", False) and st.editor.versioned_edits:
            self.session.steering = Steering()
            self.session.head = len(p.head)
        self.latest: str | None = None
        self.interval = 1.0 / st.settings.live_edit_hz if st.settings.live_edits else None
        self.written_final = False

    async def run(self) -> dict:
        st, session = self.state, self.session
        st.live[self.t.uri] = session
        progress, outcome = None, "done"
        try:
            progress = await st.editor.begin_progress(
                actions.TITLES[self.p.action],
                "writing…",
                cancellable=True,
                on_cancel=lambda: self.edits.cancel_session(session, "progress cancelled"),
            )
            outcome = await self._generate()
        except asyncio.CancelledError:
            st.cancel(self.key, "request cancelled")
            outcome = "cancelled"
            raise
        finally:
            st.live.pop(self.t.uri, None)
            if progress is not None:
                progress.end(outcome)
        if session.stopped_by_user:
            outcome = "stopped by the user"
        # one line per edit in the editor's log: an edit that left the document as it was (the
        # client refused it, the user stopped it) is otherwise silent
        st.editor.log(
            f"{actions.TITLES[self.p.action]}: {outcome} ({session.flushes} flushes"
            f"{', complete' if self.written_final else ''})"
        )
        return {
            "outcome": outcome,
            "flushes": session.flushes,
            "complete": self.written_final,
            "steers": session.steers,  # the user's changes that steered the model
            # generations restarted after the user's text (a change to text typed before, or
            # typing after the generation ended)
            "successors": session.steering.successors if session.steering else 0,
            # why the user's typing stopped the edit instead of steering it, when it could not
            "unsteerable": session.unsteerable if session.stopped_by_user else None,
        }

    async def _generate(self) -> str:
        st, session = self.state, self.session
        lead = ""
        for _ in range(LATE_SUCCESSORS + 1):
            job = self.edits.job(
                self.t.uri,
                self.p,
                on_text=self._on_text,
                parent=session.token,
                steering=session.steering,
                lead=lead,
            )
            task = asyncio.ensure_future(job)
            while not task.done():
                await asyncio.wait([task], timeout=self.interval)
                if session.stopped:  # the user typed or cancelled (its token stopped the job)
                    break
                live = self.interval is not None and self.latest is not None and not task.done()
                steers = session.steers
                if live and not await self._flush(self._shown_output(), False):
                    if await self._steered_since(steers):
                        continue  # refused because the user typed: the next flush follows them
                    st.cancel(self.key, "edit rejected by the client")
                    break
            try:
                region, stats = await task
            except RequestCancelled as exc:
                return "stopped by the user" if session.stopped_by_user else str(exc)
            except Refused as exc:
                # what was streamed is taken back (the document is left exactly as it was),
                # unless the user steered it: what they typed stays
                if not session.stopped and session.typed is None:
                    await self._restore()
                return str(exc)
            typed = session.typed
            head = self.p.head
            # a cancel that came after the generation finished still keeps the final write
            # from happening: what was streamed stays, as when the engine is stopped mid-stream
            if session.cancelled is not None:
                outcome = f"edit stopped: {session.cancelled}"
                break
            if typed is not None and not region.startswith(head + typed):
                if session.steering.take_late():
                    # the user typed after the generation ended, before its last output showed:
                    # a successor continues after their text, as a steer would have
                    lead = typed
                    continue
                outcome = "stopped by the user"  # the result would not keep what they typed
                break
            if session.stopped_by_user:
                outcome = "done"
                break
            steers = session.steers
            self.written_final = await self._flush(region, final=True)
            if not self.written_final and await self._steered_since(steers):
                # refused because the user typed just then: the result, if it keeps their text
                typed = session.typed or ""
                if region.startswith(head + typed):
                    self.written_final = await self._flush(region, final=True)
                elif session.steering.take_late():
                    lead = typed  # else a successor after their text, as above
                    continue
            outcome = "done" if self.written_final else "rejected"
            break
        else:
            outcome = "stopped by the user"  # typing kept outrunning LATE_SUCCESSORS generations
        st.send_status(f"edit:{self.p.action}", stats)
        return outcome

    def _shown_output(self) -> str:
        """The region's text mid-stream: the output so far, or, while the model has not caught
        up with what the user typed into it, their text (never overwritten)."""
        raw, typed = self.latest or "", self.session.typed
        if typed is not None and not raw.startswith(typed):
            raw = typed
        return self.p.region_text(raw, final=False)

    async def _steered_since(self, steers: int, wait_s: float = 0.5) -> bool:
        """Whether the user steered the edit after `steers` steers: an edit the client refused
        because they typed is followed by their didChange (soon, if not already)."""
        if self.session.steering is None:
            return False
        deadline = asyncio.get_running_loop().time() + wait_s
        while self.session.steers == steers and not self.session.stopped:
            if asyncio.get_running_loop().time() > deadline:
                return False
            await asyncio.sleep(0.01)
        return self.session.steers > steers and not self.session.stopped

    def _on_text(self, raw: str) -> None:
        self.latest = raw

    async def _restore(self) -> bool:
        """Put the region's original text back, exactly (no line-ending conversion)."""
        return await self._send(self.session.edits_to(self.session.original))

    async def _flush(self, region: str, final: bool) -> bool:
        """Send the edits that make the region show `region`; False if the client refused them."""
        return await self._send(self.session.edits_to(self.session.frame(region, final)))

    async def _send(self, edits: list) -> bool:
        session = self.session
        if not edits:
            return True
        self.state.metrics.live_flushes += 1
        version = session.version
        # versioned: a client whose document moved on (the user typed) refuses the edit instead of
        # applying it on top of the keystroke
        ok = await self.state.editor.apply_edit(
            self.t.uri,
            [(e.start, e.end, e.new_text) for e in edits],
            version,
            actions.TITLES[self.p.action],
        )
        if not ok:
            session.rejected()
            return False
        session.applied(version)
        return True
