"""The language server: registration of each LSP request, notification and command over the
services, each handler a few lines (validate, call a service, convert).

The services hold the logic and import no LSP library: `state` (settings, model, engine thread,
metrics), `inline` (inline completions), `edits` (code-action edits, streamed live). pygls'
behaviour is adjusted only in `protocol`; the services' errors become JSON-RPC errors there.
Handlers are async and never run model work themselves, so the reader keeps reading and a
`$/cancelRequest` or a `didChange` stops the engine within one decode step.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote, urlparse

from lsprotocol import types as T
from pygls.protocol import default_converter

from . import __version__ as _pkg_version
from . import actions
from .documents import PositionError, offset_at, position_at
from .edits import Edits, Target
from .errors import ContentModified, InvalidParams
from .inline import InlineCompletions
from .lsp_editor import LspEditor, lsp_position
from .protocol import SparkLanguageServer, SparkProtocol
from .settings import SettingsError
from .state import ServerState
from .status import DOCUMENT_METHOD, METRICS_METHOD

CMD_APPLY = "spark.applyAction"
CMD_INSTRUCT = "spark.editWithInstruction"
CMD_CANCEL = "spark.cancel"
CMD_TOGGLE = "spark.toggle"
CMD_CONFIGURE = "spark.configure"
CMD_STATUS = "spark.status"
CMD_ACCEPTED = "spark.accepted"


def configure_process(handler: logging.Handler, level: str) -> None:
    """Logging and thread switching of a process that runs language-server sessions (`serve`,
    the session host): `handler` at `level` on the root logger, pygls quiet below DEBUG (it logs
    every message at INFO and every error response with a traceback), and a waiting thread (a
    cancel, the reader) given the GIL within 0.5 ms instead of the default 5 ms, which bounds how
    fast a cancel reaches the engine thread."""
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(level)
    if level != "DEBUG":
        logging.getLogger("pygls").setLevel(logging.CRITICAL)
    sys.setswitchinterval(0.0005)


class SparkServer(SparkLanguageServer):
    """The pygls server and its services."""

    def __init__(
        self,
        model_dir: str | None = None,
        engine: str | None = None,
        converter_factory: Callable[[], Any] = default_converter,
    ):
        super().__init__(
            "spark-lsp",
            _pkg_version,
            protocol_cls=SparkProtocol,
            converter_factory=converter_factory,
            max_workers=4,
        )
        self.editor = LspEditor(self)
        self.state = ServerState(self.editor, model_dir, engine)
        self.inline = InlineCompletions(self.state, self.is_python)
        self.edits = Edits(self.state)

    def request_cancelled_before_start(self) -> None:
        self.state.metrics.cancelled += 1

    def stop_work(self, reason: str) -> None:
        super().stop_work(reason)
        self.state.shutdown()  # generations in flight stop within a decode step

    def wait_stopped(self, timeout: float) -> None:
        self.state.wait_stopped(timeout)

    # -- conversions between LSP and the services -------------------------------------------------
    def document(self, uri: str):
        """The open document `uri`; InvalidParams if the client never opened it."""
        try:
            docs = self.workspace.text_documents
        except RuntimeError as exc:
            raise InvalidParams(str(exc)) from None
        if uri not in docs:
            raise InvalidParams(f"unknown document {uri!r}: send textDocument/didOpen first")
        return docs[uri]

    def text(self, uri: str) -> str | None:
        """The document's text, None if it is not open."""
        doc = self.workspace.text_documents.get(uri)
        return None if doc is None else doc.source

    def is_python(self, uri: str) -> bool:
        """The client says the document is Python (or, saying nothing, it is named *.py/*.pyi)."""
        lang = getattr(self.workspace.text_documents.get(uri), "language_id", None)
        return lang == "python" or (not lang and uri.endswith((".py", ".pyi")))

    @property
    def enc(self) -> str:
        """The negotiated position encoding ('utf-16' unless the client asked for another)."""
        try:
            enc = self.workspace.position_encoding
            return str(getattr(enc, "value", enc))
        except Exception:
            return "utf-16"

    def offset(self, text: str, pos: T.Position) -> int:
        try:
            return offset_at(text, pos.line, pos.character, enc=self.enc)
        except PositionError as exc:
            raise InvalidParams(
                f"position {{line: {pos.line}, character: {pos.character}}}: {exc}"
            ) from None

    def target(self, uri: str, rng: T.Range, version: int | None = None) -> Target:
        """The edit target for `rng` of `uri`; ContentModified when `version` is given and stale."""
        doc = self.document(uri)
        if version is not None and doc.version is not None and version != doc.version:
            raise ContentModified(f"{uri} changed since the action was listed; ask again")
        start, end = self.offset(doc.source, rng.start), self.offset(doc.source, rng.end)
        if end < start:
            raise InvalidParams("range end is before its start")
        return Target(
            uri, doc.source, doc.version, start, end, rng.start.line, self.enc, self.is_python(uri)
        )

    def action_target(self, data: Any) -> tuple[str, Target]:
        """(action name, target) from the `data` of an action this server listed."""
        try:
            name, uri, rng = data["action"], data["uri"], data["range"]
            start = T.Position(*_position_json(rng["start"]))
            end = T.Position(*_position_json(rng["end"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidParams(f"action data needs 'action', 'uri' and 'range': {exc}") from None
        return name, self.target(uri, T.Range(start, end), data.get("version"))


def _position_json(p: Any) -> tuple[int, int]:
    """(line, character) of a position in an action's JSON data: non-negative integers only."""
    line, character = p["line"], p["character"]
    for v in (line, character):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"position {p!r} needs non-negative integers")
    return line, character


def _inline_items(items: list[str], pos: T.Position) -> T.InlineCompletionList:
    # the command runs when the user accepts an item: counts accepted suggestions and characters
    return T.InlineCompletionList(
        items=[
            T.InlineCompletionItem(
                insert_text=s,
                filter_text=s,
                range=T.Range(pos, pos),
                command=T.Command(
                    title="spark: suggestion accepted", command=CMD_ACCEPTED, arguments=[len(s)]
                ),
            )
            for s in items
        ]
    )


def _range_json(r: T.Range) -> dict:
    return {
        "start": {"line": r.start.line, "character": r.start.character},
        "end": {"line": r.end.line, "character": r.end.character},
    }


def _text_edits(edits) -> list[T.TextEdit]:
    return [T.TextEdit(T.Range(lsp_position(s), lsp_position(e)), new) for s, e, new in edits]


def _code_action(name: str, uri: str, rng: T.Range, version: int | None) -> T.CodeAction:
    title, kind = actions.TITLES[name], actions.KINDS[name]
    if name == actions.INSTRUCT:
        # the client asks for the instruction (the empty third argument), then runs the command;
        # the version ties the range to the text it was taken from (the user may type meanwhile)
        return T.CodeAction(
            title=title,
            kind=kind,
            command=T.Command(
                title=title,
                command=CMD_INSTRUCT,
                arguments=[uri, _range_json(rng), "", version],
            ),
        )
    return T.CodeAction(
        title=title,
        kind=kind,
        data={"action": name, "uri": uri, "range": _range_json(rng), "version": version},
    )


def create_server(
    model_dir: str | None = None,
    engine: str | None = None,
    converter_factory: Callable[[], Any] = default_converter,
    notice: str | None = None,
) -> SparkServer:
    """The language server of one session. `converter_factory`: its LSP (de)serialiser; a
    session host passes one that returns the same converter for every session (it holds no
    session state, only the structuring code it generates per message type). `notice`: a
    warning shown in the editor once it has initialised (why this server runs as it does)."""
    ls = SparkServer(model_dir, engine, converter_factory)
    st = ls.state

    @ls.feature(T.INITIALIZE)
    def initialize(ls: SparkServer, params: T.InitializeParams):
        folders = params.workspace_folders or []
        root = folders[0].uri if folders else params.root_uri
        if root and root.startswith("file:"):
            st.root = unquote(urlparse(root).path)
        try:
            st.apply_settings(params.initialization_options, "initializationOptions")
        except SettingsError as exc:
            ls.editor.log(f"initializationOptions: {exc}; using defaults for the rest", "error")

    @ls.feature(T.INITIALIZED)
    def initialized(ls: SparkServer, params: T.InitializedParams):
        if notice:
            ls.editor.show_warning(notice)
        st.sched()
        st.start_loading()

    @ls.feature(T.SHUTDOWN)
    def shutdown(ls: SparkServer, params: Any):
        st.shutdown()

    @ls.feature(T.TEXT_DOCUMENT_DID_OPEN)
    def did_open(ls: SparkServer, params: T.DidOpenTextDocumentParams):
        st.observe(params.text_document.uri, params.text_document.text, 0)

    @ls.feature(T.TEXT_DOCUMENT_DID_CHANGE)
    def did_change(ls: SparkServer, params: T.DidChangeTextDocumentParams):
        uri, version = params.text_document.uri, params.text_document.version
        text = ls.text(uri)
        if not ls.edits.on_change(uri, text, version):  # not our own live edit coming back
            ls.inline.on_change(uri, text)
            change = params.content_changes[-1] if params.content_changes else None
            rng = getattr(change, "range", None)
            if text is not None:
                st.observe(uri, text, rng.start.line if rng is not None else 0)

    @ls.feature(T.TEXT_DOCUMENT_DID_CLOSE)
    def did_close(ls: SparkServer, params: T.DidCloseTextDocumentParams):
        uri = params.text_document.uri
        ls.inline.forget(uri)
        ls.edits.cancel(uri, "document closed")
        if st.host.builder is not None:
            st.host.builder.forget(uri)

    @ls.feature(T.WORKSPACE_DID_CHANGE_CONFIGURATION)
    def did_change_configuration(ls: SparkServer, params: T.DidChangeConfigurationParams):
        try:
            st.apply_settings(params.settings, "workspace/didChangeConfiguration")
            ls.editor.log("settings updated")
        except SettingsError as exc:
            ls.editor.log(f"workspace/didChangeConfiguration: {exc}", "error")
            ls.editor.show_error(f"spark-lsp: {exc}")

    @ls.feature(T.TEXT_DOCUMENT_INLINE_COMPLETION, T.InlineCompletionOptions())
    async def inline_completion(ls: SparkServer, params: T.InlineCompletionParams):
        uri, pos, ctx = params.text_document.uri, params.position, params.context
        text = ls.document(uri).source
        offset = ls.offset(text, pos)
        trigger = int(ctx.trigger_kind) if ctx else T.InlineCompletionTriggerKind.Automatic.value
        sel = ctx.selected_completion_info if ctx else None
        if sel is None:
            # a position past the line's or document's end is answered at where it lands
            at = lsp_position(position_at(text, offset, ls.enc))
            return _inline_items(await ls.inline.complete(uri, text, offset, trigger), at)
        s, e = ls.offset(text, sel.range.start), ls.offset(text, sel.range.end)
        if sel.range.start.line != sel.range.end.line:
            raise InvalidParams(
                "selectedCompletionInfo.range must be on the cursor's line and contain it"
            )
        items = await ls.inline.complete(uri, text, offset, trigger, selected=(s, e, sel.text))
        return T.InlineCompletionList(
            items=[
                T.InlineCompletionItem(insert_text=t, filter_text=t, range=sel.range) for t in items
            ]
        )

    @ls.feature(
        T.TEXT_DOCUMENT_CODE_ACTION,
        T.CodeActionOptions(
            code_action_kinds=[T.CodeActionKind.RefactorRewrite, T.CodeActionKind.RefactorExtract],
            resolve_provider=True,
        ),
    )
    def code_action(ls: SparkServer, params: T.CodeActionParams):
        uri, rng = params.text_document.uri, params.range
        t = ls.target(uri, rng)
        only = params.context.only if params.context else None
        return [
            _code_action(name, uri, rng, t.version)
            for name in ls.edits.available(t.text, t.start, t.end, t.line, only)
        ]

    @ls.feature(T.CODE_ACTION_RESOLVE)
    async def code_action_resolve(ls: SparkServer, action: T.CodeAction):
        data = action.data
        if not isinstance(data, dict) or data.get("action") not in actions.ACTIONS:
            raise InvalidParams("codeAction/resolve: 'data' is not an action this server listed")
        if st.settings.live_edits:  # streamed by the command, not returned as an edit
            action.command = T.Command(title=action.title, command=CMD_APPLY, arguments=[data])
            return action
        name, t = ls.action_target(data)
        edits = await ls.edits.compute(t, await ls.edits.plan(name, t))
        action.edit = T.WorkspaceEdit(changes={t.uri: _text_edits(edits)})
        return action

    @ls.command(CMD_APPLY)
    async def apply_action(ls: SparkServer, *args: Any):
        if len(args) != 1 or not isinstance(args[0], dict):
            raise InvalidParams(f"{CMD_APPLY} takes the action's data object")
        name, t = ls.action_target(args[0])
        return await ls.edits.apply(name, t)

    @ls.command(CMD_INSTRUCT)
    async def edit_with_instruction(ls: SparkServer, *args: Any):
        version = args[3] if len(args) == 4 else None
        if (
            len(args) not in (3, 4)
            or not isinstance(args[0], str)
            or not isinstance(args[1], dict)
            or not isinstance(args[2], str)
            or not (version is None or (isinstance(version, int) and not isinstance(version, bool)))
        ):
            raise InvalidParams(
                f"{CMD_INSTRUCT} takes [uri, range, instruction text, document version (optional)]"
            )
        if not args[2].strip():
            raise InvalidParams(f"{CMD_INSTRUCT}: the instruction is empty")
        # with a version, a range taken from an older text is refused (ContentModified) instead of
        # being applied to text it was never meant for
        name, t = ls.action_target(
            {"action": actions.INSTRUCT, "uri": args[0], "range": args[1], "version": version}
        )
        return await ls.edits.apply(name, t, instruction=args[2])

    @ls.command(CMD_CANCEL)
    def cancel(ls: SparkServer, *args: Any):
        uris = [a for a in args if isinstance(a, str)] or list(ls.workspace.text_documents)
        return {"cancelled": sum(ls.edits.cancel(uri, "cancelled by command") for uri in uris)}

    @ls.command(CMD_TOGGLE)
    def toggle(ls: SparkServer, *args: Any):
        if args and not isinstance(args[0], bool):
            raise InvalidParams(f"{CMD_TOGGLE} takes an optional boolean")
        st.enabled = args[0] if args else not st.enabled
        ls.editor.log(f"inline completions {'on' if st.enabled else 'off'}")
        return {"enabled": st.enabled}

    @ls.command(CMD_CONFIGURE)
    def configure(ls: SparkServer, *args: Any):
        if len(args) != 1:
            raise InvalidParams(f"{CMD_CONFIGURE} takes one settings object")
        try:
            st.apply_settings(args[0], CMD_CONFIGURE)
        except SettingsError as exc:
            raise InvalidParams(str(exc)) from None
        return st.settings_json()

    @ls.command(CMD_ACCEPTED)
    def accepted(ls: SparkServer, *args: Any):
        st.metrics.accepted += 1
        if args and isinstance(args[0], int) and not isinstance(args[0], bool) and args[0] >= 0:
            st.metrics.accepted_chars += args[0]

    @ls.command(CMD_STATUS)
    def status(ls: SparkServer, *args: Any):
        return st.metrics_payload()

    @ls.feature(METRICS_METHOD)
    def metrics(ls: SparkServer, params: Any):
        return st.metrics_payload()

    @ls.feature(DOCUMENT_METHOD)
    def document(ls: SparkServer, params: Any):
        # the server's copy of a document, for a client to check that both copies agree
        uri = params.get("uri") if isinstance(params, dict) else getattr(params, "uri", None)
        if not isinstance(uri, str):
            raise InvalidParams(f"{DOCUMENT_METHOD} takes {{uri}}")
        doc = ls.document(uri)
        return {"uri": uri, "version": doc.version, "text": doc.source}

    return ls
