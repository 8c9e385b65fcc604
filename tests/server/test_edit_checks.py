"""Code actions never damage code: each action's result is checked before it is applied, retried
once with a sampled decoding when it fails, and refused with a reason otherwise. The examples are
the results a small model gave a new user (issue 22), scripted here so they are exact."""

from __future__ import annotations

import pytest

from spark_lsp import actions, completions, edit_checks

CART = '''class Cart:
    def __init__(self):
        self.items = {}

    def add(self, name, quantity):
        """Add `quantity` of `name` to the cart."""
        self.items[name] = self.items.get(name, 0) + quantity

    def total(self, prices):
        """The price of everything in the cart."""
        total = 0
        for name, n in self.items.items():
            total += prices[name] * n
        return total
'''


def _sel(src: str, first: str, last: str) -> tuple[int, int]:
    """Offsets of the whole lines from the one starting `first` to the one holding `last`."""
    start = src.index(first)
    start = src.rfind("\n", 0, start) + 1
    end = src.index("\n", src.index(last)) + 1
    return start, end


def _judge(action, src, start, end, raw, line=None, **kw):
    line = src.count("\n", 0, start) if line is None else line
    p = actions.plan(action, src, start, end, line, 256, **kw)
    return p.judge(raw)


# -- the examples -------------------------------------------------------------------------
def test_rewrite_that_replaces_a_method_with_another_is_refused():
    s, e = _sel(CART, "    def total", "return total")
    region, reason = _judge(
        actions.REWRITE,
        CART,
        s,
        e,
        "    def __init__(self, *args, **kwargs):\n        self.args = args\n",
    )
    assert reason and "drops the definition of 'total'" in reason and "'__init__'" in reason
    # the same method rewritten, name and docstring kept: applied
    good = (
        '    def total(self, prices):\n        """The price of everything in the cart."""\n'
        "        return sum(prices[name] * n for name, n in self.items.items())\n"
    )
    region, reason = _judge(actions.REWRITE, CART, s, e, good)
    assert reason is None and region == good


def test_rewrite_that_drops_the_docstring_is_refused():
    s, e = _sel(CART, "    def total", "return total")
    _, reason = _judge(
        actions.REWRITE,
        CART,
        s,
        e,
        "    def total(self, prices):\n        return sum(prices[k] * n for k, n in self.items.items())\n",
    )
    assert reason and "docstring of 'total'" in reason


def test_rewrite_that_writes_repeated_comment_lines_is_refused():
    s, e = _sel(CART, "        total = 0", "return total")
    raw = "        # add up the price of each item\n" * 4 + "        # add up the"
    _, reason = _judge(actions.REWRITE, CART, s, e, raw)
    assert reason and "went into a loop (repeating '# add up the price of each item')" in reason
    raw = "".join(
        "        # add up the price of each item\n        # times its count\n" for _ in range(2)
    )
    _, reason = _judge(actions.REWRITE, CART, s, e, raw + "        return total\n")
    assert reason and "repeats" in reason


def test_docstring_with_a_repeated_sentence_or_a_badly_indented_line_is_refused():
    src = CART.replace('        """The price of everything in the cart."""\n', "")
    line = src.splitlines().index("    def total(self, prices):") + 1
    at = src.index("        total = 0")
    sentence = "Return the total price of all the items in the cart, using the given prices. "
    region, reason = _judge(actions.DOCSTRING, src, at, at, sentence * 10 + '"""', line=line)
    assert (
        reason
        and "repeats the sentence 'return the total price of" in reason
        and "10 times" in reason
    )
    # a clause said again and again (what the bundled model wrote for `count_words`)
    looped = "The text is a string, the text is a string, the text is a string,\n        and the text is a string"
    _, reason = _judge(actions.DOCSTRING, src, at, at, looped + '"""', line=line)
    assert reason and "repeats the phrase 'the text is a string' 4 times" in reason
    # a short phrase looping is cut to one copy (postprocess.cut_loops): that docstring may stay
    region, reason = _judge(
        actions.DOCSTRING, src, at, at, "The price of the items. " * 10 + '"""', line=line
    )
    assert reason is None and region == '        """The price of the items."""\n'
    _, reason = _judge(
        actions.DOCSTRING,
        src,
        at,
        at,
        'The total price.\n\n        Args:\n    prices: a price per name.\n        """',
        line=line,
    )
    assert reason and "indented less than the docstring" in reason
    region, reason = _judge(
        actions.DOCSTRING,
        src,
        at,
        at,
        'The total price.\n\n        prices: a price per item name.\n        """',
        line=line,
    )
    assert reason is None and region.startswith('        """The total price.')


