"""Positions read the way the LSP specification says, with the ranges real editors send, and
incremental edits that keep the server's copy of a document identical to a reference model."""

from __future__ import annotations

import re
from unittest import mock

import pytest
from hypothesis import given
from hypothesis import strategies as st

from spark_lsp import documents
from spark_lsp.documents import (
    Pos,
    PositionError,
    apply_change,
    in_document,
    offset_at,
    position_at,
)

MAXCOL = 2147483647  # Neovim's v:maxcol, sent as the end of a visual-line selection

METHOD = "class A:\n    def f(self):\n        return 1\n\n    def g(self):\n        pass\n"


def test_character_past_the_line_end_means_the_line_end():
    empty_line = METHOD.split("\n").index("")
    # Neovim's visual selection ending on an empty line: {line: N, character: 1}
    assert offset_at(METHOD, empty_line, 1) == offset_at(METHOD, empty_line, 0)
    # visual-line mode: the end is the last selected line at v:maxcol
    assert offset_at(METHOD, 2, MAXCOL) == METHOD.index("return 1") + len("return 1")
    assert not in_document(METHOD, 2, MAXCOL) and in_document(METHOD, 2, 16)


def test_a_line_past_the_last_line_means_the_end_of_the_document():
    last = METHOD.count("\n")
    assert offset_at(METHOD, last, 0) == len(METHOD)
    assert offset_at(METHOD, last + 1, 0) == len(
        METHOD
    )  # VS Code: a range ending after the last line
    assert offset_at(METHOD, 10**9, MAXCOL) == len(METHOD)
    crlf = METHOD.replace("\n", "\r\n")
    assert (
        offset_at(crlf, 99, 3) == len(crlf) and offset_at(crlf, 2, MAXCOL) == crlf.index("1\r") + 1
    )


@pytest.mark.parametrize(
    "line, character",
    [(-1, 0), (0, -1), (0.5, 0), (0, 2.0), (None, 0), ("3", 0), (0, True), ([1], 0)],
)
def test_negative_or_non_integer_positions_are_invalid(line, character):
    with pytest.raises(PositionError):
        offset_at(METHOD, line, character)
    with pytest.raises(PositionError):
        apply_change(METHOD, Pos(0, 0), Pos(line, character), "x")


def test_lenient_changes_are_reported():
    assert apply_change("ab\ncd", Pos(0, 1), Pos(0, 2), "X") == ("aX\ncd", False)
    assert apply_change("ab\ncd", Pos(0, 9), Pos(0, 9), "X") == ("abX\ncd", True)
    assert apply_change("ab\ncd", Pos(7, 0), Pos(9, 9), "!") == ("ab\ncd!", True)
    assert apply_change("ab\ncd", Pos(1, 1), Pos(0, 1), "") == (
        "ad",
        True,
    )  # end before start: swapped


# -- a reference model of a document, written independently of spark_lsp.documents ---------------
_UNIT = {"utf-8": ("utf-8", 1), "utf-16": ("utf-16-le", 2), "utf-32": ("utf-32-le", 4)}


def _ref_lines(text: str) -> list[tuple[int, str]]:
    """(start offset, content without the line break) of every line, breaking at \\r\\n, \\r, \\n."""
    out, start = [], 0
    for m in re.finditer(r"\r\n|\r|\n", text):
        out.append((start, text[start : m.start()]))
        start = m.end()
    out.append((start, text[start:]))
    return out


def _ref_offset(text: str, line: int, character: int, enc: str) -> int:
    lines = _ref_lines(text)
    if line >= len(lines):
        return len(text)
    start, content = lines[line]
    codec, width = _UNIT[enc]
    for k in range(len(content) + 1):
        if len(content[:k].encode(codec)) // width >= character:
            return start + k
    return start + len(content)


