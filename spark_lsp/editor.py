"""What the services need from the editor, as an interface free of any LSP library.

The services (`spark_lsp.inline`, `spark_lsp.live_edits`, `spark_lsp.state`) talk to the editor
only through `Editor`; `spark_lsp.lsp_editor.LspEditor` implements it over pygls. Keeping the
port this small lets the services be tested with a scripted editor and keeps pygls in the
server's outer layer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from .documents import Pos


class Progress(Protocol):
    """A progress indicator shown in the editor while a long job runs."""

    def end(self, message: str) -> None: ...

    def report(self, message: str, percentage: int | None = None) -> None:
        """Update the indicator's message (and percentage) while the job runs."""


class Editor(Protocol):
    def log(self, message: str, level: str = "info") -> None:
        """A line in the editor's log (`window/logMessage`); level: info | warning | error."""

    def show_error(self, message: str) -> None:
        """A message the user sees (`window/showMessage`)."""

    def show_warning(self, message: str) -> None:
        """A warning the user sees (`window/showMessage`, type Warning)."""

    def notify_status(self, payload: dict) -> None:
        """The `spark/status` notification for status bars."""

    async def begin_progress(
        self,
        title: str,
        message: str,
        cancellable: bool = False,
        on_cancel: Callable[[], None] | None = None,
    ) -> Progress | None:
        """Show a progress indicator; None when the editor has none. `on_cancel` runs when the
        user presses its cancel button."""

    @property
    def versioned_edits(self) -> bool:
        """The client refuses an edit made for a version its document has moved past (LSP's
        `workspaceEdit.documentChanges`)."""

    async def apply_edit(
        self, uri: str, edits: list[tuple[Pos, Pos, str]], version: int | None, label: str | None
    ) -> bool:
        """Apply text edits (start, end, new text) to a document; with `version`, a client whose
        document moved past it refuses them. True when the client applied them."""
