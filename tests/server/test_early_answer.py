"""Early answers: an automatic suggestion not finished by its deadline is answered with its
complete lines or whole words so far, while the generation goes on to the whole suggestion."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from spark_lsp import completions, postprocess
from spark_lsp.completions import AUTOMATIC, INVOKED, EarlyAnswer, TypingThrough
from spark_lsp.prompt import PromptBuilder
from spark_lsp.scheduler import Job
from spark_lsp.settings import Settings


class _Tok:
    """Characters are ids 1000+; no special tokens (a plain left-to-right prompt)."""

    special_tokens: dict = {}
    eos_ids: set = set()

    def token_to_id(self, t):
        return None

    def encode(self, text):
        return [1000 + ord(c) for c in text]


class _Stream:
    def __init__(self, pieces, seen):
        self.pieces, self.seen = pieces, seen
        self.finish_reason, self.stats = None, {"prompt_tokens": 5, "reused_tokens": 4}

    def __iter__(self):
        for p in self.pieces:
            self.seen.append(p)
            yield SimpleNamespace(text=p, token_id=1, logprob=-0.1)
        self.finish_reason = "length"

    def cancel(self):
        pass


class _Model:
    """Writes the given pieces, one chunk per decode step."""

    context = 512

    def __init__(self, pieces):
        self.pieces, self.seen = pieces, []
        self.tokenizer = _Tok()

    def generate(self, ids, params, slot, **kw):
        return _Stream(self.pieces, self.seen)


def _run(model, text, settings, trigger, deadline):
    job = Job("file:///a.py", lambda j: None, asyncio.new_event_loop())
    answers = []
    res = completions.complete(
        model,
        PromptBuilder(_Tok(), heal=False),
        job,
        text,
        len(text),
        settings,
        trigger,
        completions_params,
        answer_at=deadline,
        on_answer=answers.append,
        t0=time.perf_counter(),
    )
    return res, answers


def completions_params(**kw):
    return SimpleNamespace(**kw)


def test_deadline_answers_whole_words_and_the_generation_goes_on():
    settings = Settings(min_confidence=0, multiline=False)
    model = _Model(["total", " =", " add", "(a", ", b", ")"])
    past = time.perf_counter() - 1  # the deadline has passed: answer at the first whole word
    res, answers = _run(model, "x = 1\n", settings, AUTOMATIC, past)
    assert len(answers) == 1
    early = answers[0]
    # "total" could still go on ("totals"): not answered until the next token shows it ended
    assert early.items == ["total ="] and early.stats["answered"] == "words"
    assert early.stats["prompt_tokens"] == 5 and early.stats["answer_ms"] >= 0
    assert res.items == ["total = add(a, b)"]  # the whole suggestion, generated to its end
    assert len(model.seen) == 6


def test_complete_lines_are_answered_after_the_deadline_and_whole_blocks_before_it():
    settings = Settings(min_confidence=0, multiline=True)
    pieces = ["\n    return a\n", "    ", "pass", "\n"]
    text = "def f(a):"
    past = time.perf_counter() - 1
    res, answers = _run(_Model(pieces), text, settings, AUTOMATIC, past)
    assert [a.items for a in answers] == [["\n    return a"]]
    assert answers[0].stats["answered"] == "lines"
    # before its first line is complete, its whole words
    _, answers = _run(_Model(["\n    ", "return", " a", "\n"]), text, settings, AUTOMATIC, past)
    assert [a.items for a in answers] == [["\n    return"]]
    assert res.items[0].startswith("\n    return a")
    # finished before its deadline: only the whole block, no early answer
    res, answers = _run(_Model(pieces), text, settings, AUTOMATIC, time.perf_counter() + 60)
    assert answers == [] and res.items[0].startswith("\n    return a")


def test_invoked_requests_and_no_deadline_get_no_early_answer():
    settings = Settings(min_confidence=0, multiline=False)
    past = time.perf_counter() - 1
    res, answers = _run(_Model(["foo", "(", ")"]), "x = ", settings, INVOKED, past)
    assert answers == [] and res.items[0] == "foo()"
    res, answers = _run(_Model(["foo", "(", ")"]), "x = ", settings, AUTOMATIC, None)
    assert answers == []


def test_partial_rules():
    ctx = postprocess.Context("x = ", "", (), ())
    s = Settings(min_confidence=0)
    e = EarlyAnswer(10.0, ctx, False, s, False, lambda r: None, 0.0)
    assert e.partial("foo(bar", 5.0) is None  # before the deadline
    assert e.partial("foo", 11.0) is None  # only a word that may go on
    assert e.partial("foo(bar", 11.0) == ("foo(", "words")
    assert e.partial("\n  foo\n  bar\n  b", 11.0) == ("\n  foo\n  bar", "lines")
    assert e.partial("\n\n", 11.0) is None


def test_a_first_line_below_the_confidence_gate_is_answered_empty_at_once():
    sent = []
    s = Settings(min_confidence=0.5)
    ctx = postprocess.Context("", "", (), ())
    e = EarlyAnswer(time.perf_counter() + 60, ctx, False, s, True, sent.append, 0.0)
    e.step("fo", -0.1, {})  # likely enough so far, nothing to show yet
    assert sent == []
    e.step("foo bar", -2.0, {})  # below 0.5: the whole line can only be less likely
    assert sent[0].items == [] and sent[0].stats["answered"] == "low confidence"
    e.step("foo bar baz", -3.0, {})
    assert len(sent) == 1  # answered once


def test_typing_through_upgrades_to_the_whole_suggestion_only_if_nothing_newer():
    t = TypingThrough()
    t.remember("u", "ab", 2, ["cd"])
    t.upgrade("u", "ab", 2, ["cd"], ["cdef"])
    assert t.answer("u", "abcd", 4) == ["ef"]
    t.remember("u", "xy", 2, ["z"])  # a newer suggestion was shown
    t.upgrade("u", "ab", 2, ["cdef"], ["cdefgh"])
    assert t.answer("u", "xyz", 3) is None and t.answer("u", "xy", 2) == ["z"]


async def test_served_early_answer_is_completed_for_typing_through(tiny_llama, sample):
    """Through the server: a deadline of 1 ms answers early; once the generation has finished,
    asking again at the same place is answered from the whole suggestion, without the model."""
    from conftest import start_editor

    uri = "file:///early.py"
    client, ed = await start_editor(tiny_llama, {"answerMs": 1, "maxTokens": 48})
    try:
        ed.open(uri, sample)
        early = None
        for line in sample.splitlines(keepends=True):
            off = sample.index(line) + len(line.rstrip("\n"))
            before = (await ed.metrics())["answeredEarly"]
            res = await ed.inline(uri, off)
            if res.items and (await ed.metrics())["answeredEarly"] == before + 1:
                early = res.items[0].insert_text
                break
        assert early is not None, "no suggestion was answered early"
        assert (await ed.metrics())["modelCalls"] >= 1  # counted when shown, not when it ends
        await asyncio.sleep(1.0)  # the generation goes on to its end meanwhile
        calls = (await ed.metrics())["modelCalls"]
        again = await ed.inline(uri, off)
        whole = again.items[0].insert_text
        assert whole.startswith(early) and len(whole) >= len(early)
        assert (await ed.metrics())["modelCalls"] == calls  # typing-through, no model call
        # the status bar heard of the early-answered generation once it ended: its whole
        # stats (tokens written, rate, the engine's time), and when and why it was answered
        told = [s for s in ed.status if s.get("kind") == "completion" and s.get("answered")]
        assert told, ed.status
        last = told[-1]
        assert last["newTokens"] > 0 and last["tokensPerSecond"] > 0
        assert last["answered"] in ("lines", "words", "low confidence") and last["answerMs"] >= 0
        assert last["totalMs"] >= last["ttftMs"] > 0
    finally:
        await client.shutdown_session()
        await client.stop()


def test_answers_when_the_next_token_would_miss_the_deadline():
    """Once the gap between tokens says the next one comes after the deadline, the answer goes
    now rather than a token late."""
    sent = []
    s = Settings(min_confidence=0)
    ctx = postprocess.Context("x = ", "", (), ())
    e = EarlyAnswer(time.perf_counter() + 1.0, ctx, False, s, False, sent.append, 0.0)
    e.step("foo", None, {})
    time.sleep(0.6)
    e.step("foo(bar", None, {})  # the next token would come about 1.2 s in: past the deadline
    assert [r.items for r in sent] == [["foo("]]


async def test_typing_through_an_early_answer_keeps_its_generation():
    """Typing what a suggestion answered early shows (typing-through) does not cancel the
    generation still writing it; typing something else does."""
    from spark_lsp.completions import Inflight
    from spark_lsp.inline import InlineCompletions
    from spark_lsp.status import Metrics

    cancels = []
    state = SimpleNamespace(
        metrics=Metrics(),
        enabled=True,
        edit_running=lambda uri: False,
        cancel=lambda uri, reason, kind=None: cancels.append(reason),
    )
    inline = InlineCompletions(state, lambda uri: True)
    loop = asyncio.get_running_loop()
    job = Job("u", lambda j: None, loop)
    inf = inline.inflight["u"] = Inflight(job, "x = ", 4)
    inf.partial = "foo(bar, baz)"  # the model has written this so far
    inline.typing.remember("u", "x = ", 4, ["foo(bar"])  # answered early with this
    assert await inline.complete("u", "x = f", 5, AUTOMATIC) == ["oo(bar"]
    assert cancels == []  # the user types what the model writes: it goes on
    inline.typing.remember("u", "x = ", 4, ["foo(bar"])
    inf.partial = "bar"
    assert await inline.complete("u", "x = f", 5, AUTOMATIC) == ["oo(bar"]
    assert cancels == ["superseded"]  # the generation went elsewhere: stale


def test_a_request_joining_the_generation_gets_its_own_early_answer():
    """The user typed what the model writes, past what was shown: the joining request is answered
    by the same rules, with items that begin with what was typed and go beyond it."""
    sent, joined, later = [], [], []
    s = Settings(min_confidence=0)
    ctx = postprocess.Context("x = ", "", (), ())
    past = time.perf_counter() - 1
    e = EarlyAnswer(past, ctx, False, s, False, sent.append, 0.0)
    e.step("foo(", None, {})
    assert [r.items for r in sent] == [["foo("]]
    e.join("foo(", past, joined.append)
    e.join("foo(", time.perf_counter() + 60, later.append)  # its deadline is far: it waits
    e.step("foo(bar", None, {})  # "bar" may go on: nothing beyond what was typed yet
    assert joined == []
    e.step("foo(bar, b", None, {})
    assert [r.items for r in joined] == [["foo(bar,"]] and later == []
    e.step("foo(bar, baz", None, {})
    assert len(joined) == 1 and len(sent) == 1  # each answered once


async def test_joining_request_is_answered_before_the_generation_ends():
    from spark_lsp.completions import Inflight
    from spark_lsp.inline import InlineCompletions
    from spark_lsp.status import Metrics

    state = SimpleNamespace(
        metrics=Metrics(),
        enabled=True,
        edit_running=lambda uri: False,
        cancel=lambda uri, reason, kind=None: None,
        settings=Settings(answer_ms=1, min_confidence=0),
    )
    inline = InlineCompletions(state, lambda uri: True)
    job = Job("u", lambda j: None, asyncio.get_running_loop())
    inf = inline.inflight["u"] = Inflight(job, "x = ", 4)
    inf.partial = "foo(bar"
    ctx = postprocess.Context("x = ", "", (), ())
    inf.early = EarlyAnswer(time.perf_counter() - 1, ctx, False, state.settings, False, print, 0)
    inline.typing.remember("u", "x = ", 4, ["fo"])  # what was answered early
    task = asyncio.ensure_future(inline.complete("u", "x = foo(", 8, AUTOMATIC))
    await asyncio.sleep(0.05)
    assert not task.done()  # joined, waiting for whole words beyond what was typed
    inf.early.step("foo(bar, b", None, {})  # the engine thread's next step
    assert await asyncio.wait_for(task, 5) == ["bar,"]
    assert state.metrics.joined == 1 and not job.future.done()  # the generation goes on


def test_empty_chunks_of_a_remote_stream_do_not_count_as_tokens():
    """A remote model's stream yields empty chunks while it waits (every 10 ms): the time
    between tokens is timed between chunks with output, so the answer goes once the next token
    would miss the deadline, not only at the deadline itself."""
    sent = []
    s = Settings(min_confidence=0)
    ctx = postprocess.Context("x = ", "", (), ())
    e = EarlyAnswer(time.perf_counter() + 1.0, ctx, False, s, False, sent.append, 0.0)
    e.step("foo", None, {})
    for _ in range(5):  # polls with nothing new, 0.1 s apart
        time.sleep(0.1)
        e.step("foo", None, {})
    assert e.gap == 0.0 and sent == []
    e.step("foo(bar", None, {})  # 0.5 s after the first token: the next is due at ~1.0 s
    assert [r.items for r in sent] == [["foo("]]


def test_a_late_token_is_not_waited_for_past_the_deadline():
    """When the next token is late, an empty chunk after the deadline answers with what there
    is."""
    sent = []
    s = Settings(min_confidence=0)
    ctx = postprocess.Context("x = ", "", (), ())
    e = EarlyAnswer(time.perf_counter() + 0.3, ctx, False, s, False, sent.append, 0.0)
    e.step("foo", None, {})
    time.sleep(0.05)
    e.step("foo(bar", None, {})  # a token every 0.05 s: the next is due long before 0.3 s
    time.sleep(0.1)
    e.step("foo(bar", None, {})  # a poll: the next token is late, the deadline not yet here
    assert sent == []
    time.sleep(0.25)
    e.step("foo(bar", None, {})  # a poll past the deadline
    assert [r.items for r in sent] == [["foo("]]


async def test_an_early_answer_reports_its_generation_when_it_ends():
    """The status bar hears of an early-answered generation when it ends, with its whole stats
    and how it was answered (the metrics counted it at the answer: not again); one cancelled
    after its answer sends no status."""
    from spark_lsp.completions import Result
    from spark_lsp.inline import InlineCompletions

    sent = []
    state = SimpleNamespace(
        send_status=lambda kind, stats, record=True: sent.append((stats, record))
    )
    inline = InlineCompletions(state, lambda uri: True)
    loop = asyncio.get_running_loop()
    early = {"prompt_tokens": 9, "new_tokens": 0, "answered": "lines", "answer_ms": 41.0}

    finished = Job("u", lambda j: None, loop)
    inline._status_when_done(finished, early)
    assert sent == []  # not yet: the generation is still writing
    finished.future.set_result(Result(["x"], {"prompt_tokens": 9, "new_tokens": 12}))
    await asyncio.sleep(0)
    whole = {"prompt_tokens": 9, "new_tokens": 12, "answered": "lines", "answer_ms": 41.0}
    assert sent == [(whole, False)]

    cancelled = Job("v", lambda j: None, loop)
    inline._status_when_done(cancelled, early)
    cancelled.future.cancel()
    await asyncio.sleep(0)
    assert len(sent) == 1
