"""Engine-independent server logic: positions, settings, post-processing, prompts, typing-through,
scheduling, live-edit framing and code-action plans."""

from __future__ import annotations

import asyncio
import time

import pytest

from spark_lsp import actions, completions, postprocess
from spark_lsp.documents import (
    Pos,
    PositionError,
    apply_edits,
    minimal_edit,
    minimal_edits,
    offset_at,
    position_at,
    split_lines,
    utf16_len,
)
from spark_lsp.live_edits import LiveEdit, frame
from spark_lsp.model_host import LocalModel
from spark_lsp.prompt import PromptBuilder
from spark_lsp.scheduler import Cancelled, Job, Scheduler, run_job
from spark_lsp.settings import Settings, SettingsError, update


# -- positions ------------------------------------------------------------------------------------
def test_utf16_positions_round_trip():
    text = "a = '😀é'\r\nb = 1\nc"
    assert utf16_len("😀") == 2
    off = offset_at(text, 0, 7)  # after the emoji (2 UTF-16 units) -> code point index 6
    assert text[off] == "é"
    assert position_at(text, off) == Pos(0, 7)
    assert offset_at(text, 1, 0) == text.index("b")
    assert position_at(text, len(text)) == Pos(2, 1)
    # the specification's lenient reading: past the line's end is its end, past the last line the
    # document's end; only negative or non-integer values are invalid
    assert offset_at(text, 0, 99) == text.index("\r") and offset_at(text, 5, 0) == len(text)
    for bad in ((-1, 0), (0, -1), (0, 1.5), (True, 0), ("1", 0)):
        with pytest.raises(PositionError):
            offset_at(text, *bad)
    # the fast path (no "\r" in the text) agrees with the general one
    plain = "a\nbc😀\n\nd"
    for line, ch in ((0, 1), (1, 2), (1, 4), (2, 0), (3, 1)):
        assert offset_at(plain, line, ch) == offset_at(plain, line, ch, lines=split_lines(plain))
    for line, ch in ((4, 0), (1, 5), (2, 1), (3, 2)):
        assert offset_at(plain, line, ch) == offset_at(plain, line, ch, lines=split_lines(plain))


def test_minimal_edits_touch_only_changed_lines():
    old = "def f(x):\n    y = x + 1\n    return y\n"
    new = "def f(x):\n    y = x + 2\n    return y\n"
    e = minimal_edit(old, new)
    assert (e.start, e.end, e.new_text) == (old.index("1"), old.index("1") + 1, "2")
    edits = minimal_edits(old + "\n# tail\n", new + "\n# tail changed\n")
    assert len(edits) == 2 and apply_edits(old + "\n# tail\n", edits) == new + "\n# tail changed\n"
    assert minimal_edits("same", "same") == []
    assert split_lines("a\nb") == ["a\n", "b"] and split_lines("a\n") == ["a\n", ""]


# -- settings -------------------------------------------------------------------------------------
def test_settings_validate_and_name_the_field():
    s, warnings = update(
        Settings(), {"spark": {"maxTokens": 32, "liveEdits": False, "waferRegion": "4x8"}}
    )
    assert (s.max_tokens, s.live_edits, s.wafer_region) == (32, False, (4, 8)) and not warnings
    renamed, warnings = update(
        s, {"waferGrid": [2, 3]}
    )  # its former name still works, with a warning
    assert (
        renamed.wafer_region == (2, 3) and "'waferGrid' is now called 'waferRegion'" in warnings[0]
    )
    assert update(s, {"max_tokens": 7})[0].max_tokens == 7
    assert (
        Settings().precision == "auto" and update(s, {"precision": "int8"})[0].precision == "int8"
    )
    assert "ignored unknown setting" in update(s, {"colour": 1})[1][0]
    for bad, name in (
        ({"maxTokens": -1}, "maxTokens"),
        ({"temperature": "hot"}, "temperature"),
        ({"liveEdits": 1}, "liveEdits"),
        ({"waferGrid": [0, 2]}, "waferGrid"),
        ({"contextTokens": 1.5}, "contextTokens"),
        ({"precision": "fp8"}, "precision"),
    ):
        with pytest.raises(SettingsError, match=name):
            update(s, bad)
    with pytest.raises(SettingsError):
        update(s, [1, 2])


# -- post-processing ------------------------------------------------------------------------------
def ctx(before, after="", nxt=(), prev=()):
    return postprocess.Context(before, after, tuple(nxt), tuple(prev))