def test_complete_on_a_finished_function_does_nothing():
    line = CART.splitlines().index("        return total")
    at = CART.index("        return total") + len("        return total")
    with pytest.raises(actions.ActionError, match="already complete"):
        actions.plan(actions.COMPLETE, CART, at, at, line, 256)
    # and when a block looks unfinished, code appended after its return is refused
    src = "def first(tests):\n    for t in tests:\n        return t\n"
    at = src.index("return t") + len("return t")
    _, reason = _judge(actions.COMPLETE, src, at, at, "\n        return list(tes)", line=2)
    assert reason and "after a return" in reason


def test_complete_that_leaves_the_block_is_refused():
    src = "def mean(values):\n    total = sum(values)\n    "
    at = len(src)
    # the block cut (postprocess) keeps the function's lines only ...
    region, reason = _judge(
        actions.COMPLETE, src, at, at, "return total / len(values)\n\nprint(mean([1, 2]))", line=2
    )
    assert reason is None and region == "return total / len(values)"
    # ... and a result that still leaves the block is refused
    edit = edit_checks.Edit(
        "complete", src, at, at, "return total\nprint(mean([1]))", True, block=("mean", 0)
    )
    assert "past the end of 'mean'" in edit_checks.check(edit)
    region, reason = _judge(actions.COMPLETE, src, at, at, "return total / len(values)\n", line=2)
    assert reason is None and region == "return total / len(values)"


def test_instruction_that_renames_the_wrong_thing_is_refused():
    s, e = _sel(CART, "    def add", "+ quantity")
    raw = "    def __init__(self, path):\n        self.path = path\n"
    _, reason = _judge(actions.INSTRUCT, CART, s, e, raw, instruction="rename quantity to count")
    assert reason and "drops the definition of 'add'" in reason
    renamed = (
        '    def add(self, name, count):\n        """Add `count` of `name` to the cart."""\n'
        "        self.items[name] = self.items.get(name, 0) + count\n"
    )
    _, reason = _judge(
        actions.INSTRUCT, CART, s, e, renamed, instruction="rename quantity to count"
    )
    assert reason is None
    # an instruction that names the definition may rename it
    _, reason = _judge(
        actions.INSTRUCT,
        CART,
        s,
        e,
        renamed.replace("def add", "def put"),
        instruction="rename add to put",
    )
    assert reason is None


def test_result_that_does_not_parse_is_refused():
    s, e = _sel(CART, "        total = 0", "return total")
    _, reason = _judge(actions.REWRITE, CART, s, e, "        total = sum(\n        return total\n")
    assert reason and "not valid Python" in reason


def test_a_document_that_did_not_parse_is_judged_by_its_edited_block():
    broken = "def first(:\n    pass\n\n\n" + CART
    s, e = _sel(broken, "        total = 0", "return total")
    _, reason = _judge(
        actions.REWRITE, broken, s, e, "        total = (\n        return total\n", python=True
    )
    assert reason and "not valid Python (line 15:" in reason  # the line in the document
    _, reason = _judge(
        actions.REWRITE, broken, s, e, "        return sum(self.items.values())\n", python=True
    )
    assert reason is None


