"""Inline completion core: context -> prompt -> engine -> cleaned suggestions, plus typing-through.

Engine-facing work (`complete`) runs on the scheduler's engine thread; everything else is cheap and
runs on the event loop. Typing-through keeps the suggestion alive while the user types what it
suggests: no model call, so the answer takes microseconds and the ghost text never flickers.
"""

from __future__ import annotations

import math
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from . import postprocess
from .backends.base import FileChunk, TextPrompt
from .documents import line_at, split_lines
from .prompt import PromptBuilder
from .scheduler import Cancelled, Job
from .settings import Settings

INVOKED, AUTOMATIC = 1, 2
EXTRA_SEEDS = (1, 2)  # sampled alternatives for an Invoked request
ALT_TEMPERATURE = 0.8
SINGLE_LINE_TOKENS = 24  # the rest of a line rarely needs more; bounds the latency of a miss


@dataclass
class Shown:
    """The last suggestion shown for a document: what typing-through answers from."""

    text: str  # document text when it was computed
    offset: int  # cursor offset then
    items: list[str]


@dataclass
class Result:
    items: list[str]
    stats: dict = field(default_factory=dict)
    source: str = "model"  # 'model' | 'typing-through'


LINE_CONTEXT = 4000  # characters of the cursor line kept on each side for post-processing


def context_at(text: str, offset: int, n: int = 6, python: bool = False) -> postprocess.Context:
    before, after = line_at(text, offset)
    line_start = offset - len(before)
    line_end = offset + len(after)
    prev = split_lines(text[max(0, line_start - 2000) : line_start])[:-1]
    nxt = split_lines(text[line_end : line_end + 2000])[1:]
    strip = lambda ls: tuple(x.rstrip("\r\n")[:LINE_CONTEXT] for x in ls)  # noqa: E731
    # of a very long line (minified code) only the part near the cursor: post-processing looks at
    # what is next to the suggestion, and its work must not grow with the line
    if len(before) > LINE_CONTEXT:
        before = before[-LINE_CONTEXT:]
    return postprocess.Context(
        before, after[:LINE_CONTEXT], strip(nxt[:n]), strip(prev[-n:]), python=python
    )


class TypingThrough:
    """Per-document memory of the shown suggestion."""

    def __init__(self) -> None:
        self._shown: dict[str, Shown] = {}

    def remember(self, uri: str, text: str, offset: int, items: list[str]) -> None:
        if items:
            self._shown[uri] = Shown(text, offset, list(items))
        else:
            self._shown.pop(uri, None)

    def forget(self, uri: str) -> None:
        self._shown.pop(uri, None)

    def upgrade(self, uri: str, text: str, offset: int, shown: list[str], items: list[str]) -> None:
        """A suggestion answered early (`shown`) has been finished (`items`): remember the whole
        one, unless another suggestion was remembered for the document since (the answers of
        requests that joined this generation are for the same text and cursor)."""
        s = self._shown.get(uri)
        if (s is None and not shown) or (s is not None and (s.text, s.offset) == (text, offset)):
            self.remember(uri, text, offset, items)

    def answer(self, uri: str, text: str, offset: int) -> list[str] | None:
        """Remaining suggestions if `text` is the remembered text plus typed characters at the
        remembered cursor that match a suggestion, the cursor right after them; else None."""
        s = self._shown.get(uri)
        if s is None:
            return None
        typed_len = offset - s.offset
        if typed_len < 0 or len(text) != len(s.text) + typed_len:
            return None
        if text[offset:] != s.text[s.offset :] or text[: s.offset] != s.text[: s.offset]:
            return None
        typed = text[s.offset : offset]
        rest = []
        for item in s.items:
            if item.startswith(typed) and len(item) > typed_len:
                r = item[typed_len:]
                if r.strip() and r not in rest:
                    rest.append(r)
        return rest or None


class Inflight:
    """A completion being generated for a document, which later keystrokes may join: if the user
    types exactly what the model is writing, the generation is kept and the new request answers
    from it (like typing-through, before the suggestion is even finished)."""

    def __init__(self, job: Job, text: str, offset: int):
        self.job, self.text, self.offset = job, text, offset
        self.partial = (
            ""  # raw output so far of the first generation (written by the engine thread)
        )
        self.waiters = 0  # requests awaiting it; the job is cancelled when the last one is
        self.expect_join = False  # a didChange typed along with it: the next request will join
        self.early: Any = None  # its EarlyAnswer, when it may answer before it is finished
        self.upgrading = False  # its whole suggestion will replace an early one for typing-through

    def typed(self, text: str) -> str | None:
        """The characters inserted at the request's cursor since it started, if nothing else changed."""
        n = len(text) - len(self.text)
        o = self.offset
        if n < 0 or text[:o] != self.text[:o] or text[o + n :] != self.text[o:]:
            return None
        return text[o : o + n]

    def followed_by(self, text: str) -> str | None:
        """`typed` when it matches the output so far, else None."""
        t = self.typed(text)
        return t if t is not None and self.partial.startswith(t) else None


