"""Cancellation: one token passed from whoever asked for the work down to ONNX Runtime.

A :class:`CancelToken` is cancelled once, from any thread, with a reason. Work checks it between
steps (``check()`` raises :class:`Cancelled`), and a step in flight is stopped by a callback the
work registers (a generation sets ``RunOptions.terminate``, aborting the ONNX Runtime run).
Tokens form a tree: cancelling one cancels its children, never its parent, so a generation that
stops early on its own (its own child token) leaves the job that started it running.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class Cancelled(Exception):
    """Work stopped because its token was cancelled; ``str()`` is the reason."""


class CancelToken:
    """A thread-safe, one-shot cancellation flag with a reason and callbacks."""

    def __init__(self, parent: CancelToken | None = None) -> None:
        self._lock = threading.Lock()
        self._reason: str | None = None
        self._callbacks: list[Callable[[str], None]] = []
        if parent is not None:
            parent.on_cancel(self.cancel)

    @property
    def cancelled(self) -> bool:
        return self._reason is not None

    @property
    def reason(self) -> str:
        """Why it was cancelled ("" while it is not)."""
        return self._reason or ""

    def cancel(self, reason: str = "cancelled") -> bool:
        """Cancel (runs the callbacks in this thread); False if it already was."""
        with self._lock:
            if self._reason is not None:
                return False
            self._reason = reason
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn(reason)
        return True

    def on_cancel(self, fn: Callable[[str], None]) -> None:
        """Call ``fn(reason)`` when the token is cancelled (at once if it already is)."""
        with self._lock:
            if self._reason is None:
                self._callbacks.append(fn)
                return
        fn(self._reason)

    def child(self) -> CancelToken:
        """A token cancelled with this one that can also be cancelled on its own."""
        return CancelToken(parent=self)

    def check(self) -> None:
        """Raise :class:`Cancelled` if the token is cancelled."""
        if self._reason is not None:
            raise Cancelled(self._reason)