def _ref_position(text: str, offset: int, enc: str) -> Pos:
    codec, width = _UNIT[enc]
    lines = _ref_lines(text)
    for i in range(len(lines) - 1, -1, -1):
        if lines[i][0] <= offset:
            return Pos(i, len(text[lines[i][0] : offset].encode(codec)) // width)
    raise AssertionError


# Characters editors put in documents that make position arithmetic hard: line breaks of every
# kind, astral characters (two UTF-16 units, four UTF-8 bytes), combining marks, NUL, and
# characters str.splitlines breaks at but LSP does not.
ALPHABET = st.sampled_from(
    [
        "a",
        "b",
        " ",
        "\t",
        "\n",
        "\r\n",
        "\r",
        "é",
        "€",
        "😀",
        "𝔸",
        "e\u0301",
        "\u0000",
        "\u2028",
        "\x0c",
        "\u0085",
        "中",
    ]
)
TEXT = st.lists(ALPHABET, max_size=40).map("".join)
ENC = st.sampled_from(["utf-16", "utf-8", "utf-32"])


@st.composite
def _edit(draw, text: str, enc: str):
    """A range as editors send it: usually inside the document, sometimes past a line's end or
    the document's end (clamped), and a replacement text (possibly a long line)."""
    lines = _ref_lines(text)

    def pos():
        line = draw(st.integers(0, len(lines) + 1))
        codec, width = _UNIT[enc]
        n = len(lines[line][1].encode(codec)) // width if line < len(lines) else 0
        return Pos(
            line,
            draw(st.one_of(st.integers(0, n), st.integers(0, n + 3), st.just(MAXCOL))),
        )

    a, b = pos(), pos()
    new = draw(st.one_of(TEXT, st.integers(1, 3).map(lambda n: "x" * (5000 * n))))
    return a, b, new


def _edits_match_the_reference(data, text: str, enc: str) -> None:
    for _ in range(data.draw(st.integers(1, 8))):
        a, b, new = data.draw(_edit(text, enc))
        s, e = (
            _ref_offset(text, a.line, a.character, enc),
            _ref_offset(text, b.line, b.character, enc),
        )
        s, e = min(s, e), max(s, e)
        expected = text[:s] + new + text[e:]
        got, _ = apply_change(text, a, b, new, enc)
        assert got == expected
        text = got
        # positions read back through the (possibly incrementally updated) line index agree too
        offset = data.draw(st.integers(0, len(text)))
        if 0 < offset < len(text) and text[offset - 1] == "\r" and text[offset] == "\n":
            offset -= 1
        assert position_at(text, offset, enc) == _ref_position(text, offset, enc)


@given(st.data(), TEXT, ENC)
def test_random_incremental_edits_match_a_reference_document(data, text, enc):
    _edits_match_the_reference(data, text, enc)


@given(st.data(), TEXT, ENC)
def test_the_line_index_of_large_documents_matches_the_reference(data, text, enc):
    """The same edits with every document indexed as a large one is (spark_lsp.documents.LineIndex,
    updated edit by edit)."""
    with mock.patch.object(documents, "INDEXED_CHARS", 1):
        _edits_match_the_reference(data, text, enc)


@given(TEXT, ENC, st.data())
def test_offsets_and_positions_agree_with_the_reference(text, enc, data):
    offset = data.draw(st.integers(0, len(text)))
    if 0 < offset < len(text) and text[offset - 1] == "\r" and text[offset] == "\n":
        offset -= 1  # no position lies between the two characters of a "\r\n"
    p = position_at(text, offset, enc)
    assert p == _ref_position(text, offset, enc)
    assert offset_at(text, p.line, p.character, enc=enc) == offset
    line, ch = data.draw(st.integers(0, 50)), data.draw(st.integers(0, 80))
    assert offset_at(text, line, ch, enc=enc) == _ref_offset(text, line, ch, enc)


# -- the ranges real editors send, through the server ---------------------------------------------
def _rng(sl, sc, el, ec):
    from lsprotocol import types as T

    return T.Range(T.Position(sl, sc), T.Position(el, ec))


async def test_code_actions_for_the_ranges_neovim_and_vscode_send(editor, sample):
    from lsprotocol import types as T

    uri = "file:///t/ranges.py"
    editor.open(uri, sample)
    lines = sample.split("\n")
    scale = lines.index("def scale(values, factor):")
    blank = lines.index("", scale)  # the empty line after the function
    ranges = {
        "visual selection ending on an empty line": _rng(scale, 0, blank, 1),
        "visual-line mode (v:maxcol)": _rng(scale, 0, blank - 1, MAXCOL),
        "a range ending after the last line": _rng(scale, 0, len(lines) + 3, 0),
    }
    for name, rng in ranges.items():
        res = await editor.client.text_document_code_action_async(
            T.CodeActionParams(
                text_document=T.TextDocumentIdentifier(uri),
                range=rng,
                context=T.CodeActionContext(diagnostics=[]),
            )
        )
        assert res, f"{name}: no code actions"
        titles = {a.title for a in res}
        assert any("ewrite" in t or "docstring" in t.lower() for t in titles), (
            name,
            titles,
        )
