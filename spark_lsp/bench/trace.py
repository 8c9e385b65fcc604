"""The typing trace the benchmarks and the demo replay: one function's body of a real Python file,
removed and typed back as an editor's changes (a character each, a newline with the next line's
auto-indent). Standard library only, so the demo's client imports nothing heavy for it."""

from __future__ import annotations

import ast
import sysconfig
from pathlib import Path

DEFAULT_FILE = "functools.py"  # ~1,000 lines of real stdlib Python


def source_file(file: str | None) -> Path:
    """The file whose function is typed: ``--file``, else the standard library's DEFAULT_FILE."""
    return Path(file) if file else Path(sysconfig.get_paths()["stdlib"]) / DEFAULT_FILE


def pick_function(source: str, name: str | None) -> tuple[int, int, str]:
    """(body start offset, body end offset, function name): the body is what gets typed."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError) as exc:  # ValueError: NUL bytes
        where = f" (line {exc.lineno})" if getattr(exc, "lineno", None) else ""
        raise SystemExit(
            f"spark-lsp bench: the file is not Python{where}: the replay types a Python "
            "function's body (--file)"
        ) from None
    lines = source.splitlines(keepends=True)
    starts = [0]
    for ln in lines:
        starts.append(starts[-1] + len(ln))
    funcs = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    if name:
        funcs = [f for f in funcs if f.name == name]
        if not funcs:
            raise SystemExit(f"spark-lsp bench: --function {name}: no such function in the file")
    else:
        funcs = [
            f for f in funcs if 8 <= (f.end_lineno - f.lineno) <= 40 and f.col_offset == 0
        ] or [f for f in funcs if 4 <= (f.end_lineno - f.lineno) <= 60]
        if not funcs:
            raise SystemExit(
                "spark-lsp bench: no function of a suitable size in the file; use --function"
            )
        funcs.sort(key=lambda f: f.lineno)
        funcs = [funcs[len(funcs) // 2]]
    f = funcs[0]
    first = f.body[0]
    if (
        isinstance(first, ast.Expr)
        and isinstance(getattr(first, "value", None), ast.Constant)
        and isinstance(first.value.value, str)
        and len(f.body) > 1
    ):
        first = f.body[1]  # keep the docstring: it is context the user already wrote
    body_start = (
        starts[first.lineno - 1]
        + len(lines[first.lineno - 1])
        - len(lines[first.lineno - 1].lstrip())
    )
    body_end = starts[f.end_lineno]
    return body_start, body_end, f.name


def keystrokes(body: str) -> list[str]:
    """The body as editor changes: one per character, but a newline carries the next line's
    indentation (auto-indent)."""
    out: list[str] = []
    i = 0
    while i < len(body):
        ch = body[i]
        if ch == "\n":
            j = i + 1
            while j < len(body) and body[j] in " \t":
                j += 1
            out.append(body[i:j])
            i = j
        else:
            out.append(ch)
            i += 1
    return out
