"""Checks that a code action's result does not damage the document, before it is applied.

A small model asked to rewrite, document, complete or test code can answer with something that is
worse than nothing: a method replaced by another one, a sentence repeated ten times, a statement
appended after a function's ``return``, text that no longer parses. Each check here compares the
document before and after the edit and returns why the result must not be applied (``None``: it
may be). Python is checked with ``ast``: the edited document (or, when the document did not parse
before, the edited top-level block) must parse as well as it did before, and the structure the
action promises must hold. Other languages get bracket balance and indentation consistency.
Every language gets the repetition checks.
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from dataclasses import dataclass

from .documents import indentation, split_lines

REWRITE, COMPLETE, DOCSTRING, TEST, INSTRUCT = (
    "rewrite",
    "complete",
    "docstring",
    "test",
    "instruct",
)

#: a def/class line: (indentation, keyword, name); actions.py finds the enclosing block with it
DEF_RE = re.compile(r"^([ \t]*)(?:async[ \t]+)?(def|class)[ \t]+([A-Za-z_]\w*)")
_WORD_RE = re.compile(r"[A-Za-z_]\w*")
_SENTENCE_SPLIT = re.compile(r"(?<=[.!?])\s+|\n")
_CLAUSE_SPLIT = re.compile(r"[.!?,;:]\s+|\n")
_CONJUNCTIONS = {"and", "or", "but", "so", "then"}
#: a clause of PHRASE_WORDS words or more said PHRASE_REPEATS times is a loop ("the text is a string,
#: the text is a string, and the text is a string")
PHRASE_WORDS, PHRASE_REPEATS = 4, 3
#: instruction words that ask for a new definition (so a new def/class name is expected)
_NEW_DEF_WORDS = {
    "function",
    "functions",
    "method",
    "methods",
    "class",
    "classes",
    "helper",
    "helpers",
    "def",
    "extract",
    "split",
    "decorator",
    "wrapper",
    "property",
    "test",
    "tests",
}
#: a top-level line that continues the statement above it rather than starting a new one
_CONTINUES = ("else", "elif", "except", "finally", "case", ")", "]", "}")
OPENERS = {"(": ")", "[": "]", "{": "}"}
CLOSERS = {v: k for k, v in OPENERS.items()}


@dataclass(frozen=True)
class Edit:
    """One action's proposed result: the document, the region it replaces and the new text."""

    action: str
    doc: str
    start: int
    end: int
    new_text: str
    python: bool
    instruction: str | None = None
    function: str | None = None  # the function a test is written for
    block: tuple[str, int] | None = None  # Complete: (name, indent) of the def/class it completes

    @property
    def after(self) -> str:
        return self.doc[: self.start] + self.new_text + self.doc[self.end :]

    @property
    def old_text(self) -> str:
        return self.doc[self.start : self.end]


def check(edit: Edit) -> str | None:
    """Why `edit` must not be applied, or None when it may be."""
    for rule in (_repetition, _syntax if edit.python else _brackets, _indentation, _structure):
        reason = rule(edit)
        if reason:
            return reason
    return None


# -- syntax ---------------------------------------------------------------------------------------
def parse(text: str) -> ast.Module | None:
    try:
        return ast.parse(text)
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None


def syntax_error(text: str) -> str | None:
    """The parser's complaint about `text` ("line 3: invalid syntax"), or None when it parses."""
    try:
        ast.parse(text)
    except SyntaxError as exc:
        return f"line {exc.lineno}: {exc.msg}" if exc.lineno else exc.msg
    except ValueError:  # (older Pythons) a NUL character
        return "a NUL character in the code"
    except (MemoryError, RecursionError):
        return "nested too deeply to parse"
    return None


def top_level_block(text: str, start: int, end: int) -> tuple[int, int]:
    """Offsets of the top-level statements that hold [start, end): from the column-0 statement
    (with its decorators) at or before `start` to the next column-0 statement after `end`."""
    lines = split_lines(text)
    starts = [0]
    for ln in lines:
        starts.append(starts[-1] + len(ln))

    def line_of(off: int) -> int:
        lo, hi = 0, len(lines) - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if starts[mid] <= off:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def opens(i: int) -> bool:
        ln = lines[i]
        return (
            bool(ln.strip())
            and not ln[0].isspace()
            and not ln.startswith("#")
            and not ln.lstrip().startswith(_CONTINUES)
        )

    if not lines:
        return 0, 0
    a = line_of(start)
    while a > 0 and not opens(a):
        a -= 1
    while a > 0 and lines[a - 1].startswith("@"):
        a -= 1
    b = line_of(max(start, end - 1)) + 1 if end > start else line_of(start) + 1
    while b < len(lines) and not (opens(b) and not lines[b].startswith("@")):
        b += 1
    return starts[a], starts[b]


