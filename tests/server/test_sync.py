"""Document sync with LSP line breaks, versioned live edits, and cancellation counters."""

from __future__ import annotations

import ast
import asyncio

import pytest
from conftest import plain, start_editor
from lsprotocol import types as T
from pygls.exceptions import JsonRpcException
from pygls.workspace import Workspace

from spark_lsp.server import SparkServer, create_server

URI = "file:///work/sync.py"
ODD = "a = 1\f# page\x1dsep\n"  # \f and \x1d are not LSP line breaks: this is one line, then ""


def test_incremental_change_after_form_feed_lands_on_the_lsp_line():
    ls = create_server()
    ls.protocol._workspace = Workspace(
        None, T.TextDocumentSyncKind.Incremental
    )  # as pygls' initialize
    ls.workspace.put_text_document(
        T.TextDocumentItem(uri=URI, language_id="python", version=1, text=ODD)
    )
    ls.workspace.update_text_document(
        T.VersionedTextDocumentIdentifier(uri=URI, version=2),
        T.TextDocumentContentChangePartial(
            range=T.Range(T.Position(1, 0), T.Position(1, 0)), text="b = 2\n"
        ),
    )
    ls.workspace.update_text_document(
        T.VersionedTextDocumentIdentifier(uri=URI, version=3),
        T.TextDocumentContentChangePartial(
            range=T.Range(T.Position(0, 4), T.Position(0, 5)), text="10"
        ),
    )
    assert ls.workspace.get_text_document(URI).source == "a = 10\f# page\x1dsep\nb = 2\n"


async def test_server_text_matches_editor_after_odd_line_breaks(editor):
    editor.open(URI, ODD + "x = 3\n")
    end = editor.type(
        URI, len(ODD), "value_total = 42 + 1000\n"
    )  # line 1 for the editor (LSP), line 2 for splitlines
    assert editor.text(URI) == ODD + "value_total = 42 + 1000\nx = 3\n"
    # a range only valid in the LSP view of the text: (1, 23) ends the typed line
    p = editor.pos(URI, end - 1)
    assert (p.line, p.character) == (1, 23)
    listed = await editor.client.text_document_code_action_async(
        T.CodeActionParams(
            T.TextDocumentIdentifier(URI), T.Range(p, p), T.CodeActionContext(diagnostics=[])
        )
    )
    assert listed
    # an edit computed from the server's copy applies cleanly to the editor's
    done = next(
        a for a in listed if getattr(a, "data", None) and plain(a.data)["action"] == "complete"
    )
    try:
        resolved = await editor.client.code_action_resolve_async(done)
    except (
        JsonRpcException
    ) as exc:  # this random model's result failed the edit checks: nothing applied
        assert "was not applied: " in exc.message  # noqa: PT017
        assert editor.text(URI) == ODD + "value_total = 42 + 1000\nx = 3\n"
        return
    edits = resolved.edit.changes[URI]
    editor.change(URI, [(e.range, e.new_text) for e in reversed(edits)])
    assert editor.text(URI).startswith(ODD + "value_total = 42 + 1000")


def _finished(res: dict, ed, text: str) -> bool:
    """Whether a streamed rewrite of this random model was written in full; otherwise its result
    failed the edit checks, and what was streamed has been taken back exactly."""
    if res["outcome"] == "done" and res["complete"]:
        return True
    assert res["outcome"].startswith("Spark: Rewrite selection was not applied: "), res
    assert ed.text(URI) == text and not res["complete"]
    return False


def _long(body_lines=12, eol="\n"):
    body = "".join(f"    v_{i} = f(v_{i - 1}, {i})\n" for i in range(1, body_lines))
    return ("def long():\n" + body).replace("\n", eol)


async def _stream_rewrite(ed, body_lines=12, eol="\n"):
    await ed.command(
        "spark.configure",
        {"liveEdits": True, "liveEditHz": 100, "maxEditTokens": 80, "contextTokens": 128},
    )
    text = _long(body_lines, eol)
    ed.open(URI, text)
    rng = T.Range(ed.pos(URI, text.index("    v_1")), ed.pos(URI, len(text)))
    listed = await ed.client.text_document_code_action_async(
        T.CodeActionParams(T.TextDocumentIdentifier(URI), rng, T.CodeActionContext(diagnostics=[]))
    )
    rewrite = next(
        a for a in listed if getattr(a, "data", None) and plain(a.data)["action"] == "rewrite"
    )
    resolved = await ed.client.code_action_resolve_async(rewrite)
    return await ed.command(resolved.command.command, *resolved.command.arguments)


