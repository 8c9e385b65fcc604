"""Live edits against an editor simulated in process, with the generation scripted: line breaks the
editor converts when it applies an edit, and a cancel that lands after the generation finished but
before the final write. Scripted, the interleavings are exact (no model, no timing)."""

from __future__ import annotations

import asyncio
import re

from lsprotocol import types as T
from pygls.workspace import Workspace

from spark_lsp import actions
from spark_lsp.documents import (
    Edit,
    Pos,
    apply_edits,
    line_ending,
    minimal_edit,
    normalize_eol,
    offset_at,
)
from spark_lsp.edits import Target
from spark_lsp.live_edits import LiveEdit, frame
from spark_lsp.server import CMD_CANCEL, SparkServer, create_server
from spark_lsp.settings import update

URI = "file:///work/live.py"
BODY = ["    a = 1", "    b = 2", "    c = 3", "    d = 4"]


def _doc(eol: str) -> str:
    return eol.join(["def f():", *BODY, "    return a", ""])


class Scripted:
    """An in-process server whose client converts line breaks as Neovim does (an edit's "\\r\\n" and
    "\\r" become line breaks, the buffer's line ending when the change is echoed; VS Code converts
    to the document's EOL likewise) and whose generation writes `chunks`, one streamed flush each."""

    def __init__(self, text: str, chunks: list[str], editor_eol: str | None):
        self.ls: SparkServer = create_server()
        self.ls.protocol._workspace = Workspace(None, T.TextDocumentSyncKind.Incremental)
        self.ls.protocol.client_capabilities = T.ClientCapabilities(
            window=T.WindowClientCapabilities(work_done_progress=True),
            workspace=T.WorkspaceClientCapabilities(
                apply_edit=True,
                workspace_edit=T.WorkspaceEditClientCapabilities(document_changes=True),
            ),
        )
        self.ls.state.settings = update(self.ls.state.settings, {"liveEditHz": 200})[0]
        self.ls.workspace.put_text_document(
            T.TextDocumentItem(uri=URI, language_id="python", version=1, text=text)
        )
        self.text, self.version, self.editor_eol = text, 1, editor_eol
        self.chunks = chunks
        self.sent: list[str] = []  # new texts of the edits the server sent
        self.progress: list = []  # $/progress values
        self.statuses: list = []
        self.on_apply = None  # async callable(n) run as the client applies edit n (1-based)
        self.on_create = None  # callable() run as the client creates the progress
        self.generation: asyncio.Task | None = None
        self._applied = asyncio.Event()

        async def create(*args, **kwargs):
            if self.on_create is not None:
                self.on_create()

        self.ls.protocol.send_request_async = lambda method, params=None, msg_id=None: create()
        self.ls.protocol.notify = lambda method, params=None: (
            self.progress.append(params.value) if method == T.PROGRESS else None
        )
        self.ls.state.send_status = lambda kind, stats: self.statuses.append(kind)
        self.ls.workspace_apply_edit_async = self.apply_edit
        self.ls.edits.job = self.generate

    async def generate(self, uri, plan, on_text=None, parent=None, steering=None, lead=""):
        """The engine job (Edits.job), scripted: each chunk of output is flushed before the next comes (a chunk
        that changes nothing on screen is given a few flush intervals)."""
        self.generation = asyncio.current_task()
        raw = ""
        for chunk in self.chunks:
            raw += chunk
            self._applied.clear()
            on_text(raw)
            try:
                await asyncio.wait_for(self._applied.wait(), 0.1)
            except asyncio.TimeoutError:
                pass
        return plan.region_text(raw, final=True), {"new_tokens": len(self.chunks)}

    async def apply_edit(self, params: T.ApplyWorkspaceEditParams) -> T.ApplyWorkspaceEditResult:
        (dc,) = params.edit.document_changes
        if dc.text_document.version != self.version:
            return T.ApplyWorkspaceEditResult(applied=False, failure_reason="version mismatch")
        changes = []
        for e in dc.edits:
            self.sent.append(e.new_text)
            new = e.new_text
            if self.editor_eol is not None:
                new = re.sub(r"\r\n?", "\n", new).replace("\n", self.editor_eol)
            s = offset_at(self.text, e.range.start.line, e.range.start.character)
            t = offset_at(self.text, e.range.end.line, e.range.end.character)
            self.text = apply_edits(self.text, [Edit(s, t, new)])
            changes.append(T.TextDocumentContentChangePartial(range=e.range, text=new))
        self.version += 1
        self.did_change(changes)
        if self.on_apply is not None:
            await self.on_apply(len(self.sent))
        self._applied.set()
        return T.ApplyWorkspaceEditResult(applied=True)

    def did_change(self, changes) -> None:
        """The echo, as pygls delivers it: the workspace copy updated, then the server's handler."""
        ident = T.VersionedTextDocumentIdentifier(uri=URI, version=self.version)
        for c in changes:
            self.ls.workspace.update_text_document(ident, c)
        self.ls.protocol.fm.features[T.TEXT_DOCUMENT_DID_CHANGE](
            T.DidChangeTextDocumentParams(ident, changes)
        )

    async def rewrite_body(self) -> dict:
        """Stream a rewrite of the function's body (lines 1..4)."""
        start = offset_at(self.text, 1, 0)
        end = offset_at(self.text, 1 + len(BODY), 0)
        plan = actions.EditPlan(actions.REWRITE, start, end, self.text[:start], self.text[end:])
        try:
            target = Target(URI, self.text, self.version, start, end, 1)
            return await asyncio.wait_for(self.ls.edits.stream(target, plan), 10)
        finally:
            self.ls.state.shutdown()

    def cancel_command(self, *args):
        return self.ls.protocol.fm.commands[CMD_CANCEL](*args)


