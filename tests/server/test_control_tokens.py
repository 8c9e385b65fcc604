"""Control tokens (FIM markers, file separator, pad, eos) never reach the document as text: the
engine stops on them. The tiny random model is forced to sample them with a scripted sampler."""

from __future__ import annotations

import asyncio

import pytest

import engine.generate as generate_mod
from engine import Engine, GenerationParams
from spark_lsp import actions, completions
from spark_lsp.model_host import LocalModel
from spark_lsp.prompt import PromptBuilder
from spark_lsp.scheduler import Job
from spark_lsp.settings import Settings


@pytest.fixture(scope="module")
def eng(tiny_llama):
    return Engine.load(tiny_llama, slots=2)


def _script(monkeypatch, ids):
    """Make every Generation sample `ids` in order (then keep repeating the last one)."""

    class Scripted:
        greedy = False  # a speculative generation falls back to plain decoding

        def __init__(self, *a, **k):
            self.i = 0

        def __call__(self, logits):
            tok = ids[min(self.i, len(ids) - 1)]
            self.i += 1
            return tok

    monkeypatch.setattr(generate_mod, "Sampler", Scripted)


@pytest.mark.parametrize(
    "name", ["<fim_suffix>", "<fim_prefix>", "<fim_middle>", "<file_sep>", "<pad>"]
)
def test_generation_stops_at_control_tokens(eng, monkeypatch, name):
    tok = eng.tokenizer
    text_ids = tok.encode('    """Add two numbers.')
    special = tok.special_tokens[name]
    _script(monkeypatch, text_ids + [special] + text_ids)
    ids = completions.control_ids(PromptBuilder(tok))
    assert special in ids
    gen = eng.generate("def add(a, b):\n", GenerationParams(max_new_tokens=40, stop_ids=ids))
    streamed = "".join(c.text for c in gen)
    assert streamed == gen.text == tok.decode(text_ids)
    assert not any(s in streamed for s in tok.special_tokens)
    assert special not in gen.tokens and gen.finish_reason == "stop"


def test_stop_ids_param_ends_the_text(eng, monkeypatch):
    tok = eng.tokenizer
    a, b = tok.encode("alpha"), tok.encode(" beta")
    _script(monkeypatch, a + b + a)
    gen = eng.generate("x = ", GenerationParams(max_new_tokens=20, stop_ids=[b[0]]))
    assert gen.result() == tok.decode(a) and gen.finish_reason == "stop"
    with pytest.raises(ValueError, match="stop_ids"):
        GenerationParams(stop_ids=["x"])


def test_ignore_eos_still_generates_past_control_tokens(eng, monkeypatch):
    tok = eng.tokenizer
    special = tok.special_tokens["<fim_suffix>"]
    _script(monkeypatch, [special] * 3)
    gen = eng.generate(
        "x = ", GenerationParams(max_new_tokens=3, ignore_eos=True, stop_ids=[special])
    )
    gen.result()
    assert gen.tokens == [special] * 3 and gen.finish_reason == "length"


@pytest.mark.parametrize("speculative", [False, True])
def test_completion_and_docstring_action_never_contain_control_tokens(
    eng, monkeypatch, speculative
):
    tok = eng.tokenizer
    builder = PromptBuilder(tok)
    body = tok.encode("Return the sum.")
    _script(monkeypatch, body + [tok.special_tokens["<fim_suffix>"]] + tok.encode("junk"))
    src = "def add(a, b):\n    return a + b\n"
    loop = asyncio.new_event_loop()
    try:
        settings = Settings(
            max_tokens=24, context_tokens=256, speculative=speculative, min_confidence=0.0
        )
        res = completions.complete(
            LocalModel(eng),
            builder,
            Job("doc", lambda j: None, loop),
            src,
            len(src) - 1,
            settings,
            completions.INVOKED,
            GenerationParams,
        )
        p = actions.plan(actions.DOCSTRING, src, src.index("return"), src.index("return"), 1, 64)
        region, _ = actions.run_plan(
            LocalModel(eng),
            builder,
            Job("edit", lambda j: None, loop),
            p,
            GenerationParams,
            256,
            speculative=speculative,
        )
    finally:
        loop.close()
    for out in (*res.items, region):
        assert not any(s in out for s in tok.special_tokens), out
        assert "junk" not in out
