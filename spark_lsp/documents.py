"""Text positions: LSP (line, UTF-16 code unit) positions <-> Python string offsets, and minimal edits.

LSP clients count characters in UTF-16 code units by default, Python strings in code points; every
conversion between the two goes through here so an emoji or CJK text never shifts a suggestion.
Lines end at "\\n", "\\r\\n" or "\\r" as the LSP specification says.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

_LINE_RE = re.compile(r"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+$")


class PositionError(ValueError):
    """A position that is not a pair of non-negative integers (the request's params are invalid)."""


def split_lines(text: str) -> list[str]:
    """Lines of `text` with their line endings kept; a trailing empty line is included."""
    lines = _LINE_RE.findall(text)
    if not lines or lines[-1].endswith(("\n", "\r")):
        lines.append("")
    return lines


_EOL_RE = re.compile(r"\r\n|\r|\n")


def line_ending(text: str, default: str = "\n") -> str:
    """The line break `text` uses: the most common of "\\n", "\\r\\n" and "\\r" (a tie goes to
    "\\n", then "\\r\\n"); `default` when it has none. Editors keep one per document."""
    crlf = text.count("\r\n")
    lf, cr = text.count("\n") - crlf, text.count("\r") - crlf
    if not (lf or crlf or cr):
        return default
    return max((lf, "\n"), (crlf, "\r\n"), (cr, "\r"), key=lambda c: c[0])[1]


def normalize_eol(text: str, eol: str = "\n") -> str:
    """`text` with every line break ("\\r\\n", "\\r" or "\\n") made `eol`, as editors convert the text
    an edit inserts to the document's line ending (VS Code to its EOL setting, Neovim to its lines)."""
    if "\r" not in text and (eol == "\n" or "\n" not in text):
        return text
    return _EOL_RE.sub(eol, text)


def lsp_lines(text: str) -> list[str]:
    """Lines of `text` with their endings kept, as str.splitlines(True) gives them but breaking only
    at LSP line ends ("\\n", "\\r\\n", "\\r"); no trailing empty line."""
    return _LINE_RE.findall(text)


def _unit(ch: str, enc: str) -> int:
    o = ord(ch)
    if enc == "utf-8":
        return 1 if o < 0x80 else 2 if o < 0x800 else 3 if o < 0x10000 else 4
    if enc == "utf-32":
        return 1
    return 2 if o > 0xFFFF else 1


def utf16_len(s: str, enc: str = "utf-16") -> int:
    """Length of `s` in code units of `enc` (UTF-16 by default)."""
    if s.isascii() or enc == "utf-32":
        return len(s)
    if enc == "utf-8":
        return len(s.encode("utf-8", "surrogatepass"))
    return len(s) + sum(1 for ch in s if ord(ch) > 0xFFFF)


def utf16_to_index(line: str, units: int, enc: str = "utf-16") -> int:
    """Code-point index in `line` of the column `units` in `enc` code units (a column inside a
    multi-unit character goes past it)."""
    if units <= 0:
        return 0
    if line.isascii() or enc == "utf-32":
        return min(units, len(line))
    count = 0
    for i, ch in enumerate(line):
        count += _unit(ch, enc)
        if count >= units:
            return i + 1
    return len(line)


def strip_eol(line: str) -> str:
    return line.rstrip("\r\n")


@dataclass(frozen=True)
class Pos:
    """A zero-based (line, UTF-16 character) position, independent of lsprotocol."""

    line: int
    character: int


# -- line index for large documents --------------------------------------------------------------
INDEXED_CHARS = 1 << 18  # documents this large get a line index: per-keystroke work not O(lines)


class LineIndex:
    """The offset where each line of `text` starts (LSP line breaks), so a position in a large
    document is found by one lookup rather than a scan from its start. An edit derives the new
    text's index from the old one (`replaced`), so typing in a 200,000-line file costs a few
    array operations, not a pass over the document."""

    __slots__ = ("text", "starts", "has_cr")

    def __init__(self, text: str, starts: np.ndarray, has_cr: bool) -> None:
        self.text, self.starts, self.has_cr = text, starts, has_cr

    @classmethod
    def build(cls, text: str) -> LineIndex:
        has_cr = "\r" in text
        if not has_cr:
            codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
            ends = np.flatnonzero(codes == 10) + 1
        else:
            ends = np.fromiter((m.end() for m in _EOL_RE.finditer(text)), dtype=np.int64)
        return cls(
            text, np.concatenate((np.zeros(1, dtype=np.int64), ends.astype(np.int64))), has_cr
        )

    def line_start(self, line: int) -> int | None:
        return int(self.starts[line]) if line < len(self.starts) else None

    def content(self, line: int) -> str:
        """Line `line` without its line break."""
        start = int(self.starts[line])
        end = int(self.starts[line + 1]) if line + 1 < len(self.starts) else len(self.text)
        return strip_eol(self.text[start:end])

    def line_of(self, offset: int) -> int:
        return int(np.searchsorted(self.starts, offset, side="right")) - 1

    def replaced(self, s: int, e: int, new: str, new_text: str) -> LineIndex:
        """The index of `new_text` = text[:s] + new + text[e:]. Only for texts without "\r" on
        either side (a "\r" next to the edit could join or split a "\r\n"): else rebuilt."""
        if "\r" in new or self.has_cr:
            return LineIndex.build(new_text)
        k = int(np.searchsorted(self.starts, s, side="right"))
        m = int(np.searchsorted(self.starts, e, side="right"))
        inserted = [s + i + 1 for i, ch in enumerate(new) if ch == "\n"] if "\n" in new else []
        return LineIndex(
            new_text,
            np.concatenate(
                (
                    self.starts[:k],
                    np.asarray(inserted, dtype=np.int64),
                    self.starts[m:] + (len(new) - (e - s)),
                )
            ),
            False,
        )


_INDEXES: OrderedDict[int, LineIndex] = OrderedDict()
_INDEX_LOCK = threading.Lock()
_INDEX_KEEP = 8


def line_index(text: str) -> LineIndex | None:
    """The line index of a large text (built on first use and kept for the few texts in use);
    None for a text small enough to scan."""
    if len(text) < INDEXED_CHARS:
        return None
    with _INDEX_LOCK:
        idx = _INDEXES.get(id(text))
        if idx is not None and idx.text is text:
            _INDEXES.move_to_end(id(text))
            return idx
    return _remember(LineIndex.build(text))


def _remember(idx: LineIndex) -> LineIndex:
    with _INDEX_LOCK:
        _INDEXES[id(idx.text)] = idx
        _INDEXES.move_to_end(id(idx.text))
        while len(_INDEXES) > _INDEX_KEEP:
            _INDEXES.popitem(last=False)
    return idx


def _check_position(line: object, character: object) -> None:
    for name, v in (("line", line), ("character", character)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise PositionError(f"position {name} must be an integer, got {v!r}")
        if v < 0:
            raise PositionError(f"position {name} must not be negative, got {v}")


def _line_start(text: str, line: int) -> int | None:
    """Offset where `line` begins in a text whose lines end in "\n" only; None past the end."""
    start = 0
    for _ in range(line):
        nl = text.find("\n", start)
        if nl < 0:
            return None
        start = nl + 1
    return start


def offset_at(
    text: str,
    line: int,
    character: int,
    *,
    lines: list[str] | None = None,
    strict: bool = True,
    enc: str = "utf-16",
) -> int:
    """String offset of an LSP position, read the way the specification says: a character past
    the end of its line means the line's end (Neovim's visual-line ranges and `v:maxcol` send
    such characters) and a line past the last line means the end of the document. A negative or
    non-integer value raises PositionError; without `strict` it is read as 0."""
    if strict:
        _check_position(line, character)
    else:
        line = line if isinstance(line, int) and line > 0 else 0
        character = character if isinstance(character, int) and character > 0 else 0
    idx = line_index(text) if lines is None else None
    if idx is not None:
        start = idx.line_start(line)
        if start is None:
            return len(text)
        return start + utf16_to_index(idx.content(line), character, enc)
    if lines is None and "\r" not in text:  # fast path: find the line start without splitting
        start = _line_start(text, line)
        if start is None:
            return len(text)
        end = text.find("\n", start)
        content = text[start:] if end < 0 else text[start:end]
        return start + utf16_to_index(content, character, enc)
    lines = lines if lines is not None else split_lines(text)
    if line >= len(lines):
        return len(text)
    start = sum(len(ln) for ln in lines[:line])
    return start + utf16_to_index(strip_eol(lines[line]), character, enc)


def in_document(text: str, line: int, character: int, enc: str = "utf-16") -> bool:
    """Whether a (valid) position lies inside the document as it stands, without clamping."""
    idx = line_index(text)
    if idx is not None:
        if line >= len(idx.starts):
            return False
        content = idx.content(line)
    elif "\r" in text:
        lines = split_lines(text)
        if line >= len(lines):
            return False
        content = strip_eol(lines[line])
    else:
        start = _line_start(text, line)
        if start is None:
            return False
        end = text.find("\n", start)
        content = text[start:] if end < 0 else text[start:end]
    return character <= utf16_len(content, enc)


def apply_change(
    text: str, start: Pos, end: Pos, new_text: str, enc: str = "utf-16"
) -> tuple[str, bool]:
    """(`text` with the range start..end replaced by `new_text`, whether the range had to be read
    leniently). Positions past a line's end or the document's end are clamped as the specification
    says; a range whose end comes before its start is read with the two swapped. Negative or
    non-integer positions raise PositionError: such a change cannot be applied."""
    _check_position(start.line, start.character)
    _check_position(end.line, end.character)
    lenient = not (
        in_document(text, start.line, start.character, enc)
        and in_document(text, end.line, end.character, enc)
    )
    s = offset_at(text, start.line, start.character, enc=enc)
    e = offset_at(text, end.line, end.character, enc=enc) if end != start else s
    if e < s:
        s, e, lenient = e, s, True
    out = text[:s] + new_text + text[e:]
    idx = line_index(text)
    if idx is not None and len(out) >= INDEXED_CHARS:
        _remember(idx.replaced(s, e, new_text, out))
    return out, lenient


def position_at(text: str, offset: int, enc: str = "utf-16") -> Pos:
    """LSP position of a string offset (clamped to the document)."""
    offset = max(0, min(offset, len(text)))
    idx = line_index(text)
    if idx is not None:
        line = idx.line_of(offset)
        start = int(idx.starts[line])
        if offset > start and text[offset - 1] == "\r" and text[offset : offset + 1] == "\n":
            pass  # inside a "\r\n": the same as the general path below
        else:
            return Pos(line, utf16_len(text[start:offset], enc))
    if "\r" not in text:
        line_start = text.rfind("\n", 0, offset) + 1
        return Pos(text.count("\n", 0, offset), utf16_len(text[line_start:offset], enc))
    lines = split_lines(text[:offset])
    return Pos(len(lines) - 1, utf16_len(lines[-1], enc))


def advance(pos: Pos, inserted: str, enc: str = "utf-16") -> Pos:
    """Position just after `inserted` when it is inserted at `pos`."""
    lines = split_lines(inserted)
    if len(lines) == 1:
        return Pos(pos.line, pos.character + utf16_len(lines[0], enc))
    return Pos(pos.line + len(lines) - 1, utf16_len(lines[-1], enc))


@dataclass(frozen=True)
class Edit:
    """Replace text[start:end] with `new_text` (offsets into the old text)."""

    start: int
    end: int
    new_text: str


def minimal_edit(old: str, new: str, base: int = 0) -> Edit | None:
    """The single smallest replacement that turns `old` into `new` (common prefix and suffix
    trimmed), with offsets shifted by `base`; None when they are equal."""
    if old == new:
        return None
    n = min(len(old), len(new))
    p = 0
    while p < n and old[p] == new[p]:
        p += 1
    s = 0
    while s < n - p and old[len(old) - 1 - s] == new[len(new) - 1 - s]:
        s += 1
    # Never split a "\r\n" pair or a surrogate-sensitive boundary across the edit.
    while p > 0 and old[p - 1] == "\r" and p < len(old) and old[p] == "\n":
        p -= 1
    while (
        s > 0 and old[len(old) - s] == "\n" and len(old) - s > p and old[len(old) - s - 1] == "\r"
    ):
        s -= 1  # (an LSP range cannot end between the two either: it would take the whole break)
    return Edit(base + p, base + len(old) - s, new[p : len(new) - s])


def minimal_edits(old: str, new: str, base: int = 0) -> list[Edit]:
    """Minimal line-level edits turning `old` into `new`: unchanged lines are never rewritten, so a
    rewrite that keeps most of a function touches only the lines that changed."""
    import difflib

    a, b = split_lines(old), split_lines(new)
    edits: list[Edit] = []
    a_off = [0]
    for ln in a:
        a_off.append(a_off[-1] + len(ln))
    matcher = difflib.SequenceMatcher(a=a, b=b, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            continue
        old_chunk = "".join(a[i1:i2])
        new_chunk = "".join(b[j1:j2])
        edit = minimal_edit(old_chunk, new_chunk, base + a_off[i1])
        if edit is not None:
            edits.append(edit)
    return edits


def apply_edits(text: str, edits: list[Edit]) -> str:
    """Apply non-overlapping edits given in old-text offsets."""
    out, last = [], 0
    for e in sorted(edits, key=lambda e: e.start):
        if e.start < last:
            raise ValueError("overlapping edits")
        out.append(text[last : e.start])
        out.append(e.new_text)
        last = e.end
    out.append(text[last:])
    return "".join(out)


def line_at(text: str, offset: int) -> tuple[str, str]:
    """(text of the line before offset, text of the line after offset), without line endings."""
    start = max(text.rfind("\n", 0, offset), text.rfind("\r", 0, offset)) + 1
    m = re.compile(r"\r|\n").search(text, offset)
    end = m.start() if m else len(text)
    return text[start:offset], text[offset:end]


def indentation(line: str) -> str:
    return line[: len(line) - len(line.lstrip(" \t"))]
