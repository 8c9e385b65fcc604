"""An editor-like pytest-lsp client around `spark-lsp serve --stdio --model <tiny model>`.

The client keeps its own copy of each document, applies the server's `workspace/applyEdit` to it and
echoes each edit back as `didChange`, as VS Code and Neovim do.
"""

from __future__ import annotations

import asyncio
import re
import sys

import pytest
import pytest_asyncio
from lsprotocol import types as T
from pytest_lsp import client_capabilities, make_test_lsp_client

from spark_lsp.documents import Edit, apply_edits, offset_at, position_at

SERVER = [sys.executable, "-m", "spark_lsp.commands.serve", "--stdio"]
# tiny models have a 512-token context
# tunePrecision: the one test of the background precision job turns it on (test_precision_job.py)
# minConfidence 0: these tests are about the machinery, and a random model's suggestions would all be
# hidden by the confidence gate (test_confidence_gate.py tests the gate)
OPTIONS = {
    "contextTokens": 192,
    "maxTokens": 24,
    "maxEditTokens": 96,
    "liveEdits": False,
    "tunePrecision": False,
    "minConfidence": 0,
    "answerMs": 0,  # whole suggestions: test_early_answer.py tests early answers
}

SAMPLE = """import os


def add(a, b):
    return a + b


def scale(values, factor):
    out = []
    for v in values:
        out.append(v * factor)
    return out


def main():
    total = add(1, 2)
    print(total)
"""


class Editor:
    """Documents as the client sees them, kept in sync with what it sends and receives."""

    def __init__(self, client):
        self.client = client
        self.docs: dict[str, list] = {}  # uri -> [text, version]
        self.status: list[dict] = []
        self.applied: list = []
        self.after_apply = None  # callable(uri) run after each applied edit
        self.eol = None  # set: the line breaks of an applied edit become this one (Neovim, VS Code)
        # as VS Code may: the applyEdit reply reaches the server before the didChange of the edit
        self.echo_after_reply = False

    def open(self, uri: str, text: str) -> None:
        self.docs[uri] = [text, 1]
        self.client.text_document_did_open(
            T.DidOpenTextDocumentParams(
                T.TextDocumentItem(uri=uri, language_id="python", version=1, text=text)
            )
        )

    def text(self, uri: str) -> str:
        return self.docs[uri][0]

    def pos(self, uri: str, offset: int) -> T.Position:
        p = position_at(self.text(uri), offset)
        return T.Position(p.line, p.character)

    def change(self, uri: str, edits: list[tuple[T.Range, str]], later: bool = False) -> None:
        """Apply `edits` to the client's copy and send the didChange (`later`: a little later, after
        the reply of the applyEdit request being handled)."""
        doc = self.docs[uri]
        for rng, new in edits:
            s = offset_at(doc[0], rng.start.line, rng.start.character)
            e = offset_at(doc[0], rng.end.line, rng.end.character)
            doc[0] = apply_edits(doc[0], [Edit(s, e, new)])
        doc[1] += 1
        params = T.DidChangeTextDocumentParams(
            T.VersionedTextDocumentIdentifier(uri=uri, version=doc[1]),
            [T.TextDocumentContentChangePartial(range=r, text=t) for r, t in edits],
        )
        if later:
            asyncio.get_running_loop().call_later(
                0.01, self.client.text_document_did_change, params
            )
        else:
            self.client.text_document_did_change(params)

    def type(self, uri: str, offset: int, s: str) -> int:
        p = self.pos(uri, offset)
        self.change(uri, [(T.Range(p, p), s)])
        return offset + len(s)

    def inline(self, uri: str, offset: int, trigger=T.InlineCompletionTriggerKind.Automatic):
        return self.client.text_document_inline_completion_async(
            T.InlineCompletionParams(
                text_document=T.TextDocumentIdentifier(uri=uri),
                position=self.pos(uri, offset),
                context=T.InlineCompletionContext(trigger_kind=trigger),
            )
        )

    def start_inline(self, uri: str, offset: int, trigger=T.InlineCompletionTriggerKind.Invoked):
        """Send an inline request now; returns (id, awaitable) so the test can cancel it."""
        import uuid

        mid = str(uuid.uuid4())
        fut = self.client.protocol.send_request(
            T.TEXT_DOCUMENT_INLINE_COMPLETION,
            T.InlineCompletionParams(
                text_document=T.TextDocumentIdentifier(uri=uri),
                position=self.pos(uri, offset),
                context=T.InlineCompletionContext(trigger_kind=trigger),
            ),
            msg_id=mid,
        )
        return mid, asyncio.wrap_future(fut)

    async def metrics(self) -> dict:
        return plain(await self.client.protocol.send_request_async("spark/metrics", {}))

    async def server_document(self, uri: str) -> dict:
        """The server's copy of `uri` (`spark/document`): {uri, version, text}."""
        return plain(await self.client.protocol.send_request_async("spark/document", {"uri": uri}))

    async def command(self, name: str, *args):
        return plain(
            await self.client.workspace_execute_command_async(
                T.ExecuteCommandParams(command=name, arguments=list(args))
            )
        )


def plain(obj):
    """pygls hands untyped JSON objects back as namedtuples; turn them into dicts and lists."""
    if hasattr(obj, "_asdict"):
        return {k: plain(v) for k, v in obj._asdict().items()}
    if isinstance(obj, dict):
        return {k: plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [plain(v) for v in obj]
    return obj


async def start_editor(model_dir, options=None, transport=None, capabilities=None) -> tuple:
    client = make_test_lsp_client()
    ed = Editor(client)

    @client.feature(T.WORKSPACE_APPLY_EDIT)
    async def apply_edit(ls, params: T.ApplyWorkspaceEditParams):
        # as VS Code: a versioned edit for a document that moved on is refused, nothing applied
        for dc in params.edit.document_changes or []:
            version = dc.text_document.version
            if version is not None and ed.docs[dc.text_document.uri][1] != version:
                return T.ApplyWorkspaceEditResult(applied=False, failure_reason="version mismatch")
        groups = list((params.edit.changes or {}).items()) + [
            (dc.text_document.uri, dc.edits) for dc in params.edit.document_changes or []
        ]
        for uri, edits in groups:
            if ed.eol is None:
                ed.change(uri, [(e.range, e.new_text) for e in edits], ed.echo_after_reply)
            else:
                ed.change(
                    uri,
                    [(e.range, re.sub(r"\r\n|\r|\n", ed.eol, e.new_text)) for e in edits],
                    ed.echo_after_reply,
                )
            ed.applied.append(params)
            if ed.after_apply is not None:
                ed.after_apply(uri)
        return T.ApplyWorkspaceEditResult(applied=True)

    @client.feature("spark/status")
    def status(ls, params):
        ed.status.append(plain(params))

    if transport is None:
        model = ("--model", str(model_dir)) if model_dir is not None else ()
        await client.start_io(*SERVER, *model)
    else:
        await transport(client)
    await client.initialize_session(
        T.InitializeParams(
            capabilities=capabilities or client_capabilities("visual-studio-code"),
            initialization_options={**OPTIONS, **(options or {})},
        )
    )
    for _ in range(600):
        m = await ed.metrics()
        if m["loaded"] or m["loadError"]:
            break
        await asyncio.sleep(0.1)
    assert m["loaded"], m
    return client, ed


@pytest_asyncio.fixture
async def editor(tiny_llama):
    client, ed = await start_editor(tiny_llama)
    yield ed
    await client.shutdown_session()
    await client.stop()


@pytest.fixture
def sample():
    return SAMPLE
