"""Edits that stream into the document while the model writes them, and stop when the user types.

A session owns one region of one document. Each flush turns "what the region shows now" into
"what it should show" with minimal TextEdits sent by `workspace/applyEdit`. Generated lines
overwrite the original lines one by one (the rest of the original stays below until the final
flush), so an interrupted rewrite leaves valid text and what was written stays.

Generated text is written with the document's own line ending (a CRLF document stays CRLF), as
editors convert the text an edit inserts anyway (VS Code to the document's EOL, Neovim to its lines):
the text our edit produces in the client is then the text we expect.

Our own edits come back as `didChange`; they are recognised by the document text they produce
(compared exactly, else modulo line endings, in case a client converts them in a way not foreseen).
Any other change to the document is the user's, and stops the session within one decode step. A
cancel (`spark.cancel`, the progress's cancel button) stops it too: no edit is sent after it, not
even the final one when the generation had already finished.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

from engine.cancel import CancelToken

from .documents import Pos, advance, line_ending, minimal_edit, normalize_eol, split_lines


@dataclass
class RangeEdit:
    start: Pos
    end: Pos
    new_text: str


def frame(
    original: str, generated: str, final: bool, eol: str = "\n", line_after: bool = False
) -> str:
    """What the region shows mid-stream: the generated text, then the original lines it has not
    overwritten yet (a partial last line overwrites its original line too, and ends in a line
    break if the region did, or if `line_after`: the region ends where a line of the document
    starts, as text inserted above a line does). The generated text's line breaks become `eol`,
    the document's line ending."""
    generated = normalize_eol(generated, eol)
    if final:
        return generated
    gen_lines = split_lines(generated)
    orig_lines = split_lines(original)
    # complete generated lines replace as many original lines; a partial line replaces one more
    covered = len(gen_lines) - (1 if gen_lines[-1] == "" else 0)
    rest = "".join(orig_lines[covered:])
    # a partial last line is closed with a line break whenever the region's text goes on after it:
    # more original lines, or the line after the region (an interrupted rewrite must not join them)
    if (
        generated
        and not generated.endswith(("\n", "\r"))
        and (rest or line_after or original.endswith(("\n", "\r")))
    ):
        return generated + eol + rest
    return generated + rest


class LiveEdit:
    """State of one streamed edit: the region, what it shows, and the texts our edits produce."""

    def __init__(
        self,
        uri: str,
        doc_text: str,
        start: int,
        end: int,
        start_pos: Pos,
        enc: str = "utf-16",
        version: int | None = None,
    ):
        self.uri = uri
        # the document version our next edit applies to: the last one seen, or the one our last
        # applied edit produced when its didChange has not arrived yet (clients count one per edit)
        self.version = version
        self.enc = enc
        self.region_start = start
        self.start_pos = start_pos
        self.original = doc_text[start:end]
        self.eol = line_ending(doc_text)  # what generated line breaks are written as
        # the region ends where a line starts: a partial generated line must not run into it
        self.line_after = end < len(doc_text) and (end == 0 or doc_text[end - 1] in "\r\n")
        self.shown = self.original  # region text as the document has it now
        self._doc = doc_text  # document text once all our sent edits apply
        self._expected: collections.deque[str] = collections.deque()
        self.stopped_by_user = False
        self.cancelled: str | None = None  # why the user cancelled the edit, once they did
        # cancelled when the user types or cancels: the parent of the edit's engine job
        self.token = CancelToken()
        self.flushes = 0

    @property
    def stopped(self) -> bool:
        """The user typed or cancelled: no further edit may be sent."""
        return self.stopped_by_user or self.cancelled is not None

    def cancel(self, reason: str) -> bool:
        """The user asked to stop (`reason` says how); False if the session had already stopped."""
        if self.stopped:
            return False
        self.cancelled = reason
        self.token.cancel(reason)
        return True

    def frame(self, generated: str, final: bool) -> str:
        """The region's text for `generated` (see `frame`), in the document's line ending."""
        return frame(self.original, generated, final, self.eol, self.line_after)

    def edits_to(self, region_text: str) -> list[RangeEdit]:
        """Minimal edits turning the region's current text into `region_text`; records the
        document text they will produce so the echoing didChange is recognised as ours."""
        # one TextEdit per flush: every client echoes it as one didChange we can recognise
        edit = minimal_edit(self.shown, region_text)
        if edit is None:
            return []
        edits = [edit]
        out = []
        for e in edits:
            s = advance(self.start_pos, self.shown[: e.start], self.enc)
            t = advance(self.start_pos, self.shown[: e.end], self.enc)
            out.append(RangeEdit(s, t, e.new_text))
        a = self.region_start
        self._doc = self._doc[:a] + region_text + self._doc[a + len(self.shown) :]
        self.shown = region_text
        self._expected.append(self._doc)
        self.flushes += 1
        return out

    def applied(self, sent_version: int | None) -> None:
        """The client applied the edit we sent for `sent_version`."""
        if sent_version is not None and (self.version is None or self.version <= sent_version):
            self.version = sent_version + 1

    def rejected(self) -> None:
        """The client did not apply our last edit."""
        if self._expected:
            self._expected.pop()

    def on_did_change(self, doc_text: str, version: int | None = None) -> bool:
        """Feed every didChange of the document; returns True if it was ours. A change that is
        not ours is the user's: the session stops (once)."""
        if doc_text not in self._expected and (
            "\r" in doc_text or any("\r" in e for e in self._expected)
        ):
            # a client that converted our line breaks otherwise than to the document's line ending
            norm = normalize_eol(doc_text)
            doc_text = next((e for e in self._expected if normalize_eol(e) == norm), doc_text)
        if doc_text in self._expected:
            while self._expected and self._expected.popleft() != doc_text:
                pass
            if version is not None:
                self.version = version
            return True
        # a user's version is never adopted: an edit still computed against the old text must be refused
        if not self.stopped_by_user:
            self.stopped_by_user = True
            self.token.cancel("user typed")
        return False
