"""`Editor` (what the services need from the editor) over a pygls LanguageServer."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable

from lsprotocol import types as T
from pygls.lsp.server import LanguageServer

from .documents import Pos
from .status import STATUS_METHOD

log = logging.getLogger("spark_lsp")

_LEVELS = {
    "error": (T.MessageType.Error, logging.ERROR),
    "warning": (T.MessageType.Warning, logging.WARNING),
    "info": (T.MessageType.Info, logging.INFO),
}


def lsp_position(p: Pos) -> T.Position:
    return T.Position(line=p.line, character=p.character)


class _LspProgress:
    def __init__(self, ls: LanguageServer, token: str) -> None:
        self.ls, self.token = ls, token

    def report(self, message: str, percentage: int | None = None) -> None:
        try:
            self.ls.work_done_progress.report(
                self.token, T.WorkDoneProgressReport(message=message, percentage=percentage)
            )
        except Exception:
            pass

    def end(self, message: str) -> None:
        try:
            self.ls.work_done_progress.end(self.token, T.WorkDoneProgressEnd(message=message))
            self.ls.work_done_progress.tokens.pop(self.token, None)
        except Exception:
            pass


class LspEditor:
    """The editor at the other end of a pygls connection (capabilities as the client declared)."""

    def __init__(self, ls: LanguageServer) -> None:
        self.ls = ls
        self._tokens = itertools.count(1)

    def log(self, message: str, level: str = "info") -> None:
        kind, py_level = _LEVELS[level]
        log.log(py_level, message)
        try:
            self.ls.window_log_message(T.LogMessageParams(type=kind, message=message))
        except Exception:
            pass

    def show_error(self, message: str) -> None:
        self.ls.window_show_message(T.ShowMessageParams(type=T.MessageType.Error, message=message))

    def show_warning(self, message: str) -> None:
        self.ls.window_show_message(
            T.ShowMessageParams(type=T.MessageType.Warning, message=message)
        )

    def notify_status(self, payload: dict) -> None:
        self.ls.protocol.notify(STATUS_METHOD, payload)

    @property
    def versioned_edits(self) -> bool:
        return self._capability("workspace", "workspace_edit", "document_changes")

    def _capability(self, section: str, *path: str) -> bool:
        obj = getattr(self.ls.client_capabilities, section, None)
        for name in path:
            obj = getattr(obj, name, None)
        return bool(obj)

    async def begin_progress(
        self,
        title: str,
        message: str,
        cancellable: bool = False,
        on_cancel: Callable[[], None] | None = None,
    ) -> _LspProgress | None:
        if not self._capability("window", "work_done_progress"):
            return None
        token = f"spark-{'edit' if cancellable else 'load'}-{next(self._tokens)}"
        try:
            await self.ls.work_done_progress.create_async(token)
            self.ls.work_done_progress.begin(
                token,
                T.WorkDoneProgressBegin(
                    title=title, cancellable=cancellable or None, message=message
                ),
            )
        except Exception as exc:
            log.debug("progress unavailable: %s", exc)
            return None
        fut = self.ls.work_done_progress.tokens.get(token)
        if fut is not None and on_cancel is not None:  # pygls cancels it on the client's cancel
            fut.add_done_callback(lambda f: f.cancelled() and on_cancel())
        return _LspProgress(self.ls, token)

    async def apply_edit(
        self, uri: str, edits: list[tuple[Pos, Pos, str]], version: int | None, label: str | None
    ) -> bool:
        text_edits = [
            T.TextEdit(T.Range(lsp_position(s), lsp_position(e)), new) for s, e, new in edits
        ]
        if version is not None and self.versioned_edits:
            edit = T.WorkspaceEdit(
                document_changes=[
                    T.TextDocumentEdit(
                        T.OptionalVersionedTextDocumentIdentifier(uri=uri, version=version),
                        text_edits,
                    )
                ]
            )
        else:
            edit = T.WorkspaceEdit(changes={uri: text_edits})
        res = await self.ls.workspace_apply_edit_async(
            T.ApplyWorkspaceEditParams(edit=edit, label=label)
        )
        return bool(getattr(res, "applied", False))