def _syntax(edit: Edit) -> str | None:
    if parse(edit.doc) is not None:
        err = syntax_error(edit.after)
        return f"the result is not valid Python ({_shift(err, 0)})" if err else None
    # the document did not parse before: the edited top-level block must parse as well as it did
    a, b = top_level_block(edit.doc, edit.start, edit.end)
    before = edit.doc[a:b]
    if parse(before) is None:
        return None
    delta = len(edit.new_text) - (edit.end - edit.start)
    err = syntax_error(edit.after[a : b + delta])
    if err:
        return f"the result is not valid Python ({_shift(err, edit.doc.count(chr(10), 0, a))})"
    return None


def _shift(err: str, lines: int) -> str:
    m = re.match(r"line (\d+)(.*)", err, re.DOTALL)
    return f"line {int(m.group(1)) + lines}{m.group(2)}" if m and lines else err


# -- brackets and indentation (every language) ----------------------------------------------------
def bracket_marks(text: str):
    """Brackets outside strings and comments (``#``, ``//`` and ``/* */`` comments; quotes and
    backticks): a rough lexer shared by the languages the server sees."""
    i, n = 0, len(text)
    quote = None
    while i < n:
        ch = text[i]
        if quote:
            if ch == "\\":
                i += 2
                continue
            if text.startswith(quote, i):
                i += len(quote)
                quote = None
                continue
            if ch == "\n" and len(quote) == 1 and quote != "`":
                quote = None
        elif text.startswith(('"""', "'''"), i):
            quote = text[i : i + 3]
            i += 3
            continue
        elif ch in "'\"`":
            quote = ch
        elif ch == "#" or text.startswith("//", i):
            nl = text.find("\n", i)
            i = n if nl < 0 else nl
            continue
        elif text.startswith("/*", i):
            close = text.find("*/", i + 2)
            i = n if close < 0 else close + 2
            continue
        elif ch in OPENERS or ch in CLOSERS:
            yield ch
        i += 1


def balanced(text: str) -> bool:
    stack: list[str] = []
    for ch in bracket_marks(text):
        if ch in OPENERS:
            stack.append(ch)
        elif not stack or stack.pop() != CLOSERS[ch]:
            return False
    return not stack


def _brackets(edit: Edit) -> str | None:
    if balanced(edit.doc):
        return None if balanced(edit.after) else "the result leaves brackets unbalanced"
    if balanced(edit.old_text) and not balanced(edit.new_text):
        return "the result leaves brackets unbalanced"
    return None


def _indent_chars(text: str) -> set[str]:
    return {ch for ln in split_lines(text) if ln.strip() for ch in indentation(ln)}


def _indentation(edit: Edit) -> str | None:
    """The new text indents with the document's character (tabs or spaces), when it uses one."""
    used = _indent_chars(edit.doc[: edit.start] + edit.doc[edit.end :])
    if len(used) != 1:
        return None
    extra = _indent_chars(edit.new_text) - used
    if extra:
        kind = "tabs" if "\t" in extra else "spaces"
        return f"the result indents with {kind}, the document does not"
    return None


# -- repetition -----------------------------------------------------------------------------------
def _lines(text: str) -> list[str]:
    return [ln.strip() for ln in text.split("\n") if ln.strip()]


def repeated_runs(lines: list[str], max_unit: int = 4) -> set[tuple[str, ...]]:
    """Runs of 1..max_unit lines (holding a word) immediately followed by themselves."""
    found = set()
    for p in range(1, max_unit + 1):
        for i in range(len(lines) - 2 * p + 1):
            unit = tuple(lines[i : i + p])
            if unit == tuple(lines[i + p : i + 2 * p]) and any(_WORD_RE.search(u) for u in unit):
                found.add(unit)
    return found


