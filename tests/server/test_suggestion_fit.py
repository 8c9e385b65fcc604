"""Inline suggestions that fit the line they are accepted into (issue 22's examples): mid-line a
suggestion merges with the whole rest of the line or is not shown; no stray space at an indented
cursor; a repeat of the line above and loops that nest brackets are not shown."""

from __future__ import annotations

from spark_lsp import postprocess
from spark_lsp.completions import context_at

CART = """class Cart:
    def __init__(self):
        self.items = {}

    def count(self, name):
        return self.items.get(name, 0)
"""


def _clean(text: str, off: int, raw: str) -> str:
    ctx = context_at(text, off, python=True)
    return postprocess.clean(raw, ctx, postprocess.choose_multiline(ctx))


def test_mid_line_suggestion_that_runs_into_the_rest_of_the_line_is_not_shown():
    text, off = CART, CART.index("self.items.get") + len("self.")
    # accepted, `items[name]` would give `self.items[name]items.get(name, 0)`
    assert _clean(text, off, "items[name]") == ""
    # a suggestion that re-types the rest of the line keeps only what is new
    assert _clean(text, off, "items.get(name, 0)") == ""
    assert _clean(text, off, "_cache or self.items.get(name, 0)") == "_cache or self."
    # an insertion that joins the rest of the line is shown
    assert _clean(text, off, "_cache or self.") == "_cache or self."


def test_mid_line_merges_at_punctuation_and_spaces():
    c = postprocess.Context("    total = compute(", "values)")
    assert postprocess.clean("scale(", c, multiline=False) == "scale("
    assert postprocess.clean("factor, ", c, multiline=False) == "factor, "
    assert postprocess.clean("factor", c, multiline=False) == ""  # `factorvalues)`
    assert postprocess.clean("factor, values)", c, multiline=False) == "factor, "
    c = postprocess.Context("    if ", "done:")
    assert postprocess.clean("not ", c, multiline=False) == "not "
    assert postprocess.merge_mid_line("x", "") == "x"


def test_no_stray_space_at_an_indented_cursor():
    text = "class Cart:\n    def __init__(self):\n        self.items = {}\n\n    \n"
    off = text.index("\n    \n") + 5
    assert (
        _clean(text, off, " def total(self):\n        return 0")
        == "def total(self):\n        return 0"
    )
    text = "def f(x):\n    \n"
    off = text.index("    \n") + 4
    assert _clean(text, off, " if x:\n        return 1") == "if x:\n        return 1"
    # a whole indentation step is the model's choice, kept
    ctx = postprocess.Context("    ", "", (), ("def f(x):", "    if x:"), python=True)
    assert postprocess.clean("    return 1", ctx, multiline=True) == "    return 1"
    assert postprocess.indent_unit(("def f():", "  x = 1", "  if x:", "    y")) == 2


def test_a_repeat_of_the_line_above_is_not_shown():
    text = "def f(items):\n    total = sum(items)\n    \n"
    off = text.index("\n    \n") + 5
    assert _clean(text, off, "total = sum(items)\n    return total") == ""
    assert _clean(text, off, "return total") == "return total"
    c = postprocess.Context("    total = ", "", (), ("    total = sum(items)",))
    assert postprocess.clean("sum(items)", c, multiline=False) == ""


def test_token_loops_that_nest_brackets_are_not_shown():
    c = postprocess.Context("    items.sort(", ")")
    raw = "key=lambda list[List[List[List[List[List[List[List["
    assert postprocess.nesting_loop(raw)
    assert postprocess.clean(raw, c, multiline=False) == ""
    assert postprocess.line_loops("x: List[List[List[")  # streaming stops there
    # nesting that the code closes, or two levels of it, is code
    assert not postprocess.nesting_loop("x: Dict[str, List[int]] = f(g(h(1)))")
    assert not postprocess.nesting_loop("List[List[int]]")
    assert postprocess.clean("key=len)", c, multiline=False) == "key=len"