def test_generated_test_must_be_a_test_of_the_function():
    src = "def add(a, b):\n    return a + b\n"
    assert _judge(actions.TEST, src, 0, 0, "assert add(1, 2) == 3\n", line=0)[1] is None
    _, reason = _judge(actions.TEST, src, 0, 0, "pass\n", line=0)
    assert reason and "does nothing" in reason
    _, reason = _judge(actions.TEST, src, 0, 0, "assert 1 + 2 == 3\n", line=0)
    assert reason and "never uses 'add'" in reason
    _, reason = _judge(actions.TEST, src, 0, 0, "assert add(1, 2 == 3\n", line=0)
    assert reason and "not valid Python" in reason


def test_other_languages_keep_brackets_balanced_and_indentation_consistent():
    js = "function f(a) {\n  if (a) {\n    return 1;\n  }\n  return 2;\n}\n"
    s, e = _sel(js, "  if (a)", "  }")
    _, reason = _judge(actions.REWRITE, js, s, e, "  if (a) {\n    return [1;\n  }\n", python=False)
    assert reason and "unbalanced" in reason
    _, reason = _judge(actions.REWRITE, js, s, e, "  if (a) {\n\treturn 1;\n  }\n", python=False)
    assert reason and "indents with tabs" in reason
    _, reason = _judge(
        actions.REWRITE, js, s, e, "  if (a) { // (\n    return '}';\n  }\n", python=False
    )
    assert reason is None
    assert not actions.looks_like_python(js) and actions.looks_like_python(CART)


# -- retry and refusal ----------------------------------------------------------------------------
class _Builder:
    stop_strings = ()

    def build_parts_healed(self, prefix, suffix, budget):
        return [1, 2, 3], ""

    def fit_parts(self, prefix, suffix, budget):
        return prefix, suffix


def _scripted(monkeypatch, *outputs):
    calls = []

    def fake_generate(
        engine,
        job,
        ids,
        params,
        done=None,
        on_text=None,
        speculative=False,
        draft=None,
        text_prompt=None,
    ):
        calls.append(params)
        text = outputs[min(len(calls), len(outputs)) - 1]
        if on_text is not None:
            on_text(text)
        return text, {"new_tokens": 3}, "stop"
        yield  # a step generator

    monkeypatch.setattr(completions, "generate_steps", fake_generate)
    monkeypatch.setattr(completions, "control_ids", lambda b: frozenset())
    return calls


def test_failing_result_is_retried_once_sampled_then_refused(monkeypatch):
    from engine import GenerationParams

    s, e = _sel(CART, "    def total", "return total")
    p = actions.plan(actions.REWRITE, CART, s, e, 8, 256)
    bad = "    def __init__(self, *args, **kwargs):\n        self.args = args\n"
    good = '    def total(self, prices):\n        """The price."""\n        return 0\n'
    calls = _scripted(monkeypatch, bad, good)
    region, _ = actions.run_plan(None, _Builder(), None, p, GenerationParams, 256)
    assert region == good
    assert [c.temperature for c in calls] == [0.0, actions.RETRY_TEMPERATURE] and calls[
        1
    ].seed == actions.RETRY_SEED
    calls = _scripted(monkeypatch, bad, bad)
    with pytest.raises(
        actions.ActionError, match="was not applied: the result drops the definition of 'total'"
    ):
        actions.run_plan(None, _Builder(), None, p, GenerationParams, 256)
    assert len(calls) == 2
    calls = _scripted(monkeypatch, good)  # a good first result: no second generation
    actions.run_plan(None, _Builder(), None, p, GenerationParams, 256)
    assert len(calls) == 1


def test_checks_pass_what_a_careful_edit_produces():
    edit = edit_checks.Edit(
        "rewrite",
        CART,
        *_sel(CART, "        total = 0", "return total"),
        "        return sum(prices[k] * n for k, n in self.items.items())\n",
        True,
    )
    assert edit_checks.check(edit) is None
    assert edit_checks.repeated_runs(["a = 1", "b = 2", "a = 1"]) == set()
    assert edit_checks.repeated_runs(["x", "y", "x", "y"]) == {("x", "y")}