def drive(steps: Any) -> Any:
    """Run a step generator to its end and return its value (outside the scheduler)."""
    try:
        while True:
            next(steps)
    except StopIteration as stop:
        return stop.value


def generate_steps(
    model: Any,
    job: Job,
    ids: list[int],
    params: Any,
    done: Callable[[str], bool] | None = None,
    on_text: Callable[[str], None] | None = None,
    speculative: bool = False,
    draft: str | None = None,
    text_prompt: TextPrompt | None = None,
    on_step: Callable[[str, float | None, dict], None] | None = None,
    steering: Any = None,
):
    """One generation of `model` (a model_host.Model), yielding after every decode step so the
    scheduler can interleave documents; stops early once `done(text)` says the output is
    complete. `text_prompt`: what `ids` encode, for a remote model. `on_step(text, first line's
    log-probability so far or None, the generation's stats so far)` runs after every chunk.
    `steering` (a live edit's `live_edits.Steering`): the stream, steerable when the model is,
    is attached to it while it runs, so the user's typing steers it.
    Returns (text, stats, finish_reason); raises Cancelled if the job was, BackendError if a
    remote model failed."""
    steer = steering is not None and getattr(model, "steerable", False)
    gen = model.generate(
        ids,
        params,
        job.slot,
        cancel=job.token,
        speculative=speculative,
        draft=draft,
        text=text_prompt,
        **({"steerable": True} if steer else {}),
    )
    if steer:
        steering.attach(gen)
    text = ""
    early = False
    line_logprob, line_done = None, False  # the first line's log-probability, when asked for
    try:
        for chunk in gen:
            at = getattr(chunk, "at", None)  # a steer put the output back to the typed text
            text = (text if at is None else text[:at]) + chunk.text
            if getattr(chunk, "logprob", None) is not None and not line_done:
                line_logprob = (line_logprob or 0.0) + chunk.logprob
                line_done = "\n" in text
            if on_text is not None and (chunk.text or at is not None):
                on_text(text)
            if on_step is not None:
                on_step(text, line_logprob, getattr(gen, "stats", None) or {})
            if job.cancelled:
                break
            # done, or the user changed text they typed into a live edit's output: a successor
            # after their text follows (`live_edits.Steering.restarting`)
            if (done is not None and chunk.text and done(text)) or (steer and steering.restarting):
                early = True
                # this generation only: the job goes on (a remote stream's `stop` counts its
                # tokens as used, not wasted)
                getattr(gen, "stop", gen.cancel)()
                break
            yield
        abandon = getattr(gen, "abandon", None) if job.cancelled else None
        if abandon is not None:
            # a remote engine stops on its own: the next job need not wait for it; the cancel
            # latency is timed when the engine says it stopped
            job.stopping = True
            abandon(job.mark_stopped)
        elif job.cancelled or early:
            for _ in gen:  # drain: the engine finishes the cancelled step and releases itself
                pass
    finally:
        if steer:
            steering.detach(gen)
        if not job.stopping:
            job.mark_stopped()
    job.check()
    finish = "stop" if early else str(getattr(gen, "finish_reason", ""))
    if finish == "cancelled":  # stopped by the engine, e.g. another generation took its KV slot
        raise Cancelled("the engine stopped the generation")
    stats = dict(getattr(gen, "stats", {}) or {})
    if line_logprob is not None:
        stats["line_logprob"] = line_logprob
    return text, stats, finish


def generate_text(*args: Any, **kw: Any) -> tuple[str, dict, str]:
    """generate_steps run to its end."""
    return drive(generate_steps(*args, **kw))


def control_ids(builder: Any) -> frozenset[int]:
    """Token ids the engine must stop at before decoding them: the FIM format's stop tokens and
    every special (control) token of the tokenizer, so no "<fim_suffix>" ever becomes text."""
    specials = getattr(builder.tokenizer, "special_tokens", None) or {}
    return frozenset(getattr(getattr(builder, "fim", None), "stop_ids", ()) or ()) | frozenset(
        specials.values()
    )


def prompt_budget(model: Any, context_tokens: int, max_new: int) -> int:
    """Prompt tokens for a generation of `max_new` tokens: the contextTokens setting, within
    what the model holds (prompt and new together)."""
    if not model.context:
        return context_tokens
    return max(16, min(context_tokens, model.context - max_new - 8))


def confidence(line_logprob: float) -> float:
    """A suggestion's confidence: the probability the model gave its first line (the product of
    its tokens' probabilities, the line break that ends it included). A joint probability, so
    a long line must be likely token after token: loops and long guesses score low, which
    `spark-lsp eval`'s gate table shows separates right from wrong suggestions far better than
    the mean token probability does."""
    return math.exp(line_logprob)