# -- line endings -----------------------------------------------------------------------------------
def test_line_ending_and_normalize_eol():
    assert (
        line_ending("a\nb\n") == "\n"
        and line_ending("a\r\nb\r\n") == "\r\n"
        and line_ending("a\rb") == "\r"
    )
    assert line_ending("no break") == "\n" and line_ending("a\r\nb\nc\r\n") == "\r\n"
    assert normalize_eol("a\r\nb\rc\n", "\n") == "a\nb\nc\n"
    assert normalize_eol("a\r\nb\rc\n", "\r\n") == "a\r\nb\r\nc\r\n"
    # a "\r" that ends a chunk and the "\n" that completes it in the next one make one break
    assert normalize_eol("x\r", "\r\n") + "y" == normalize_eol("x\r\ny", "\r\n")


def test_minimal_edit_never_starts_or_ends_inside_a_crlf():
    for old, new in [
        ("a\r\nb", "a0\nb"),
        ("a\r\nb", "a\nb"),
        ("ab\r\ncd", "ab\r\n\r\ncd"),
        ("x\r\ny", "x\r\r\ny"),
    ]:
        e = minimal_edit(old, new)
        assert apply_edits(old, [e]) == new
        assert not (0 < e.start < len(old) and old[e.start - 1 : e.start + 1] == "\r\n"), (
            old,
            new,
            e,
        )
        assert not (0 < e.end < len(old) and old[e.end - 1 : e.end + 1] == "\r\n"), (old, new, e)