def test_single_line_drops_suffix_repeat_and_unmatched_closer():
    c = ctx("    total = compute(", ")")
    assert not postprocess.choose_multiline(c)
    assert postprocess.clean("a, b)", c, multiline=False) == "a, b"
    assert postprocess.clean("a, b)\nmore", c, multiline=False) == "a, b"
    c2 = ctx("    x = [1, 2", "]")
    assert postprocess.clean(", 3]", c2, multiline=False) == ", 3"
    # a closer that matches nothing on the line is cut
    assert postprocess.clean("1 + 2) * 3", ctx("y = "), multiline=False) == "1 + 2"
    # brackets opened and closed inside the suggestion are kept
    assert postprocess.clean("f(a)[0]  ", ctx("y = "), multiline=False) == "f(a)[0]"


def test_multiline_stops_at_block_end_and_at_next_line_repeat():
    c = ctx("def add(a, b):", "", nxt=("", "def main():"), prev=("import os",))
    assert postprocess.choose_multiline(c)
    raw = "\n    s = a + b\n    return s\n\ndef other():\n    pass\n"
    assert postprocess.clean(raw, c, multiline=True) == "\n    s = a + b\n    return s"
    assert postprocess.block_done(raw, c, 12)
    assert not postprocess.block_done("\n    s = a + b\n", c, 12)
    c2 = ctx("    ", "", nxt=("    return y",), prev=("def f(x):",))
    assert postprocess.choose_multiline(c2)
    assert postprocess.clean("y = x * 2\n    return y\n", c2, multiline=True) == "y = x * 2"
    assert postprocess.clean("   \n\n", c2, multiline=True) == ""


def test_python_block_stops_at_an_unexpected_indent():
    py = postprocess.Context("    ", "", (), ("def test_scale():",), python=True)
    raw = "n = 1\n        for item in items:\n            pass\n"
    assert (
        postprocess.clean(raw, py, multiline=True) == "n = 1"
    )  # the deeper `for` is a syntax error
    # deeper lines that Python allows: after a colon, inside brackets, a backslash or a docstring
    ok = (
        "if n:\n        total = f(a,\n              b)\n        x = 1 + \\\n            2\n"
        '        s = """doc\n              more"""\n        return s'
    )
    assert postprocess.clean(ok, py, multiline=True) == ok
    # other languages indent continuations freely: the rule is Python's only
    js = postprocess.Context("    ", "", (), ("function f() {",))
    assert (
        postprocess.clean("items\n        .map(g)\n", js, multiline=True)
        == "items\n        .map(g)"
    )
    assert postprocess.clean("n = 1\n        for x in y:", py, multiline=True) == "n = 1"
    # a "#" inside a string is not a comment: the colon after it still opens the block
    hashed = 'if c == "#":\n        skip()'
    assert postprocess.clean(hashed, py, multiline=True) == hashed
    # a bracket opened on an earlier line may be closed by the suggestion (arguments over lines),
    # also when the lines before start with a docstring's closing quotes
    call = postprocess.Context(
        "        refold_binar",
        "",
        (),
        ('        """', "        folded = self._fold(name,"),
        python=True,
    )
    assert postprocess.clean("y=False)", call, multiline=False) == "y=False)"
    assert postprocess.clean("y=False))", call, multiline=False) == "y=False)"
    # brackets in a docstring's prose are text, on every line of it, not unmatched closers
    doc = '"""Sum the values.\n\n        Values may be negative :) or empty.\n        """\n        return sum(values)'
    assert postprocess.clean(doc, py, multiline=True) == doc