_WORD_END = re.compile(r"\w+\Z")


class EarlyAnswer:
    """When a suggestion still being generated may already be answered, and with what.

    An automatic suggestion is answered whole if it is finished by `deadline` (a
    `time.perf_counter` time); once the next token would come after that (the gap between tokens
    so far tells when), at once with the complete lines written so far or,
    before the first line is complete, with its whole words (a word at the very end may go on in
    the next token, so it waits for that). The generation itself goes on: typing along with it,
    or accepting it, gets the rest (`inline.InlineCompletions`). With the confidence gate on, a
    first line already below the threshold is answered at once with nothing: more tokens only
    make the line less likely.

    A later request that joins the generation (the user typed what it writes, past what was
    shown) gets its own answer by the same rules (`join`)."""

    def __init__(
        self,
        deadline: float,
        ctx: postprocess.Context,
        multiline: bool,
        settings: Settings,
        gate: bool,
        send: Callable[[Result], None],
        t0: float,
    ) -> None:
        self.deadline, self.ctx, self.multiline = deadline, ctx, multiline
        self.settings, self.gate, self.send, self.t0 = settings, gate, send, t0
        self.sent = False
        self.last: float | None = None  # when the last chunk with new output came
        self.gap = 0.0  # the time between such chunks (a running mean; 0 until two have come)
        self._text = ""  # the output at the last step
        self._joins: list[tuple[str, float, Callable[[Result], None]]] = []
        self._lock = threading.Lock()  # joins come from the event loop, steps from the engine

    def join(self, typed: str, deadline: float, send: Callable[[Result], None]) -> None:
        """A request whose user has typed `typed` of the output since: `send` it a Result (items
        beginning with `typed` and going beyond it) by the rules above, from the next step on."""
        with self._lock:
            self._joins.append((typed, deadline, send))

    def partial(
        self, text: str, due: float, deadline: float | None = None
    ) -> tuple[str, str] | None:
        """(what may be shown now, why) for the output `text` so far, or None: keep waiting.
        `due`: when the next chunk would come; `deadline`: the request's (default: the first)."""
        if due < (self.deadline if deadline is None else deadline):
            return None
        head = len(text) - len(text.lstrip())
        last = text.rfind("\n")
        if last > head and text[head:last].strip():  # complete lines
            return text[:last], "lines"
        cut = _WORD_END.sub("", text)
        return (cut, "words") if cut.strip() else None

    def step(self, text: str, line_logprob: float | None, stats: dict) -> None:
        """After every chunk of the generation.  A remote model's stream also yields empty
        chunks while it waits for output (so the scheduler can look at cancels): those bring no
        token and leave the time between tokens alone (it would read as the poll interval, and
        every answer would wait until the deadline itself), but let the answer go at the
        deadline when the next token is late."""
        now = time.perf_counter()
        if text != self._text:
            if self.last is not None:
                gap = now - self.last
                self.gap = gap if not self.gap else 0.5 * (self.gap + gap)
            self.last, self._text = now, text
        # when the next token is due (the gap after the last one), or now if that has passed: a
        # stream that waits past the deadline answers then with what it has
        due = max(now, (self.last if self.last is not None else now) + self.gap)
        if self._joins:
            self._step_joins(text, stats, now, due)
        if self.sent:
            return
        if self.gate and line_logprob is not None:
            if confidence(line_logprob) < self.settings.min_confidence:
                self._answer([], stats, "low confidence", now)
                return
        found = self.partial(text, due)
        if found is None:
            return
        item = postprocess.clean(found[0], self.ctx, self.multiline, self.settings.max_lines)
        if item:
            self._answer([item], stats, found[1], now)

    def _step_joins(self, text: str, stats: dict, now: float, due: float) -> None:
        with self._lock:
            joins, self._joins = self._joins, []
        for typed, deadline, send in joins:
            found = self.partial(text, due, deadline)
            item = (
                postprocess.clean(found[0], self.ctx, self.multiline, self.settings.max_lines)
                if found is not None
                else ""
            )
            if item.startswith(typed) and item[len(typed) :].strip():
                ms = (now - self.t0) * 1e3
                send(Result([item], {**stats, "answered": found[1], "answer_ms": ms}))
            else:
                with self._lock:
                    self._joins.append((typed, deadline, send))

    def _answer(self, items: list[str], stats: dict, why: str, now: float) -> None:
        self.sent = True
        ms = (now - self.t0) * 1e3  # the engine's stats so far, and when this answer went
        self.send(Result(items, {**stats, "answered": why, "answer_ms": ms}))


def complete(*args: Any, **kw: Any) -> Result:
    """complete_steps run to its end."""
    return drive(complete_steps(*args, **kw))