def test_live_edit_writes_generated_line_breaks_in_the_document_line_ending():
    original = "a = 1\r\nb = 2\r\nc = 3\r\n"
    assert frame(original, "A = 1\nB", final=False, eol="\r\n") == "A = 1\r\nB\r\nc = 3\r\n"
    doc = "# head\r\n" + original
    s = LiveEdit("u", doc, 8, len(doc), Pos(1, 0))
    assert s.eol == "\r\n"
    (e,) = s.edits_to(s.frame("A = 1\rB", final=False))
    assert not re.search(r"\r(?!\n)|(?<!\r)\n", e.new_text), e.new_text
    assert s.on_did_change("# head\r\nA = 1\r\nB\r\nc = 3\r\n") and not s.stopped_by_user
    (e,) = s.edits_to(s.frame("A = 1\nB = 2\r\nC = 3\r", final=True))
    assert s.on_did_change("# head\r\nA = 1\r\nB = 2\r\nC = 3\r\n") and not s.stopped_by_user


def test_an_echo_converted_otherwise_is_still_recognised():
    doc = "x = 0\nyy = 1\n"
    s = LiveEdit("u", doc, 6, len(doc), Pos(1, 0))
    s.edits_to("y = 2\n")
    assert (
        s.on_did_change("x = 0\r\ny = 2\r\n") and not s.stopped_by_user
    )  # a client that wrote CRLF
    s.edits_to("y = 3\n")
    assert not s.on_did_change("x = 0\ny = 3\n# typed\n") and s.stopped_by_user


async def test_generated_carriage_returns_do_not_stop_a_live_edit_in_a_converting_editor():
    text = _doc("\n")
    # a "\r" alone, a "\r\n", and a "\r" whose "\n" comes in the next chunk (which shows nothing new)
    sc = Scripted(text, ["    a = 10\r", "\n    b = 20\r\n    c", " = 30\r", "\n"], editor_eol="\n")
    res = await sc.rewrite_body()
    assert res["outcome"] == "done" and res["complete"], res
    assert sc.text == "def f():\n    a = 10\n    b = 20\n    c = 30\n    return a\n"
    assert sc.ls.workspace.get_text_document(URI).source == sc.text
    assert not any("\r" in t for t in sc.sent), sc.sent  # what the editor applies is what was sent
    assert len(sc.sent) == 3 + 1  # a flush per chunk that shows something new, then the final write


async def test_a_crlf_document_keeps_crlf_in_a_live_edit():
    text = _doc("\r\n")
    sc = Scripted(
        text, ["    a = 10\n", "    b = 20\r", "\n    c", " = 30\n    d = 40\n"], editor_eol="\r\n"
    )
    res = await sc.rewrite_body()
    assert res["outcome"] == "done" and res["complete"], res
    assert (
        sc.text
        == "def f():\r\n    a = 10\r\n    b = 20\r\n    c = 30\r\n    d = 40\r\n    return a\r\n"
    )
    assert not any(re.search(r"\r(?!\n)|(?<!\r)\n", t) for t in sc.sent), sc.sent


async def test_an_editor_that_applies_edits_as_sent_gets_the_document_line_ending_too():
    text = _doc("\r\n")
    sc = Scripted(text, ["    a = 10\n", "    b = 20\n    c = 30\n    d = 40\n"], editor_eol=None)
    res = await sc.rewrite_body()
    assert res["outcome"] == "done" and res["complete"], res
    assert "\n" not in sc.text.replace("\r\n", "") and sc.text.count("\r\n") == text.count("\r\n")


# -- a cancel between the end of the generation and the final write -----------------------------------
async def _cancel_after_generation(cancel) -> tuple[Scripted, dict, dict]:
    """Stream three chunks; while the client applies the last streamed one, let the generation
    finish, then `cancel(sc)` (the user's cancel arrives before the server's final write)."""
    text = _doc("\n")
    sc = Scripted(text, ["    a = 10\n", "    b = 20\n", "    c = 30\n"], editor_eol="\n")
    seen = {}

    async def on_apply(n):
        if n == len(sc.chunks):
            sc._applied.set()
            await asyncio.wait([sc.generation])  # the generation has finished
            assert sc.generation.result()
            seen["text"] = sc.text
            seen["cancel"] = cancel(sc)

    sc.on_apply = on_apply
    res = await sc.rewrite_body()
    return sc, res, seen