def test_loops_are_kept_once_and_stop_generation():
    py = postprocess.Context("    ", "", (), ("def f():",), python=True)
    # a line repeated (at any indentation) four times is kept once, a run of lines three times too
    raw = "self._items = []\n    self._items = []\n    self._items = []\n    self._items = []\n"
    assert postprocess.clean(raw, py, multiline=True) == "self._items = []"
    assert (
        postprocess.clean("a = 1\n    b = 2\n" * 3 + "    c = 3", py, multiline=True)
        == "a = 1\n    b = 2"
    )
    # a phrase looping inside a line: the text before its first repeat stays
    line = "Return the average of values of values of values of values of values"
    assert (
        postprocess.clean(line, postprocess.Context("", ""), multiline=False)
        == "Return the average of values"
    )
    assert postprocess.cut_loops('"""' + line + "\n    more") == '"""Return the average of values'
    # repetition that is code, not a loop: one word or none, or too few repeats
    for ok in (
        "x = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0]",
        "# " + "-" * 40,
        "f(a, b) + f(a, b) + f(a, b)",
        "if a:\n        f()\n    }\n  }\n}",
        "next(f)\nnext(f)\nx = 1",
    ):
        assert postprocess.cut_loops(ok) == ok
        assert not postprocess.ends_in_loop(ok)
    assert (
        postprocess.clean(
            "x = [0, 0, 0, 0, 0, 0, 0, 0]", postprocess.Context("", ""), multiline=False
        )
        == "x = [0, 0, 0, 0, 0, 0, 0, 0]"
    )
    # streaming: generation stops as soon as a loop completes, not before
    assert postprocess.ends_in_loop("the bunch of " * 4) and not postprocess.ends_in_loop(
        "the bunch of " * 3
    )
    assert postprocess.block_done("n = 1\n    n = 1\n    n = 1\n    n = 1\n", py, 12)
    assert not postprocess.block_done(
        "n = 1\n    n = 1\n    n = 1\n", py, 12
    )  # tests repeat a line thrice
    assert postprocess.block_done("a()\n    b()\n" * 3, py, 12)
    # code actions stop at loops too; a rewrite cut short by one is not the whole rewrite: refused
    p = actions.plan(actions.REWRITE, "x = 1\ny = 2\n", 0, 6, 0, 64)
    with pytest.raises(actions.ActionError, match="loop"):
        p.finish("x = 1\nx = 1\nx = 1\nx = 1\n")
    assert p.judge("x = 1\nx = 1\nx = 1\nx = 1\n")[1].startswith(
        "the model's rewrite went into a loop"
    )
    assert actions.generated_is_done(p, "x = 1\nx = 1\nx = 1\nx = 1\n")


# -- typing through -------------------------------------------------------------------------------
def test_typing_through_serves_the_rest_of_the_suggestion():
    tt = completions.TypingThrough()
    text = "x = foo(\nz = 1\n"
    off = text.index("(") + 1
    tt.remember("u", text, off, ["a, b)", "c)"])
    typed = text[:off] + "a, " + text[off:]
    assert tt.answer("u", typed, off + 3) == ["b)"]
    assert tt.answer("u", text[:off] + "q" + text[off:], off + 1) is None  # diverged
    assert tt.answer("u", typed + "#", off + 3) is None  # other edit too
    assert tt.answer("u", text[:off] + "a, b)" + text[off:], off + 5) is None  # fully typed
    assert tt.answer("other", typed, off + 3) is None


# -- prompts --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    from engine.tokenizer import Tokenizer

    return Tokenizer.load(tiny_llama)


def test_prompt_is_spm_and_stable_while_typing(tokenizer):
    b = PromptBuilder(tokenizer)
    assert b.fim is not None and b.spm
    body = "".join(f"def f{i}(x):\n    return x + {i}\n\n" for i in range(200))
    text = body + "def g(y):\n    ret\n\nprint(g(1))\n"
    off = text.rindex("    ret") + len("    ret")
    p1 = b.build(text, off, 256, key="doc")
    assert p1.ids[0] == tokenizer.fim.suffix_id and p1.ids[-1] == tokenizer.fim.middle_id
    assert p1.suffix.startswith("\n\nprint(g(1))") and p1.prefix.endswith("    ret")
    assert len(p1.ids) <= 256 + 8
    text2 = text[:off] + "u" + text[off:]
    p2 = b.build(text2, off + 1, 256, key="doc")
    assert p2.prefix_start == p1.prefix_start > 0  # anchored window
    # (token healing may leave both prompts equal: the typed word is generated, not prompted)
    common = next(
        (i for i, (x, y) in enumerate(zip(p1.ids, p2.ids)) if x != y), min(len(p1.ids), len(p2.ids))
    )
    assert common >= len(p1.ids) - 4  # only the tail re-prefills


def test_build_parts_keeps_text_near_the_middle(tokenizer):
    b = PromptBuilder(tokenizer)
    prefix = "".join(f"line_{i} = {i}\n" for i in range(500))
    ids = b.build_parts(prefix, "after = 1\n" * 300, 200)
    assert len(ids) <= 200 + 8
    assert tokenizer.decode(ids).count("line_499") == 1 and "line_0 " not in tokenizer.decode(ids)