async def test_live_edits_carry_the_document_version(editor):
    res = await _stream_rewrite(editor)
    assert editor.applied, res
    versions = []
    for p in editor.applied:
        assert p.edit.changes is None and len(p.edit.document_changes) == 1
        versions.append(p.edit.document_changes[0].text_document.version)
    # the first edit applies to the opened version 1, each next one to the version the last made
    assert versions == list(range(1, 1 + len(versions))), versions
    _finished(res, editor, _long())


async def test_live_edit_versioned_user_typing_still_stops_it(editor):
    typed = []

    def user_types(uri):
        if not typed:
            typed.append(1)
            editor.type(uri, 0, "# user\n")

    editor.after_apply = user_types
    res = await _stream_rewrite(editor, body_lines=30)
    assert res["outcome"] in ("stopped by the user", "rejected") and not res["complete"], res
    assert editor.text(URI).startswith("# user\ndef long():\n")


async def test_a_crlf_document_stays_crlf_through_an_editor_that_converts_line_breaks(editor):
    # as Neovim with fileformat=dos (and VS Code with CRLF): an edit's line breaks become the
    # document's, so the server must send CRLF to recognise the echo of its own edit
    editor.eol = "\r\n"
    res = await _stream_rewrite(editor, eol="\r\n")
    _finished(res, editor, _long(eol="\r\n"))
    assert "\n" not in editor.text(URI).replace("\r\n", "") and "\r" not in editor.text(
        URI
    ).replace("\r\n", "")
    sent = [e.new_text for p in editor.applied for dc in p.edit.document_changes for e in dc.edits]
    assert sent and not any("\n" in t.replace("\r\n", "") for t in sent), sent
    # the finished edit of a resolved action too
    await editor.command("spark.configure", {"liveEdits": False})
    text = _long(eol="\r\n")
    editor.open(URI, text)
    rng = T.Range(editor.pos(URI, text.index("\r\n") + 2), editor.pos(URI, len(text)))
    listed = await editor.client.text_document_code_action_async(
        T.CodeActionParams(T.TextDocumentIdentifier(URI), rng, T.CodeActionContext(diagnostics=[]))
    )
    rewrite = next(
        a for a in listed if getattr(a, "data", None) and plain(a.data)["action"] == "rewrite"
    )
    try:
        edits = (await editor.client.code_action_resolve_async(rewrite)).edit.changes[URI]
    except JsonRpcException as exc:  # refused by the edit checks: nothing to look at
        assert "was not applied: " in exc.message  # noqa: PT017
        return
    assert edits and not any("\n" in e.new_text.replace("\r\n", "") for e in edits), edits


async def test_live_edits_fall_back_to_changes_without_capability(tiny_llama):
    caps = T.ClientCapabilities(workspace=T.WorkspaceClientCapabilities(apply_edit=True))
    client, ed = await start_editor(tiny_llama, capabilities=caps)
    try:
        res = await _stream_rewrite(ed)
        _finished(res, ed, _long())
        assert ed.applied, res
        assert all(p.edit.document_changes is None and URI in p.edit.changes for p in ed.applied)
    finally:
        await client.shutdown_session()
        await client.stop()


async def test_request_cancelled_during_debounce_is_counted(editor):
    await editor.command("spark.configure", {"debounceMs": 5000})
    editor.open(URI, "def f():\n    ")
    before = (await editor.metrics())["cancelled"]
    mid, fut = editor.start_inline(
        URI, len("def f():\n    "), trigger=T.InlineCompletionTriggerKind.Automatic
    )
    await asyncio.sleep(0.3)
    editor.client.protocol.notify("$/cancelRequest", T.CancelParams(id=mid))
    with pytest.raises(JsonRpcException):
        await asyncio.wait_for(fut, 10)
    assert (await editor.metrics())["cancelled"] == before + 1


