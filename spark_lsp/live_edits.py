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
A change the user makes inside the generated text (typing at its end, where the model writes, or
in it) steers the generation when the model can be steered (`Steering`, the `steer` of the
engine service; the in-process engine steers the same way): the region's generated text, as the
user left it, becomes the typed text. If the model was about to write it, it goes on (typing
through); if not, it stops and a successor continues after the typed text, and its output streams
on after it. The user's text is never overwritten. Any other change to the document (elsewhere,
or one that only deletes the end of the generated text) is the user's taking over, and stops the
session within one decode step. A cancel (`spark.cancel`, the progress's cancel button) stops it
too: no edit is sent after it, not even the final one when the generation had already finished.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass
from typing import Any

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


class Steering:
    """The user's text for a live edit's generated output, handed to the stream writing it.

    The engine thread attaches each generation (`completions.generate_steps`); the event loop
    calls `send` with the whole output as the user now has it. Only additions reach the stream
    (`Stream.steer` takes text typed after what was typed before); an attempt started after a
    lead (`starting`) is steered with the text after the lead. A change to text typed before (a
    second keystroke inside the output, a typo fixed in the lead) cannot be said to the stream:
    the generation is stopped (`restarting`, which `generate_steps` checks at every chunk) and a
    successor starts with the output as the user has it as its lead (`take_late`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._gen: Any = None
        self._lead = ""
        self._next_lead = ""
        self._ended = False  # a generation was attached and has ended
        # a successor must start after the user's text: typing came after the generation ended,
        # or changed text typed before (see `send`)
        self._late = False
        self.typed = ""  # the output as the user left it (empty: never steered)
        self._successor_due = False  # `take_late` said a successor must start; none has yet
        self.successors = 0  # generations started after the user's text

    def starting(self, lead: str) -> Steering:
        """The next attempt's output begins with `lead` (text the model did not write): the
        user's text, when it is the successor `take_late` asked for."""
        with self._lock:
            self._next_lead = lead
            if lead and self._successor_due:
                self._successor_due = False
                self.successors += 1
        return self

    def attach(self, gen: Any) -> None:
        with self._lock:
            self._gen, self._lead = gen, self._next_lead

    def detach(self, gen: Any) -> None:
        with self._lock:
            if self._gen is gen:
                self._gen = None
                self._ended = True

    def send(self, typed: str) -> bool:
        """The output as the user now has it; False when no generation has run yet (nothing to
        steer).

        Typing that comes after the generation ended (the editor shows its output later than
        the engine makes it) is taken too: `take_late` then tells the live edit to start a
        successor that continues after the typed text, as a steer of a running generation
        would have. So is a change to text typed before, or to the lead: the running generation
        stops (`restarting`) and a successor starts after the user's text in the same way."""
        with self._lock:
            gen, lead = self._gen, self._lead
            if gen is None and not self._ended:
                return False
            extends = typed.startswith(self.typed) and typed.startswith(lead)
            sent = max(len(self.typed), len(lead))
            self.typed = typed
            if gen is None or not extends or self._late:
                self._late = True  # a successor after `typed` (a restart already pending takes it)
            elif len(typed) > sent:
                gen.steer(typed[sent:])
            return True

    @property
    def restarting(self) -> bool:
        """The user changed text typed before while a generation runs: it must stop, and a
        successor start after their text."""
        return self._late and self._gen is not None

    def take_late(self) -> bool:
        """Whether a successor must start after the user's text (since the last call): they
        typed after the generation ended, or changed what they typed before."""
        with self._lock:
            late, self._late = self._late, False
            self._successor_due = self._successor_due or late
            return late


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
        # what the editor has confirmed: (document, region text, generated text the region shows)
        self._confirmed = (doc_text, self.original, "")
        self._pending: collections.deque[tuple[str, str, str]] = collections.deque()
        self._generated = ""  # the generated text (head + output) of the last frame
        # set: the user's typing in the generated text steers the generation
        self.steering: Steering | None = None
        self.head = 0  # characters of fixed text starting the generated text (not steerable)
        self.steers = 0  # user changes that steered the generation
        self.unsteerable: str | None = None  # why a change inside the output could not steer it
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
        self._generated = generated
        return frame(self.original, generated, final, self.eol, self.line_after)

    @property
    def typed(self) -> str | None:
        """The output as the user left it when they steered the generation (None: never)."""
        return self.steering.typed if self.steering is not None and self.steers else None

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
        self._pending.append((self._doc, region_text, self._generated))
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
            self._pending.pop()
            # the region is as the client last confirmed it (or as the user's steer left it)
            self._doc, self.shown = self._confirmed[0], self._confirmed[1]

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
                self._pending.popleft()
            self._confirmed = self._pending.popleft()
            if version is not None:
                self.version = version
            return True
        if self._steer(doc_text, version):
            return False
        # a user's version is never adopted: an edit still computed against the old text must be refused
        if not self.stopped_by_user:
            self.stopped_by_user = True
            self.token.cancel("user typed")
        return False

    def _steer(self, doc_text: str, version: int | None) -> bool:
        """A change by the user inside the generated text steers the generation; True if it did.
        Our edits not confirmed yet were computed for the text before it: the client refuses
        them (they are versioned), and the region is taken as the user left it."""
        if self.steering is None or self.stopped or version is None:
            return False
        doc, shown, generated = self._confirmed
        if "\r" in generated or "\r" in doc_text:  # line breaks the editor converts: not mapped
            self.unsteerable = "carriage return"
            return False
        e = minimal_edit(doc, doc_text)
        a = self.region_start
        if e is None or e.start < a + self.head or e.end > a + len(generated):
            self.unsteerable = "outside the written text"
            return False
        new = doc_text[e.start : len(doc_text) - (len(doc) - e.end)]
        mine = generated[: e.start - a] + new + generated[e.end - a :]
        output = generated[self.head :]
        typed = mine[self.head :]
        if len(typed) < len(output) and output.startswith(typed):
            self.unsteerable = "deleted the end"  # the user takes over
            return False
        if not self.steering.send(typed):
            self.unsteerable = "no generation to steer"
            return False
        shown = doc_text[a : a + len(shown) + len(doc_text) - len(doc)]
        self._confirmed = (doc_text, shown, mine)
        self._doc, self.shown, self._generated = doc_text, shown, mine
        self._expected.clear()
        self._pending.clear()
        self.version = version
        self.steers += 1
        return True