def test_build_parts_healed_heals_only_a_final_line_break(tokenizer):
    b = PromptBuilder(tokenizer)
    prefix, suffix = "class A:\n    def f(self):\n", "\n\nx = 1\n"
    ids, healed = b.build_parts_healed(prefix, suffix, 200)
    assert healed == "\n" and ids == b.build_parts(prefix[:-1], suffix, 200)
    assert b.build_parts_healed("x = values.app", suffix, 200) == (
        b.build_parts("x = values.app", suffix, 200),
        "",
    )
    assert PromptBuilder(tokenizer, heal=False).build_parts_healed(prefix, suffix, 200) == (
        b.build_parts(prefix, suffix, 200),
        "",
    )


# -- live edits -----------------------------------------------------------------------------------
def test_live_edit_frames_and_recognises_its_own_changes():
    original = "a = 1\nb = 2\nc = 3\n"
    assert frame(original, "A = 1\nB", final=False) == "A = 1\nB\nc = 3\n"
    assert frame(original, "A = 1\n", final=False) == "A = 1\nb = 2\nc = 3\n"
    assert frame(original, "A = 1\n", final=True) == "A = 1\n"
    # a partial line past the original's last line keeps the region's final line break, so an
    # edit interrupted there does not join it with the line after the region
    assert frame(original, "A = 1\nB = 2\nC", final=False) == "A = 1\nB = 2\nC\n"
    assert frame(original, "A = 1\nB = 2\nC = 3\nD", final=False) == "A = 1\nB = 2\nC = 3\nD\n"
    assert frame("a = 1", "A", final=False) == "A"  # a region without a final break gets none
    doc = "# head\n" + original + "# tail\n"
    s = LiveEdit("u", doc, 7, 7 + len(original), Pos(1, 0))
    job = s.token.child()  # the edit's engine job
    (e,) = s.edits_to(frame(original, "A = 1\nB", final=False))
    assert e.start == Pos(1, 0) and e.end.line == 2 and e.new_text.startswith("A")
    ours = "# head\nA = 1\nB\nc = 3\n# tail\n"
    assert s.on_did_change(ours) and not job.cancelled
    assert not s.on_did_change(ours + "typed") and s.stopped_by_user
    assert job.cancelled and job.reason == "user typed"  # the user's change stops the engine


# -- code-action plans ----------------------------------------------------------------------------
SRC = "import os\n\n\ndef add(a, b):\n    return a + b\n\n\ndef main():\n    print(add(1, 2))\n"


def test_action_plans():
    line = SRC.splitlines().index("    return a + b")
    names = actions.available(SRC, 0, 0, line)
    assert {actions.DOCSTRING, actions.TEST, actions.COMPLETE, actions.INSTRUCT} <= set(names)
    assert actions.REWRITE not in names
    d = actions.plan(actions.DOCSTRING, SRC, 0, 0, line, 100)
    at = SRC.index("    return a + b")
    assert d.start == d.end == at and d.prefix.endswith('def add(a, b):\n    """')
    assert d.region_text('Add two numbers."""junk', final=True) == '    """Add two numbers."""\n'
    t = actions.plan(actions.TEST, SRC, 0, 0, line, 100)
    assert t.start == len(SRC) and t.prefix.endswith("def test_add():\n    ")
    assert t.region_text("assert add(1, 2) == 3\n\n\nprint()", final=True).endswith(
        "    assert add(1, 2) == 3\n"
    )
    s, e = SRC.index("def main"), len(SRC)
    i = actions.plan(actions.INSTRUCT, SRC, s, e, 7, 100, instruction="print the sum twice")
    assert i.prefix.endswith("# print the sum twice\n") and i.suffix == ""
    with pytest.raises(actions.ActionError, match="instruction"):
        actions.plan(actions.INSTRUCT, SRC, s, e, 7, 100, instruction=" ")
    with pytest.raises(actions.ActionError):
        actions.plan(actions.DOCSTRING, "x = 1\n", 0, 0, 0, 100)