async def test_spark_cancel_after_the_generation_finished_skips_the_final_write():
    sc, res, seen = await _cancel_after_generation(lambda sc: sc.cancel_command(URI))
    assert seen["cancel"] == {"cancelled": 1}
    assert res["outcome"] == "edit stopped: cancelled by command" and not res["complete"], res
    assert len(sc.sent) == len(sc.chunks)  # no final write after the cancel
    # what was streamed stays, as when a cancel stops the engine mid-stream: the generated lines
    # over the original ones they replaced, the rest of the original below
    assert (
        sc.text
        == seen["text"]
        == "def f():\n    a = 10\n    b = 20\n    c = 30\n    d = 4\n    return a\n"
    )
    assert sc.ls.workspace.get_text_document(URI).source == sc.text
    assert URI not in sc.ls.state.live
    assert sc.progress[-1].kind == "end" and "cancelled" in sc.progress[-1].message


async def test_progress_cancel_after_the_generation_finished_skips_the_final_write():
    def cancel_progress(sc):
        (token,) = [t for t in sc.ls.work_done_progress.tokens if str(t).startswith("spark-edit")]
        return sc.ls.work_done_progress.tokens[
            token
        ].cancel()  # what pygls does on the client's cancel

    sc, res, seen = await _cancel_after_generation(cancel_progress)
    assert res["outcome"] == "edit stopped: progress cancelled" and not res["complete"], res
    assert len(sc.sent) == len(sc.chunks)
    assert sc.text == seen["text"] and "d = 4\n" in sc.text
    assert sc.progress[-1].kind == "end" and "progress cancelled" in sc.progress[-1].message


async def test_a_cancel_before_anything_was_written_writes_nothing():
    sc = Scripted(_doc("\n"), ["    a = 10\n", "    b = 20\n"], editor_eol="\n")
    sc.on_create = lambda: sc.cancel_command(URI)  # while the progress is being created
    res = await sc.rewrite_body()
    assert res["outcome"] == "edit stopped: cancelled by command" and not res["complete"], res
    assert sc.sent == [] and sc.text == _doc("\n")


async def test_a_live_edit_left_alone_still_writes_its_final_text():
    sc = Scripted(_doc("\n"), ["    a = 10\n", "    b = 20\n", "    c = 30\n"], editor_eol="\n")
    res = await sc.rewrite_body()
    assert res["outcome"] == "done" and res["complete"], res
    assert sc.text == "def f():\n    a = 10\n    b = 20\n    c = 30\n    return a\n"
    assert sc.cancel_command(URI) == {"cancelled": 0}  # nothing left to cancel