async def test_request_cancelled_before_its_handler_starts_is_counted():
    ls: SparkServer = create_server()

    async def handler():
        raise AssertionError("never runs")

    task = asyncio.ensure_future(handler())
    ls.protocol._request_futures["7"] = task
    ls.protocol._handle_cancel_notification("7")
    with pytest.raises(asyncio.CancelledError):
        await task
    assert ls.state.metrics.cancelled == 1


# The sample of the VS Code end-to-end run (editors/vscode/test/e2e.sh), after its docstring edit.
E2E = (
    "import os\n\n\ndef add(a, b):\n"
    '    """\n    Return a list of a file, in a file.\n    """\n'
    "    return os.path.join(a, b)\n\n\ndef greet(name):\n    return name\n"
)


async def test_an_instruction_range_taken_before_the_user_typed_is_refused(editor):
    """VS Code keeps the instruction box open while the user types in the editor: a range taken
    from the text before that keystroke must not be applied to the text after it (it once replaced
    8 characters past the selection). The code action's command carries the version."""
    await editor.command("spark.configure", {"liveEdits": True})
    editor.open(URI, E2E)
    rng = T.Range(T.Position(3, 0), T.Position(4, 7))  # `def add(a, b):` and the `    """` line
    listed = await editor.client.text_document_code_action_async(
        T.CodeActionParams(T.TextDocumentIdentifier(URI), rng, T.CodeActionContext(diagnostics=[]))
    )
    instruct = next(a for a in listed if a.title.startswith("Spark: Edit selection"))
    # the test client reads this CodeAction as a Command holding the real command as a string
    command = ast.literal_eval(instruct.command)
    uri, sel, ask, version = command["arguments"]
    assert (uri, ask, version) == (URI, "", 1) and sel["end"] == {"line": 4, "character": 7}
    # while the box asks for the instruction, the user types over the selection
    editor.change(URI, [(rng, "add t")])
    typed = editor.text(URI)
    assert typed.splitlines()[3:5] == ["add t", "    Return a list of a file, in a file."]
    with pytest.raises(JsonRpcException) as info:
        await editor.command(command["command"], uri, sel, "add type hints", version)
    assert info.value.code == -32801, info.value  # ContentModified: select again
    assert editor.text(URI) == typed and not editor.applied
    # a version must be an integer (or absent, for older clients)
    with pytest.raises(JsonRpcException) as info:
        await editor.command(command["command"], uri, sel, "add type hints", "1")
    assert info.value.code == -32602
    doc = await editor.server_document(URI)
    assert (doc["text"], doc["version"]) == (typed, 2)


async def test_the_servers_copy_matches_the_editors_when_echoes_come_after_the_reply(editor):
    """VS Code may answer workspace/applyEdit before it sends the didChange of the edit: streamed
    edits must still apply where the server meant, and both copies agree after each step."""
    editor.echo_after_reply = True
    res = await _stream_rewrite(editor, body_lines=20)
    _finished(res, editor, _long(20))
    await asyncio.sleep(0.1)  # the last echo
    doc = await editor.server_document(URI)
    assert (doc["text"], doc["version"]) == (editor.text(URI), editor.docs[URI][1])
    # a docstring inserted above the body, streamed, then an instruction edit on the new text
    await editor.command("spark.configure", {"maxEditTokens": 40})
    rng = T.Range(T.Position(0, 4), T.Position(0, 4))
    listed = await editor.client.text_document_code_action_async(
        T.CodeActionParams(T.TextDocumentIdentifier(URI), rng, T.CodeActionContext(diagnostics=[]))
    )
    ds = next(
        a for a in listed if getattr(a, "data", None) and plain(a.data)["action"] == "docstring"
    )
    resolved = await editor.client.code_action_resolve_async(ds)
    try:
        await editor.command(resolved.command.command, *resolved.command.arguments)
    except JsonRpcException as exc:  # refused by the checks: taken back
        assert "was not applied" in exc.message  # noqa: PT017
    await asyncio.sleep(0.1)
    doc = await editor.server_document(URI)
    assert (doc["text"], doc["version"]) == (editor.text(URI), editor.docs[URI][1])
    with pytest.raises(JsonRpcException) as info:
        await editor.server_document("file:///never/opened.py")
    assert info.value.code == -32602