def test_empty_docstring_is_asked_again_starting_on_the_next_line(monkeypatch):
    """A model that closes the quotes at once gets a second pass, made to start a summary line."""
    from engine import GenerationParams

    line = SRC.splitlines().index("    return a + b")
    d = actions.plan(actions.DOCSTRING, SRC, 0, 0, line, 100)

    def scripted(*outputs):
        leads = []

        def fake_generate(
            model,
            job,
            ids,
            params,
            done=None,
            on_text=None,
            speculative=False,
            draft=None,
            text_prompt=None,
        ):
            leads.append(params.healed_prefix)  # generated but not emitted: the runner puts it back
            text = outputs[min(len(leads), len(outputs)) - 1]
            if on_text is not None:
                on_text(text)
            return text, {"new_tokens": 3}, "stop"
            yield  # a step generator

        monkeypatch.setattr(completions, "generate_steps", fake_generate)
        return leads

    class Builder:
        stop_strings = ()

        def build_parts_healed(self, prefix, suffix, budget):
            return [1, 2, 3], ""

        def fit_parts(self, prefix, suffix, budget):
            return prefix, suffix

    monkeypatch.setattr(completions, "control_ids", lambda b: frozenset())
    leads, streamed = scripted(" ", "Add two numbers.\n    "), []
    region, stats = actions.run_plan(
        None, Builder(), None, d, GenerationParams, 256, on_text=streamed.append
    )
    assert leads == ["", "\n    "]
    assert region == '    """\n    Add two numbers.\n    """\n'
    assert streamed[-1] == "\n    Add two numbers.\n    " and stats["finish_reason"] == "stop"
    # A docstring written on the first pass is not asked again.
    leads = scripted("Add two numbers.")
    assert (
        actions.run_plan(None, Builder(), None, d, GenerationParams, 256)[0]
        == '    """Add two numbers."""\n'
    )
    assert leads == [""]
    # Still empty after the second pass: the clear error, no third pass.
    leads = scripted(" ", "")
    with pytest.raises(actions.ActionError, match="empty docstring"):
        actions.run_plan(None, Builder(), None, d, GenerationParams, 256)
    assert len(leads) == 2
    assert (
        actions.plan(actions.TEST, SRC, 0, 0, line, 100).retry_lead == ""
    )  # other plans never retry


# -- scheduler ------------------------------------------------------------------------------------
class FakeGen:
    """A generation that yields a token every `step` seconds until cancelled (tests only)."""

    def __init__(self, token, n=1000, step=0.002):
        self.n, self.step, self.token = n, step, token

    def __iter__(self):
        for _ in range(self.n):
            if self.token.cancelled:
                return
            time.sleep(self.step)
            yield type("C", (), {"text": "x", "token_id": 1})()


def _long_job(job):
    gen = FakeGen(job.token.child())
    for _ in gen:
        job.check()
    job.mark_stopped()
    return "done"


async def test_scheduler_supersedes_cancels_and_is_fair():
    loop = asyncio.get_running_loop()
    sched = Scheduler()
    try:
        first = Job("a", _long_job, loop)
        sched.submit(first)
        await asyncio.sleep(0.05)
        second = Job("a", lambda j: "second", loop)
        sched.submit(second)  # supersedes the running one
        with pytest.raises(Cancelled, match="superseded"):
            await first.future
        assert await second.future == "second"
        assert sched.cancel_latencies_ms  # the stop was timed

        order = []
        jobs = [
            Job(k, (lambda k: lambda j: order.append(k))(k), loop) for k in ("x", "y", "x", "z")
        ]
        blocker = Job("b", lambda j: time.sleep(0.05), loop)
        sched.submit(blocker)
        for j in jobs:
            sched.submit(j)
        await asyncio.gather(blocker.future, *[j.future for j in jobs[1:]])
        assert order == ["y", "x", "z"]  # the second "x" replaced the first; FIFO across docs

        # cancelling the awaiting task (a $/cancelRequest) stops the engine work
        job = Job("c", _long_job, loop)
        task = asyncio.ensure_future(run_job(sched, job))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(100):
            if job.t_stopped:
                break
            await asyncio.sleep(0.01)
        assert job.cancelled and job.t_stopped is not None
    finally:
        sched.shutdown()


class _RemoteStream:
    """A stream of a remote engine (as `backends.engine_ws.EngineStream`): after a cancel the
    engine stops on its own, and says so later (`stopped()`, its `done` arriving)."""

    def __init__(self, token):
        self.token, self.drained, self.on_stopped = token, False, None
        self.finish_reason, self.stats = None, {}

    def __iter__(self):
        return self

    def __next__(self):
        if self.token.cancelled:  # reading on would wait for the engine's `done`
            self.drained = True
            raise StopIteration
        time.sleep(0.002)
        return type("C", (), {"text": "x", "token_id": 1})()

    def abandon(self, on_stopped):
        self.on_stopped = on_stopped