def complete_steps(
    model: Any,
    builder: PromptBuilder,
    job: Job,
    text: str,
    offset: int,
    settings: Settings,
    trigger: int,
    params_cls: Any,
    on_partial: Callable[[str], None] | None = None,
    python: bool = False,
    neighbours: Callable[[int, Callable[[str], int]], list] | None = None,
    answer_at: float | None = None,
    on_answer: Callable[[Result], None] | None = None,
    t0: float | None = None,
    on_early: Callable[[EarlyAnswer], None] | None = None,
):
    """Suggestions for the cursor at `offset` (engine thread, a step generator returning a Result);
    `python`: the document is Python (its indentation rules cut multi-line suggestions);
    `neighbours(budget, count)`: other files' chunks within a token budget
    (`spark_lsp.neighbours.Neighbours.select`), put first in the prompt. With `on_answer`, an
    automatic request's first answer may come before the whole suggestion (`EarlyAnswer`, by
    `answer_at`); the Result returned is always the whole one, and `on_early` gets the
    `EarlyAnswer` (requests that join the generation ask it for theirs). `t0`: when the request
    arrived."""
    t0 = time.perf_counter() if t0 is None else t0
    ctx = context_at(text, offset, python=python)
    multiline = settings.multiline and postprocess.choose_multiline(ctx)
    max_new = settings.max_tokens if multiline else min(settings.max_tokens, SINGLE_LINE_TOKENS)
    budget = prompt_budget(model, settings.context_tokens, max_new)  # never overflows the context
    share = min(settings.neighbour_tokens, budget // 2)  # the document keeps at least half
    files = neighbours(share, builder.count_tokens) if neighbours is not None and share > 0 else []
    context = builder.context(files) if files else None
    if context is not None:
        budget -= len(context.head) + len(context.lead)
        prompt = builder.build(text, offset, budget, key=job.slot, context=context)
    else:
        prompt = builder.build(text, offset, budget, key=job.slot)
    stop = (("\n",) if not multiline else ("\n\n\n",)) + builder.stop_strings
    done = (
        (lambda s: postprocess.block_done(s, ctx, settings.max_lines))
        if multiline
        else postprocess.ends_in_loop
    )
    # the text the ids encode (healed part included), for a model that tokenises on its side
    text_prompt = TextPrompt(
        prompt.prefix,
        prompt.suffix if prompt.fim else None,
        extra=tuple(FileChunk(str(p), str(t)) for p, t in files),
    )
    n = 1 + (len(EXTRA_SEEDS) if trigger == INVOKED else 0)
    gate = trigger != INVOKED and settings.min_confidence > 0  # the user asked: always shown
    early = (
        EarlyAnswer(answer_at, ctx, multiline, settings, gate, on_answer, t0)
        if on_answer is not None and answer_at is not None and trigger != INVOKED
        else None
    )
    if early is not None and on_early is not None:
        on_early(early)
    items: list[str] = []
    stats: dict = {}
    for k in range(n):
        if k == 0:
            params = params_cls(
                max_new_tokens=max_new,
                temperature=settings.temperature,
                seed=0 if settings.temperature > 0 else None,
                stop=stop,
                stop_ids=control_ids(builder),
            )
        else:
            params = params_cls(
                max_new_tokens=max_new,
                temperature=max(settings.temperature, ALT_TEMPERATURE),
                top_p=0.95,
                seed=EXTRA_SEEDS[k - 1],
                stop=stop,
                stop_ids=control_ids(builder),
            )
        if (
            prompt.healed
        ):  # the answer starts by re-spelling the partial word; only the rest is emitted
            params = replace(params, healed_prefix=prompt.healed)
        if gate:
            params = replace(params, logprobs=True)
        raw, st, finish = yield from generate_steps(
            model,
            job,
            prompt.ids,
            params,
            done,
            on_text=on_partial if k == 0 else None,
            speculative=settings.speculative,
            text_prompt=text_prompt,
            on_step=early.step if early is not None and k == 0 else None,
        )
        if k == 0:
            stats = {**st, "finish_reason": finish}
        item = postprocess.clean(raw, ctx, multiline, settings.max_lines)
        if gate and "line_logprob" in st:
            stats["confidence"] = confidence(st["line_logprob"])
            if stats["confidence"] < settings.min_confidence:
                item, stats["hidden"] = "", "low confidence"
        if item and item not in items:
            items.append(item)
    stats.update(
        multiline=multiline,
        items=len(items),
        fim=prompt.fim,
        server_ms=(time.perf_counter() - t0) * 1e3,
        prompt_len=len(prompt.ids),
        healed=len(prompt.healed),
        context_tokens=getattr(prompt, "context_tokens", 0),
    )
    return Result(items, stats)