# -- refused results --------------------------------------------------------------------------------
async def test_a_refused_live_edit_is_taken_back_exactly(monkeypatch):
    """A rewrite whose result fails the edit checks on both tries (the real Edits.job, the model's
    output scripted): what was streamed is taken back, the document is byte for byte what it was
    (CRLF and all), and the user is told why."""
    import threading

    from engine import GenerationParams
    from spark_lsp import completions

    text = _doc("\r\n")
    s = Scripted(text, [], editor_eol="\r\n")
    del s.ls.edits.job  # the real job: plan, generation on the engine thread, checks, retry
    applied = threading.Event()

    async def on_apply(n):
        applied.set()

    s.on_apply = on_apply
    chunks = ["    a = (\n", "    b = [\n"]  # a rewrite that no longer parses
    tries = []

    def fake_generate(
        engine,
        job,
        ids,
        params,
        done=None,
        on_text=None,
        speculative=False,
        draft=None,
        text_prompt=None,
    ):
        tries.append(params.temperature)
        raw = ""
        for chunk in chunks:
            raw += chunk
            applied.clear()
            on_text(raw)
            yield
            applied.wait(5)  # the flush of this chunk has reached the editor
        return raw, {"new_tokens": len(chunks)}, "stop"

    class Builder:
        stop_strings = ()

        def build_parts_healed(self, prefix, suffix, budget):
            return [1, 2, 3], ""

        def fit_parts(self, prefix, suffix, budget):
            return prefix, suffix

    class Model:
        context = None  # the prompt budget is the contextTokens setting

    monkeypatch.setattr(completions, "generate_steps", fake_generate)
    monkeypatch.setattr(completions, "control_ids", lambda b: frozenset())
    host = s.ls.state.host
    host.model, host.builder, host.params_cls = Model(), Builder(), GenerationParams
    shown = []
    s.ls.state.editor.show_error = shown.append
    start, end = offset_at(text, 1, 0), offset_at(text, 1 + len(BODY), 0)
    plan = actions.plan(actions.REWRITE, text, start, end, 1, 64, python=True)
    try:
        res = await asyncio.wait_for(
            s.ls.edits.stream(Target(URI, text, 1, start, end, 1), plan), 10
        )
    finally:
        s.ls.state.shutdown()
    assert tries == [0.0, actions.RETRY_TEMPERATURE]  # greedy, then once more sampled
    assert "(" in s.sent and "[" in s.sent  # it was streamed ...
    assert s.text == text  # ... and taken back exactly
    assert res["outcome"].startswith(
        "Spark: Rewrite selection was not applied: the result is not valid Python"
    )
    assert not res["complete"] and shown == [res["outcome"]] and s.statuses == ["edit:rewrite"]


def test_a_partial_line_inserted_above_a_line_never_runs_into_it():
    # a docstring streams in above the body: mid-stream its last line is cut off, and must stay on
    # its own line (a user who stops the edit there is left with the body intact)
    doc = "def f():\n    return 1\n"
    at = doc.index("    return")
    s = LiveEdit("u", doc, at, at, Pos(1, 0))
    (e,) = s.edits_to(s.frame('    """Return o', final=False))
    assert apply_edits(doc, [Edit(at + 0, at + 0, e.new_text)]) == (
        'def f():\n    """Return o\n    return 1\n'
    )
    (e,) = s.edits_to(s.frame('    """Return one."""\n', final=True))
    assert s.shown == '    """Return one."""\n'
    # inserted mid-line (a completion at the cursor), the text after it stays on the same line
    mid = doc.index("1")
    s = LiveEdit("u", doc, mid, mid, Pos(1, 11))
    assert s.frame("2 +", final=False) == "2 +"


class _Steerable:
    def __init__(self):
        self.pieces: list[str] = []

    def steer(self, text):
        self.pieces.append(text)


def _steered(written: str):
    """A steerable live edit over `def f(): pass`'s body whose first edit wrote `written` and
    was confirmed by the client (version 2): (the session, its generation, the document)."""
    from spark_lsp.live_edits import Steering

    doc = "def f():\n    pass\n"
    at = doc.index("    pass")
    s = LiveEdit("u", doc, at, len(doc), Pos(1, 0), version=1)
    s.steering, gen = Steering(), _Steerable()
    s.steering.attach(gen)
    s.edits_to(s.frame(written, final=False))
    shown = doc[:at] + written + "\n"
    assert s.on_did_change(shown, 2)
    return s, gen, shown


def test_typing_in_the_generated_text_steers_and_anything_else_stops():
    s, gen, shown = _steered("    return a")
    # typed at the end of the written text, then once more: the output as the user has it, in
    # pieces (each steer adds to the last)
    assert not s.on_did_change(shown.replace("return a", "return ab"), 3) and not s.stopped
    assert not s.on_did_change(shown.replace("return a", "return ab + 1"), 4) and not s.stopped
    assert gen.pieces == ["    return ab", " + 1"] and s.typed == "    return ab + 1"
    assert s.steers == 2 and s.version == 4
    # the next frame is computed from the user's text: our output after it is appended
    (e,) = s.edits_to(s.frame("    return ab + 1 if a else 0", final=False))
    assert e.new_text == " if a else 0"
    # deleting the end of the output is the user taking over: the session stops
    s2, _, _ = _steered("    return a")
    assert not s2.on_did_change(shown.replace("return a", "return "), 3) and s2.stopped_by_user
    # as does a change outside the generated text
    s3, _, _ = _steered("    return a")
    assert not s3.on_did_change("# x\n" + shown, 3) and s3.stopped_by_user