async def test_a_cancelled_remote_stream_is_not_waited_for_and_its_stop_is_timed_later():
    """The next job starts without waiting for a cancelled remote generation's `done`; the
    cancel latency is recorded when that `done` comes, measured to it."""
    import threading

    loop = asyncio.get_running_loop()
    sched = Scheduler()
    streams = []

    class Remote:
        def generate(self, ids, params, slot, cancel, **kw):
            streams.append(_RemoteStream(cancel))
            return streams[-1]

    try:
        first = Job("a", lambda j: completions.generate_steps(Remote(), j, [1], None), loop)
        sched.submit(first)
        await asyncio.sleep(0.05)
        second = Job("a", lambda j: "second", loop)
        sched.submit(second)  # supersedes the running one
        with pytest.raises(Cancelled, match="superseded"):
            await first.future
        assert await second.future == "second"
        (stream,) = streams
        assert not stream.drained and stream.on_stopped is not None and first.stopping
        assert not sched.cancel_latencies_ms and first.t_stopped is None  # not stopped yet
        time.sleep(0.03)
        threading.Thread(target=stream.on_stopped).start()  # the `done`, on the reader thread
        for _ in range(200):
            if sched.cancel_latencies_ms:
                break
            await asyncio.sleep(0.005)
        (latency,) = sched.cancel_latencies_ms
        assert latency >= 30 and first.t_stopped is not None
    finally:
        sched.shutdown()


async def test_a_stop_time_the_engine_reports_is_used_when_it_is_this_cancels():
    """A daemon on this machine says when its engine stopped (`ended_at`, on the same clock):
    the cancel latency is measured to that, not to its `done` arriving; a time outside the
    cancel's span (another clock) is not used."""
    loop = asyncio.get_running_loop()

    def cancelled_job():
        job = Job("a", lambda j: None, loop)
        job.cancel()
        return job

    job = cancelled_job()
    at = job.t_cancel + 0.001
    time.sleep(0.02)
    job.mark_stopped(at)
    assert job.t_stopped == at
    for wrong in (job.t_cancel - 5.0, time.perf_counter() + 5.0):
        job = cancelled_job()
        job.mark_stopped(wrong)
        assert job.t_stopped != wrong and job.t_stopped >= job.t_cancel


# -- chat-template instruction edits --------------------------------------------------------------
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_chat_prompt_and_code_extraction():
    pytest.importorskip("jinja2")

    from spark_lsp import chat

    settings = {"chat_template": CHATML, "eos_token": "<|im_end|>"}
    assert chat.load_chat_template(settings, "coder-base", has_fim=True) is None  # base FIM model
    tpl = chat.load_chat_template(settings, "coder-instruct", has_fim=True)
    assert tpl is not None
    p = actions.plan(
        actions.INSTRUCT,
        SRC,
        SRC.index("def main"),
        len(SRC),
        7,
        200,
        instruction="print twice",
        chat=tpl,
    )
    assert p.prompt_text.startswith("<|im_start|>system\n") and p.prompt_text.endswith(
        "<|im_start|>assistant\n"
    )
    assert "print twice" in p.prompt_text and "def main():" in p.prompt_text
    reply = "```python\ndef main():\n    print(add(1, 2))\n    print(add(1, 2))\n```\nDone."
    assert (
        p.region_text(reply, final=True)
        == "def main():\n    print(add(1, 2))\n    print(add(1, 2))\n"
    )
    assert p.region_text("```python\ndef ma", final=False) == "def ma"
    assert p.region_text("``", final=False) == ""
    assert p.done(reply) and not p.done("```python\ndef")
    assert chat.extract_code("x = 1\n", final=True) == "x = 1\n"


def test_inflight_is_joined_only_by_typing_what_the_model_writes():
    inf = completions.Inflight(job=None, text="x = foo(\nz = 1\n", offset=8)
    inf.partial = "a, b)"
    typed = "x = foo(a,\nz = 1\n"
    assert inf.typed(typed) == "a," and inf.followed_by(typed) == "a,"
    assert inf.followed_by("x = foo(q\nz = 1\n") is None  # not what the model writes
    assert inf.followed_by("x = foo(a,\nz = 2\n") is None  # another change elsewhere
    assert inf.followed_by("x = foo(a, b) + 1\nz = 1\n") is None  # ahead of the output so far
    assert inf.typed("x = foo\nz = 1\n") is None  # deletion