def prose(text: str) -> str:
    """The comments and docstring-like text of `text` (lines in triple quotes), one line each."""
    out = []
    quote = None
    for ln in text.split("\n"):
        s = ln.strip()
        if quote is not None:
            body = s.split(quote, 1)[0]
            out.append(body)
            if quote in s:
                quote = None
            continue
        if s.startswith("#"):
            out.append(s.lstrip("#").strip())
            continue
        for q in ('"""', "'''"):
            if q in s:
                rest = s.split(q, 1)[1]
                if q in rest:
                    out.append(rest.split(q, 1)[0])
                else:
                    out.append(rest)
                    quote = q
                break
    return "\n".join(out)


def sentences(text: str) -> Counter:
    """Sentences of three words or more, normalised (case, spacing, end mark)."""
    out: Counter = Counter()
    for s in _SENTENCE_SPLIT.split(text):
        words = _WORD_RE.findall(s.lower())
        if len(words) >= 3:
            out[" ".join(words)] += 1
    return out


def phrases(text: str) -> Counter:
    """Clauses (between punctuation) of PHRASE_WORDS words or more, a leading conjunction dropped."""
    out: Counter = Counter()
    for c in _CLAUSE_SPLIT.split(text):
        words = _WORD_RE.findall(c.lower())
        if words and words[0] in _CONJUNCTIONS:
            words = words[1:]
        if len(words) >= PHRASE_WORDS:
            out[" ".join(words)] += 1
    return out


def _repetition(edit: Edit) -> str | None:
    old_runs = repeated_runs(_lines(edit.old_text))
    new_runs = repeated_runs(_lines(edit.new_text)) - old_runs
    if new_runs:
        unit = min(new_runs, key=len)
        return f"the result repeats itself ({unit[0][:60]!r} {'twice in a row' if len(unit) == 1 else '…'})"
    old = sentences(prose(edit.old_text))
    new = sentences(prose(edit.new_text))
    for s, n in new.items():
        if n > 1 and n > old.get(s, 0):
            return f"the result repeats the sentence {s[:60]!r} {n} times"
    old = phrases(prose(edit.old_text))
    for s, n in phrases(prose(edit.new_text)).items():
        if n >= PHRASE_REPEATS and n > old.get(s, 0):
            return f"the result repeats the phrase {s[:60]!r} {n} times"
    return None


# -- what each action promises --------------------------------------------------------------------
def definitions(text: str) -> Counter:
    """Names of the def/class statements in `text` (counted)."""
    return Counter(m.group(3) for ln in text.split("\n") if (m := DEF_RE.match(ln)))


def documented(text: str) -> set[str]:
    """Names of the def/class statements in `text` whose body starts with a docstring."""
    lines = text.split("\n")
    out = set()
    for i, ln in enumerate(lines):
        m = DEF_RE.match(ln)
        if not m:
            continue
        h = i
        while h < len(lines) - 1 and not lines[h].split("#")[0].rstrip().endswith(":"):
            h += 1
        body = next((x.strip() for x in lines[h + 1 :] if x.strip()), "")
        if body.lstrip("rRbBuU").startswith(('"""', "'''", '"', "'")):
            out.add(m.group(3))
    return out


def _structure(edit: Edit) -> str | None:
    rule = {
        REWRITE: _rewrite,
        INSTRUCT: _rewrite,
        DOCSTRING: _docstring,
        COMPLETE: _complete,
        TEST: _test,
    }.get(edit.action)
    return rule(edit) if rule is not None else None


def _rewrite(edit: Edit) -> str | None:
    """A rewrite keeps the selection's definitions, their names and their docstrings; an
    instruction may rename or add what it names (or add a definition when it asks for one)."""
    old, new = definitions(edit.old_text), definitions(edit.new_text)
    words = set(_WORD_RE.findall(edit.instruction or ""))
    lower = {w.lower() for w in words}
    lost = [n for n in old if new[n] < old[n] and n not in words]
    if lost:
        gone = ", ".join(repr(n) for n in lost)
        added = [n for n in new if new[n] > old[n]]
        instead = f" (it defines {', '.join(repr(n) for n in added)} instead)" if added else ""
        return f"the result drops the definition of {gone}{instead}"
    added = [n for n in new if new[n] > old[n] and n not in words]
    if added and not (lower & _NEW_DEF_WORDS):
        return f"the result adds a definition the selection did not have ({', '.join(map(repr, added))})"
    undocumented = [
        n for n in documented(edit.old_text) if n in new and n not in documented(edit.new_text)
    ]
    if undocumented and "docstring" not in lower and "docstrings" not in lower:
        return f"the result drops the docstring of {', '.join(map(repr, undocumented))}"
    return None