def test_typing_after_the_generation_ended_is_taken_for_a_successor():
    """The generation has ended but its last output is not shown yet: the user's typing is
    still a steer (the live edit starts a successor after it, `take_late`), not a stop; before
    any generation ran there is nothing to steer."""
    from spark_lsp.live_edits import Steering

    doc = "def f():\n    pass\n"
    at = doc.index("    pass")
    s = LiveEdit("u", doc, at, len(doc), Pos(1, 0), version=1)
    s.steering, gen = Steering(), _Steerable()
    assert not s.steering.send("    x")  # nothing attached yet: cannot steer
    s.steering.attach(gen)
    s.edits_to(s.frame("    return a", final=False))
    shown = doc[:at] + "    return a\n"
    assert s.on_did_change(shown, 2)
    s.steering.detach(gen)  # the generation ended; its final text is not shown yet
    assert not s.steering.take_late()
    assert not s.on_did_change(shown.replace("return a", "return ab"), 3) and not s.stopped
    assert gen.pieces == [] and s.typed == "    return ab" and s.steers == 1
    assert s.steering.take_late() and not s.steering.take_late()  # once per late typing
    # a successor attached with the typed text as its lead is steered with what follows it;
    # it is counted once (a later attempt with a lead no late typing asked for is not one)
    succ = _Steerable()
    assert s.steering.successors == 0
    s.steering.starting("    return ab").attach(succ)
    assert s.steering.successors == 1
    assert not s.on_did_change(shown.replace("return a", "return ab + 1"), 4) and not s.stopped
    assert succ.pieces == [" + 1"] and not s.steering.take_late()
    s.steering.starting("    return ab + 1")
    assert s.steering.successors == 1


def test_typing_again_inside_the_output_restarts_after_the_users_text():
    """A second keystroke inside the output (not at its end) changes text the first steer sent,
    which a stream cannot take (steers only add): the generation is stopped (`restarting`) and a
    successor starts with the output as the user has it (`take_late`), instead of the edit
    stopping. So does a fix to the lead of a successor."""
    s, gen, shown = _steered("    return a + b")
    # "x" after "return a", in the middle: a steer with the output as the user left it
    assert not s.on_did_change(shown.replace("return a", "return ax"), 3) and not s.stopped
    assert gen.pieces == ["    return ax + b"] and not s.steering.restarting
    # "y" after it: not an addition to what was sent, so the stream is not steered again ...
    assert not s.on_did_change(shown.replace("return a", "return axy"), 4) and not s.stopped
    assert gen.pieces == ["    return ax + b"] and s.steers == 2 and s.unsteerable is None
    # ... the running generation is told to stop, and a successor starts after the user's text
    assert s.steering.restarting and s.typed == "    return axy + b"
    s.steering.detach(gen)
    assert s.steering.take_late() and not s.steering.take_late()
    succ = _Steerable()
    s.steering.starting("    return axy + b").attach(succ)
    assert not s.steering.restarting
    # typing at the end of the successor's lead steers it; a backspace inside the lead restarts
    assert not s.on_did_change(shown.replace("return a + b", "return axy + b2"), 5)
    assert succ.pieces == ["2"] and not s.steering.restarting
    assert not s.on_did_change(shown.replace("return a + b", "return ay + b2"), 6)
    assert succ.pieces == ["2"] and s.steering.restarting and not s.stopped
    assert s.typed == "    return ay + b2" and s.steers == 4