def test_utf8_and_utf32_position_encodings():
    text = "s = 'é😀'\nt = 1\n"
    assert (
        utf16_len("é😀", "utf-8") == 6 and utf16_len("é😀", "utf-32") == 2 and utf16_len("é😀") == 3
    )
    end8 = offset_at(text, 0, 12, enc="utf-8")
    assert (
        text[end8 - 1] == "'"
        and end8 == offset_at(text, 0, 9) == offset_at(text, 0, 8, enc="utf-32") == 8
    )
    assert position_at(text, end8, "utf-8") == Pos(0, 12) and position_at(
        text, end8, "utf-32"
    ) == Pos(0, 8)
    assert offset_at(text, 0, 10) == 8  # past the end in UTF-16 units (its end), inside in UTF-8


def test_speculative_completions_and_rewrites_match_plain_greedy(tiny_llama):
    from engine import Engine, GenerationParams

    eng = Engine.load(tiny_llama, slots=2)
    builder = PromptBuilder(eng.tokenizer)
    loop = asyncio.new_event_loop()
    try:
        src = SRC * 3
        for off in (src.index("print(") + 6, src.index("return a + b") + 7, len(src)):
            out = []
            for spec in (False, True):
                job = Job(f"doc-{spec}", lambda j: None, loop)
                settings = Settings(
                    speculative=spec, max_tokens=24, context_tokens=256, min_confidence=0.0
                )
                out.append(
                    completions.complete(
                        LocalModel(eng),
                        builder,
                        job,
                        src,
                        off,
                        settings,
                        completions.AUTOMATIC,
                        GenerationParams,
                    ).items
                )
            assert out[0] == out[1]
        p = actions.plan(actions.REWRITE, src, src.index("def main"), len(src), 0, 64)
        texts = []
        for spec in (False, True):
            job = Job(f"edit-{spec}", lambda j: None, loop)
            try:  # a random model's rewrite is usually refused by the checks: the same way both times
                texts.append(
                    actions.run_plan(
                        LocalModel(eng), builder, job, p, GenerationParams, 256, speculative=spec
                    )[0]
                )
            except actions.ActionError as exc:
                texts.append(str(exc))
        assert texts[0] == texts[1]
    finally:
        loop.close()


async def test_generator_jobs_take_turns_step_by_step():
    loop = asyncio.get_running_loop()
    sched = Scheduler()
    trace = []

    def steps(name, n):
        def fn(job):
            for _ in range(n):
                trace.append(name)
                time.sleep(0.001)  # a decode step
                yield
            return name

        return fn

    try:
        long = Job("edit", steps("E", 200), loop, kind="edit")
        sched.submit(long)
        await asyncio.sleep(0.01)
        short = Job("other-doc", steps("C", 3), loop)
        sched.submit(short)
        assert await short.future == "C"
        assert await long.future == "E"
        first_c = trace.index("C")
        # the short job did not wait for the long one to finish, and they alternated
        assert first_c < len(trace) - 3 and trace[first_c : first_c + 6].count("C") == 3
        # a job superseding a running generator job of the same key waits for it to stop
        old = Job("doc", steps("O", 10_000), loop)
        sched.submit(old)
        await asyncio.sleep(0.01)
        new = Job("doc", steps("N", 2), loop)
        sched.submit(new)
        with pytest.raises(Cancelled):
            await old.future
        assert await new.future == "N"
        assert trace[-2:] == ["N", "N"]
    finally:
        sched.shutdown()


class _VocabTokenizer:
    """A stand-in tokenizer with a given set of special tokens (characters are ids 1000+)."""

    def __init__(self, specials):
        self.specials = {t: i for i, t in enumerate(specials)}
        self.eos_ids = {self.specials.get("<|endoftext|>", 0)}

    def token_to_id(self, t):
        return self.specials.get(t)

    def id_to_token(self, i):
        return next((t for t, j in self.specials.items() if j == i), None)

    def encode(self, text):
        return [1000 + ord(c) for c in text]


@pytest.mark.parametrize(
    "specials, spm",
    [
        (
            ["<|endoftext|>", "<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<file_sep>"],
            True,
        ),  # ours / StarCoder
        (
            ["<|endoftext|>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>"],
            False,
        ),  # Qwen2.5-Coder
        (["</s>", "▁<PRE>", "▁<MID>", "▁<SUF>", "▁<EOT>"], False),  # CodeLlama
    ],
)
def test_fim_layout_follows_the_tokenizer(specials, spm):
    tok = _VocabTokenizer(specials)
    b = PromptBuilder(tok)
    assert b.fim is not None and b.spm is spm
    p = b.build("ab\ncd\n", 4, 100)
    pre, suf, mid = (
        tok.token_to_id(specials[1]),
        tok.token_to_id(specials[3]),
        tok.token_to_id(specials[2]),
    )
    enc = tok.encode
    if spm:
        assert p.ids == [suf, *enc("d\n"), pre, *enc("ab\nc"), mid]
    else:
        assert p.ids == [pre, *enc("ab\nc"), suf, *enc("d\n"), mid]
    assert b.stop_strings and specials[0] not in b.stop_strings  # eos stops anyway; others as text