def _strip_docstrings(tree: ast.AST) -> str:
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (
            isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(getattr(body[0], "value", None), ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree)


def _docstring(edit: Edit) -> str | None:
    """Add docstring adds a docstring and nothing else; its lines keep the docstring's indent."""
    new = edit.new_text
    first = next((ln for ln in new.split("\n") if ln.strip()), "")
    ind = indentation(first)
    for ln in new.split("\n")[1:]:
        if ln.strip() and len(indentation(ln)) < len(ind):
            return f"a docstring line is indented less than the docstring ({ln.strip()[:40]!r})"
    if not edit.python:
        return None
    before, after = parse(edit.doc), parse(edit.after)
    if before is None:
        a, b = top_level_block(edit.doc, edit.start, edit.end)
        delta = len(new) - (edit.end - edit.start)
        before, after = parse(edit.doc[a:b]), parse(edit.after[a : b + delta])
    if before is None or after is None:
        return None
    if _strip_docstrings(before) != _strip_docstrings(after):
        return "the result changes code, not only the docstring"
    return None


def _dead_code(tree: ast.AST) -> int:
    """Statements that follow a return/raise/continue/break in the same block."""
    n = 0
    for node in ast.walk(tree):
        for name in ("body", "orelse", "finalbody"):
            stmts = getattr(node, name, None)
            if not isinstance(stmts, list):
                continue
            for i, st in enumerate(stmts[:-1]):
                if isinstance(st, (ast.Return, ast.Raise, ast.Continue, ast.Break)):
                    n += len(stmts) - i - 1
                    break
    return n


def _complete(edit: Edit) -> str | None:
    """Complete appends inside the block around the cursor: no line of the new text leaves the
    block, and nothing is added after the block's return."""
    if edit.block is not None:
        name, indent = edit.block
        line_start = edit.doc.rfind("\n", 0, edit.start) + 1
        new_lines = (edit.doc[line_start : edit.start] + edit.new_text).split("\n")
        for ln in new_lines if not edit.doc[line_start : edit.start].strip() else new_lines[1:]:
            if ln.strip() and len(indentation(ln)) <= indent:
                return f"the result goes on past the end of {name!r} ({ln.strip()[:40]!r})"
    if edit.python:
        before, after = parse(edit.doc), parse(edit.after)
        if before is not None and after is not None and _dead_code(after) > _dead_code(before):
            return "the result adds code after a return (the block was already complete)"
    return None


def _test(edit: Edit) -> str | None:
    """Generate a test adds a test function that exercises the function it is for."""
    if not edit.python:
        return None
    after = parse(edit.after)
    if after is None:
        return None  # _syntax has judged the document as a whole
    before = {
        n.name
        for n in ast.walk(parse(edit.doc) or ast.Module(body=[], type_ignores=[]))
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
    }
    tests = [
        n
        for n in after.body
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
        and n.name.startswith("test")
        and n.name not in before
    ]
    if not tests:
        return "the result adds no test function"
    body = tests[-1].body
    if all(
        isinstance(st, ast.Pass)
        or (isinstance(st, ast.Expr) and isinstance(st.value, ast.Constant))
        for st in body
    ):
        return f"the test {tests[-1].name!r} does nothing"
    if edit.function:
        names = {n.id for n in ast.walk(tests[-1]) if isinstance(n, ast.Name)} | {
            n.attr for n in ast.walk(tests[-1]) if isinstance(n, ast.Attribute)
        }
        if edit.function not in names:
            return f"the test {tests[-1].name!r} never uses {edit.function!r}"
    return None


def block_is_complete(text: str, header_line: int, end_line: int) -> bool:
    """Whether the def at `header_line` (body up to `end_line`, exclusive) parses and ends with a
    return or raise: there is nothing left to complete."""
    lines = split_lines(text)[header_line:end_line]
    if not lines:
        return False
    ind = len(indentation(lines[0]))
    src = "".join(ln[ind:] if len(indentation(ln)) >= ind else ln.lstrip() for ln in lines)
    tree = parse(src)
    if (
        tree is None
        or not tree.body
        or not isinstance(tree.body[0], (ast.FunctionDef, ast.AsyncFunctionDef))
    ):
        return False
    return isinstance(tree.body[0].body[-1], (ast.Return, ast.Raise))
