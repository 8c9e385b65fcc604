"""Work per request bounded by the budget, not by the document: a prompt and the post-processing
context for a cursor inside a 1 MB line stay within the budget (the server used to tokenize the
whole line and overflow the model's context), and `spark-lsp bench robustness --quick` holds."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from spark_lsp.completions import LINE_CONTEXT, context_at
from spark_lsp.prompt import PromptBuilder


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    from engine.tokenizer import Tokenizer

    return Tokenizer.load(tiny_llama)


@pytest.mark.parametrize("where", ["end", "middle"])
def test_a_prompt_inside_a_1mb_line_fits_the_budget(tokenizer, where):
    text = "def f():\n    pass\n\nx = " + "1 + " * 250_000 + "1\n\nprint(x)\n"
    line_start = text.index("x = ")
    off = len(text) - len("\n\nprint(x)\n") if where == "end" else line_start + 500_000
    p = PromptBuilder(tokenizer).build(text, off, 256, key="doc")
    assert len(p.ids) <= 256 + 8
    assert text[p.prefix_start : off] == p.prefix  # the prefix is the text right before the cursor
    assert text[off : off + len(p.suffix)] == p.suffix
    ctx = context_at(text, off)
    assert len(ctx.line_before) <= LINE_CONTEXT and len(ctx.line_after) <= LINE_CONTEXT
    assert text[:off].endswith(ctx.line_before) and text[off:].startswith(ctx.line_after)


@pytest.mark.slow
def test_bench_robustness_quick_holds_every_scenario(tiny_llama):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "spark_lsp.bench.robustness",
            "--model",
            str(tiny_llama),
            "--quick",
            "--replay-minutes",
            "0.2",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    res = json.loads(out.stdout)
    assert res["tried"] == 10
    assert res["held"] == res["tried"], [r for r in res["scenarios"] if not r["held"]]
    assert out.returncode == 0
