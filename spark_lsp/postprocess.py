"""Turning raw model output into a suggestion an editor can show and the user can accept.

Users' top complaints about AI completions are suggestions that repeat the text after the cursor,
leave brackets or quotes unbalanced, come back at the wrong indentation, or loop (a small model's
greedy output can repeat a line or a phrase until the token budget runs out); each rule here fixes one.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass

from .documents import indentation

OPENERS = {"(": ")", "[": "]", "{": "}"}
CLOSERS = {v: k for k, v in OPENERS.items()}
BLOCK_OPENERS = (":", "{", "(", "[", "=>", "->")

#: A line that loops: a run of 2..LOOP_UNIT_TOKENS tokens (words and marks, spaces ignored) holding
#: at least two different words, LINE_LOOP_REPEATS times in a row ("of the items of the items of
#: the items of the items").  Lists like ``[0, 0, 0, 0]`` or ``# -----`` have one word or none.
LINE_LOOP_REPEATS = 4
LOOP_UNIT_TOKENS = 12
#: ... or a run of 1..LOOP_UNIT_TOKENS tokens that opens a bracket it does not close, NEST_REPEATS
#: times in a row (``List[List[List[``).
NEST_REPEATS = 3
#: A block that loops: a run of 2..LOOP_UNIT_LINES lines (compared stripped, blank lines skipped)
#: BLOCK_LOOP_REPEATS times in a row, or one line LINE_REPEATS times (tests and tables repeat a
#: line three times often enough: 57 of the 1,758 stdlib files the model trained on do).
BLOCK_LOOP_REPEATS = 3
LINE_REPEATS = 4
LOOP_UNIT_LINES = 4
_TOKEN = re.compile(r"\w+|[^\w\s]")
_WORD = re.compile(r"\w")


@dataclass(frozen=True)
class Context:
    """What the cursor sits in: the text of its line around it and the lines after it."""

    line_before: str  # cursor line, before the cursor
    line_after: str  # cursor line, after the cursor (no line ending)
    next_lines: tuple[str, ...] = ()  # a few following lines, without line endings
    prev_lines: tuple[str, ...] = ()  # a few preceding lines (nearest last), without line endings
    python: bool = False  # indentation is syntax: a block ends at an unexpected indent

    @property
    def mid_line(self) -> bool:
        return bool(self.line_after.strip())


def choose_multiline(ctx: Context) -> bool:
    """Multi-line at the end of a block opener or on an empty line inside a block; otherwise the
    rest of the current line only."""
    if ctx.mid_line:
        return False
    before = ctx.line_before.rstrip()
    if before.endswith(BLOCK_OPENERS):
        return True
    if before == "":
        prev = next((p for p in reversed(ctx.prev_lines) if p.strip()), "")
        if not prev:
            return True  # empty file or top of file: a whole definition is welcome
        return (
            bool(indentation(ctx.line_before))
            or prev.rstrip().endswith(BLOCK_OPENERS)
            or bool(indentation(prev))
        )
    return False


_OPERAND_END = re.compile(r"[\w)\]}'\"]$")
_OPERAND_START = re.compile(r"^[\w'\"]")
#: shortest overlap of letters or digits between a suggestion's end and the text after the cursor
#: that is taken as the model re-typing that text (punctuation: any length)
MIN_WORD_OVERLAP = 3


def merge_mid_line(text: str, line_after: str) -> str | None:
    """A mid-line suggestion made to fit the rest of the line: the end it shares with the text
    after the cursor dropped (suffix overlap over the whole rest of the line); None when it
    cannot merge with that text (it would run into it: ``items[name]`` before ``items.get(``)."""
    if not line_after.strip():
        return text
    text = _strip_suffix_overlap(text, line_after)
    lead = line_after.lstrip(" \t")
    spaced = lead != line_after
    if not text:
        return text
    if text.endswith((" ", "\t")) or spaced:
        return text
    if _OPERAND_END.search(text) and _OPERAND_START.match(lead):
        return None
    return text


def _strip_suffix_overlap(text: str, line_after: str) -> str:
    """Drop the end of a single-line suggestion that repeats what already follows the cursor."""
    after = line_after.strip()
    if not after:
        return text
    if text.rstrip().endswith(after):
        return text.rstrip()[: len(text.rstrip()) - len(after)]
    # closers/quotes right after the cursor that the suggestion also typed: keep one copy
    lead = line_after.lstrip(" ")
    k = 0
    while k < len(lead) and lead[k] in ")]}\"':;,":
        k += 1
    for j in range(k, 0, -1):
        if text.endswith(lead[:j]):
            return text[: len(text) - j]
    # the model re-typed the start of the rest of the line: keep the part before it
    for j in range(len(lead), MIN_WORD_OVERLAP - 1, -1):
        head = lead[:j]
        if text.endswith(head) and (
            j == len(lead) or not (_WORD.match(lead[j]) and _WORD.match(head[-1]))
        ):
            return text[: len(text) - j]
    return text


def _nests(unit: list[str]) -> bool:
    """A unit that opens more brackets than it closes (``List [``): its repeats nest deeper and
    deeper (``List[List[List[``), which no code does on purpose."""
    depth = 0
    for w in unit:
        depth += (w in OPENERS) - (w in CLOSERS)
    return depth > 0 and any(_WORD.match(w) for w in unit)


def _loop_unit(words: list[str], i: int, p: int) -> bool:
    """Whether words[i:i+p] repeats from i: LINE_LOOP_REPEATS times holding two different words,
    or NEST_REPEATS times opening a bracket it does not close."""
    unit = words[i : i + p]
    if _nests(unit):
        repeats = NEST_REPEATS
    elif len({w for w in unit if _WORD.match(w)}) >= 2:
        repeats = LINE_LOOP_REPEATS
    else:
        return False
    if len(words) < i + repeats * p:
        return False
    return all(words[i + k * p : i + (k + 1) * p] == unit for k in range(1, repeats))


def nesting_loop(line: str) -> bool:
    """Whether ``line`` holds a unit that nests itself (``list[List[List[List[``)."""
    words = _TOKEN.findall(line)
    return any(
        _nests(words[i : i + p]) and _loop_unit(words, i, p)
        for i in range(len(words))
        for p in range(1, min(LOOP_UNIT_TOKENS, len(words) - i) + 1)
    )


def line_loop_start(line: str) -> int | None:
    """Offset in ``line`` where the first repeat of a looping phrase starts (None: no loop).

    Keeping ``line[:offset]`` keeps the phrase once: the text before the loop is usually fine."""
    toks = [(m.start(), m.group()) for m in _TOKEN.finditer(line)]
    words = [t for _, t in toks]
    for i in range(len(words)):
        for p in range(1, min(LOOP_UNIT_TOKENS, (len(words) - i) // NEST_REPEATS) + 1):
            if _loop_unit(words, i, p):
                return toks[i + p][0]
    return None


def line_loops(line: str) -> bool:
    """Whether ``line`` ends in a looping phrase: the cheap check streaming output runs per token."""
    words = _TOKEN.findall(line)
    return any(
        _loop_unit(words, len(words) - n * p, p)
        for n in (LINE_LOOP_REPEATS, NEST_REPEATS)
        for p in range(1, min(LOOP_UNIT_TOKENS, len(words) // n) + 1)
    )


def _block_loop(lines: list[str]) -> int:
    """How many trailing entries of ``lines`` (stripped non-blank lines, newest last) repeat the
    unit before them (LINE_REPEATS / BLOCK_LOOP_REPEATS occurrences in all): the ones to drop
    (0: no loop).  A unit holds a word: closing brackets at successive indents are not a loop."""
    for p in range(1, LOOP_UNIT_LINES + 1):
        repeats = LINE_REPEATS if p == 1 else BLOCK_LOOP_REPEATS
        if len(lines) < repeats * p:
            continue
        unit = lines[-p:]
        if any(_WORD.search(ln) for ln in unit) and all(
            lines[-(k + 1) * p : len(lines) - k * p] == unit for k in range(1, repeats)
        ):
            return (repeats - 1) * p
    return 0


def cut_loops(text: str) -> str:
    """``text`` up to its first loop, the looping phrase or lines kept once (any kind of output:
    suggestions, docstrings, rewrites)."""
    lines = text.split("\n")
    filled: list[int] = []  # indices of the non-blank lines so far
    for n, line in enumerate(lines):
        loop = line_loop_start(line)
        if loop is not None:
            return "\n".join(lines[:n] + [line[:loop].rstrip()])
        if line.strip():
            filled.append(n)
            drop = _block_loop(
                [lines[i].strip() for i in filled[-BLOCK_LOOP_REPEATS * LOOP_UNIT_LINES :]]
            )
            if drop:  # cut where the first repeated line starts
                return "\n".join(lines[: filled[-drop]]).rstrip()
    return text


def ends_in_loop(text: str) -> bool:
    """Whether streamed output has just started to loop (checked per token, so only its end):
    generation can stop, nothing after a loop is kept."""
    nl = text.rfind("\n")
    if line_loops(text[nl + 1 :]):
        return True
    if nl < 0:
        return False
    window = BLOCK_LOOP_REPEATS * LOOP_UNIT_LINES * 2  # lines, blank ones included
    tail = [ln.strip() for ln in text[:nl].rsplit("\n", window)[-window:] if ln.strip()]
    return _block_loop(tail) > 0


class _Lexer:
    """Strings and comments of code fed in pieces (a whole text, or line by line): ``marks`` yields
    the characters that matter outside them — brackets, and a ``#`` where a comment starts (the rest
    of its line is skipped).  Triple-quoted strings run across lines; others end at a line break.
    A rough scan, no tokenizer: enough to count brackets and find block openers."""

    def __init__(self) -> None:
        self.quote: str | None = None  # inside '...' or "..."
        self.triple: str | None = None  # inside '''...''' or """..."""

    def marks(self, text: str):
        i, n = 0, len(text)
        while i < n:
            if self.triple:
                end = text.find(self.triple, i)
                if end < 0:
                    return
                i, self.triple = end + 3, None
                continue
            ch = text[i]
            if self.quote:
                if ch == "\\":
                    i += 2
                    continue
                if ch == self.quote or ch == "\n":
                    self.quote = None
            elif text.startswith(('"""', "'''"), i):
                self.triple = text[i : i + 3]
                i += 3
                continue
            elif ch in "'\"":
                self.quote = ch
            elif ch == "#":
                yield i, ch
                nl = text.find("\n", i)
                if nl < 0:
                    return
                i = nl
                continue
            elif ch in OPENERS or ch in CLOSERS:
                yield i, ch
            i += 1


def _cut_unbalanced(text: str, ctx: Context) -> str:
    """Cut the suggestion at a closing bracket that nothing opened: one the suffix already closes
    (mid-line) or one that does not match the prefix's innermost open bracket (brackets still open
    on the cursor line or the lines before it: a call's arguments may span lines).  Each prefix line
    is lexed on its own: the window of lines may start inside a docstring, whose closing quotes
    would otherwise read as opening ones and hide every bracket after them."""
    stack: list[str] = []
    prefix_open: list[str] = []  # nearest last
    for line in (*ctx.prev_lines, ctx.line_before):
        for _, ch in _Lexer().marks(line):
            if ch in OPENERS:
                prefix_open.append(ch)
            elif ch in CLOSERS and prefix_open and prefix_open[-1] == CLOSERS[ch]:
                prefix_open.pop()
    for i, ch in _Lexer().marks(text):
        if ch in OPENERS:
            stack.append(ch)
        elif ch in CLOSERS:
            if stack:
                if stack[-1] != CLOSERS[ch]:
                    return text[:i].rstrip()
                stack.pop()
            else:
                if ctx.mid_line and ctx.line_after.lstrip().startswith(ch):
                    return text[:i]
                if not prefix_open or prefix_open[-1] != CLOSERS[ch]:
                    return text[:i].rstrip()
                prefix_open.pop()
    return text


class _PythonLines:
    """Where a Python line may be indented deeper than the one before it: after a line ending in
    ``:`` or ``\\``, inside open brackets, or inside a triple-quoted string."""

    def __init__(self) -> None:
        self.depth = 0
        self.lexer = _Lexer()
        self.opens_block = True  # the text before the suggestion is not seen: trust its first line

    def deeper_ok(self) -> bool:
        return self.opens_block or self.depth > 0 or self.lexer.triple is not None

    def feed(self, line: str) -> None:
        code_end = len(line)
        for i, ch in self.lexer.marks(line):
            if ch == "#":
                code_end = i  # the line's code ends at its comment ("#" inside a string is not one)
                break
            self.depth = self.depth + 1 if ch in OPENERS else max(0, self.depth - 1)
        self.lexer.quote = None  # a one-line string ends with its line
        self.opens_block = self.lexer.triple is None and line[:code_end].rstrip().endswith(
            (":", "\\")
        )


def _cut_block(text: str, ctx: Context, max_lines: int) -> str:
    """Keep the lines of a multi-line suggestion that belong to the block being written: stop at a
    dedent past the block, at two blank lines, at a line repeating the next line of the document,
    at `max_lines`, and in Python at a line indented deeper than the one before it could be
    (a syntax error: nothing after it can be accepted)."""
    lines = text.split("\n")
    first_indent = None
    cursor_indent = indentation(ctx.line_before)
    opener = ctx.line_before.rstrip().endswith(BLOCK_OPENERS)
    next_line = next((ln.strip() for ln in ctx.next_lines if ln.strip()), None)
    kept: list[str] = []
    blanks = 0
    py = _PythonLines() if ctx.python else None
    prev_indent: int | None = None
    for n, line in enumerate(lines):
        full = (ctx.line_before + line) if n == 0 else line
        if n > 0 and not line.strip():
            blanks += 1
            if blanks >= 2:
                break
            kept.append(line)
            continue
        blanks = 0
        if n > 0:
            ind = len(indentation(full))
            if first_indent is None:
                first_indent = ind
                if opener and ind <= len(cursor_indent):
                    break  # a block opener must be followed by an indented body
            elif ind < first_indent:
                break
            if (
                next_line is not None
                and line.strip() == next_line
                and line.strip() not in ("", ")", "]", "}")
            ):
                break
            if (
                py is not None
                and prev_indent is not None
                and ind > prev_indent
                and not py.deeper_ok()
            ):
                break  # an unexpected indent
        elif ctx.line_before.strip() == "" and line.strip():
            first_indent = len(indentation(full))
        if py is not None and full.strip():
            py.feed(full)
            prev_indent = len(indentation(full))
        kept.append(line)
        if len([k for k in kept if k.strip()]) >= max_lines:
            break
    while kept and not kept[-1].strip():
        kept.pop()
    return "\n".join(kept)


def indent_unit(lines: tuple[str, ...]) -> int:
    """The smallest step between the indentations of `lines` (4 when they show none)."""
    widths = sorted({len(indentation(ln).expandtabs(4)) for ln in lines if ln.strip()})
    steps = [b - a for a, b in itertools.pairwise(widths)] + [w for w in widths if w]
    return min(steps) if steps else 4


def _strip_stray_indent(text: str, ctx: Context) -> str:
    """At a cursor after indentation only (the editor indented the new line), whitespace that
    starts the suggestion and is not a whole indentation step is a stray space (`` def``, a
    token that carries its own space): dropped."""
    if not ctx.line_before or ctx.line_before.strip():
        return text
    first = text.split("\n", 1)[0]
    lead = indentation(first)
    if not lead or not first.strip():
        return text
    unit = indent_unit((*ctx.prev_lines, ctx.line_before, *ctx.next_lines))
    if len(lead.expandtabs(4)) % unit == 0:
        return text
    return text[len(lead) :]


def _repeats_previous_line(text: str, ctx: Context) -> bool:
    """The suggestion's first line, completed, is the line above the cursor again."""
    first = (ctx.line_before + text.split("\n", 1)[0] + ctx.line_after).strip()
    prev = next((p.strip() for p in reversed(ctx.prev_lines) if p.strip()), None)
    typed = ctx.line_before.strip() + ctx.line_after.strip()
    return (
        bool(prev)
        and first == prev
        and first != typed
        and bool(_WORD.search(first))
        and len(first) > 3
    )


def clean(raw: str, ctx: Context, multiline: bool, max_lines: int = 12) -> str:
    """The suggestion to show for raw model output `raw` inserted at the cursor described by `ctx`;
    "" when nothing useful is left."""
    text = raw.replace("\r\n", "\n").replace("\r", "\n")
    text = _strip_stray_indent(text, ctx)
    if nesting_loop(text.split("\n", 1)[0]):
        return ""  # a line that nests itself was never going to be code
    if _repeats_previous_line(text, ctx):
        return ""
    if not multiline:
        text = cut_loops(text.split("\n", 1)[0])
        text = _cut_unbalanced(text, ctx)
        merged = merge_mid_line(text, ctx.line_after)
        if merged is None:
            return ""
        text = merged.rstrip() if not ctx.mid_line else merged
    else:
        if ctx.line_before.strip() == "" and text.startswith("\n"):
            text = text.lstrip("\n")  # an empty line asked for a body, not a blank line first
        text = _cut_block(cut_loops(text), ctx, max_lines)
        text = _cut_unbalanced(text, ctx)
        text = "\n".join(ln.rstrip() for ln in text.split("\n")).rstrip()
    return text if text.strip() else ""


def block_done(text: str, ctx: Context, max_lines: int) -> bool:
    """True once streamed output already holds a finished block, so generation can stop early."""
    if ends_in_loop(text):
        return True
    if "\n" not in text:
        return False
    complete = text[: text.rfind("\n")]
    if not complete.strip():
        return False
    if _cut_block(complete + "\n", ctx, max_lines).rstrip() != complete.rstrip():
        return True
    return len([ln for ln in complete.split("\n") if ln.strip()]) >= max_lines