def test_no_fim_tokens_means_a_plain_prefix_prompt():
    b = PromptBuilder(_VocabTokenizer(["<|endoftext|>"]))
    p = b.build("ab\ncd\n", 4, 100)
    assert b.fim is None and p.ids == b.tokenizer.encode("ab\nc") and p.suffix == ""


QWEN_SPECIALS = [
    "<|endoftext|>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
]


def test_psm_prompt_stays_anchored_while_typing_at_the_cursor():
    """PSM (Qwen2.5-Coder): typing at the cursor only appends to the prompt (the text typed since
    the anchor goes after the middle token), so the suffix is never prefilled again; any other
    change builds a fresh prompt anchored there."""
    tok = _VocabTokenizer(QWEN_SPECIALS)
    b = PromptBuilder(tok)
    assert b.anchor_middle
    mid = tok.token_to_id("<|fim_middle|>")
    text = "def f(a):\n    x = 1\n    \n    return x\n"
    at = text.index("    \n    return") + 4
    first = b.build(text, at, 100, key="doc")
    assert first.ids == b._build_window(text, at, 100, None, None, None).ids
    prev = first
    for ch in "y = x + 2\n    ":
        text, at = text[:at] + ch + text[at:], at + 1
        p = b.build(text, at, 100, key="doc")
        assert p.ids[: len(first.ids)] == first.ids  # the suffix (and all before it) reused
        assert (
            p.ids[len(first.ids) :]
            == [1000 + ord(c) for c in p.prefix[len(first.prefix) :]][: len(p.ids) - len(first.ids)]
        )
        assert p.suffix == first.suffix and p.prefix + p.suffix in text
        assert p.prefix.endswith(p.healed) and p.prefix[len(p.prefix) - len(p.healed) :] == p.healed
        prev = p
    assert first.ids[-1] == mid and len(prev.ids) > len(first.ids)
    # an edit before the anchor: a fresh prompt
    text2 = "# note\n" + text
    p = b.build(text2, at + 7, 100, key="doc")
    assert p.ids == b._build_window(text2, at + 7, 100, None, None, None).ids
    # an edit after the cursor: a fresh prompt too
    text3 = text2[: at + 7] + "z" + text2[at + 7 :]
    p = b.build(text3, at + 7, 100, key="doc")
    assert p.ids == b._build_window(text3, at + 7, 100, None, None, None).ids
    # without a key (eval, code actions), never anchored
    assert b.build(text3, at + 7, 100).ids == p.ids
    # SPM formats append at their end anyway: no anchoring
    assert not PromptBuilder(
        _VocabTokenizer(["<|endoftext|>", "<fim_prefix>", "<fim_middle>", "<fim_suffix>"])
    ).anchor_middle


def test_a_cancelled_engine_service_stream_shows_nothing_more():
    """What the daemon made after `cancel()` (before the cancel reached it) is not shown, as an
    in-process stream makes nothing more once cancelled."""
    from types import SimpleNamespace

    from engine.cancel import CancelToken
    from spark_lsp.backends.engine_ws import EngineStream

    class _Gen:
        successor, finish_reason, stats = None, None, {}

        def __init__(self, pieces):
            self.pieces, self.cancels = list(pieces), 0

        def poll(self, timeout):
            if not self.pieces:
                self.finish_reason = "cancelled"
                raise StopIteration
            return SimpleNamespace(text=self.pieces.pop(0), token_id=1)

        def cancel(self):
            self.cancels += 1

        @property
        def cancelled(self):
            return self.cancels > 0

    gen = _Gen(["ab", "cd", "ef", "gh"])
    token = CancelToken()
    stream = EngineStream(SimpleNamespace(), gen, token)
    texts = [next(stream).text]
    token.cancel("superseded")  # the engine goes on a little before the cancel reaches it
    texts += [c.text for c in stream]
    assert texts == ["ab", "", "", ""] and stream.text == "ab"
    assert gen.cancels == 1 and stream.finish_reason == "cancelled"
