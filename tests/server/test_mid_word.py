"""Token healing in the inline-completion path: a cursor inside a word gets a completion of the
rest of the word, never the typed part again, over LSP as in-process; the prefix cache still hits."""

from __future__ import annotations

import asyncio

import pytest
from conftest import OPTIONS, SAMPLE, start_editor

from spark_lsp import completions
from spark_lsp.model_host import LocalModel
from spark_lsp.prompt import PromptBuilder
from spark_lsp.scheduler import Job
from spark_lsp.settings import Settings

URI = "file:///work/healing.py"
# cursors inside words: the text before each cursor ends with a partial identifier
PARTIAL = ("        out.app", "    total = ad", "def sca", "    return a + ", "    for v in val")


def mid_word_doc(partial: str) -> tuple[str, int]:
    """SAMPLE with the line holding `partial` cut right after it (the user is typing it)."""
    line_start = SAMPLE.index(partial)
    line_end = SAMPLE.index("\n", line_start)
    text = SAMPLE[:line_start] + partial + SAMPLE[line_end:]
    return text, line_start + len(partial)


@pytest.fixture(scope="module")
def engine(tiny_llama):
    from engine import Engine

    return Engine.load(tiny_llama, slots=4, precision="fp32")  # as the server loads it (fp32 below)


def run_complete(engine, text, off, monkeypatch, slot="doc"):
    """completions.complete as the server runs it, plus the Generation it started."""
    from engine import GenerationParams

    gens = []
    model = LocalModel(engine)
    real = model.generate

    def spy(*a, **kw):
        gens.append(real(*a, **kw))
        return gens[-1]

    model.generate = spy
    loop = asyncio.new_event_loop()
    try:
        settings = Settings(
            max_tokens=OPTIONS["maxTokens"],
            context_tokens=OPTIONS["contextTokens"],
            max_edit_tokens=OPTIONS["maxEditTokens"],
            live_edits=False,
            precision="fp32",
            min_confidence=0.0,
        )
        res = completions.complete(
            model,
            PromptBuilder(engine.tokenizer),
            Job(slot, lambda j: None, loop),
            text,
            off,
            settings,
            completions.AUTOMATIC,
            GenerationParams,
        )
    finally:
        loop.close()
    return res, gens[0]


def test_mid_word_completion_does_not_repeat_the_partial_word(engine, monkeypatch):
    tok = engine.tokenizer
    for partial in PARTIAL:
        text, off = mid_word_doc(partial)
        res, gen = run_complete(engine, text, off, monkeypatch)
        healed = gen.params.healed_prefix
        assert healed and text[:off].endswith(healed) and res.stats["healed"] == len(healed)
        assert partial.endswith(healed)  # the end of the line being typed, never a line break
        # the model re-spelled the healed text, and only what follows it was emitted
        full = tok.decode(gen.tokens)
        assert full.startswith(healed + gen.text)
        for item in res.items:
            assert item in gen.text or gen.text.startswith(item.rstrip())


def test_column_zero_heals_the_line_break(engine, monkeypatch):
    """A cursor at the start of a line: the prompt's final newline is backed off, so the model
    writes it merged with the line's indentation, as it learnt; only what follows is emitted."""
    line = SAMPLE.index("        out.append")
    text = (
        SAMPLE[:line] + SAMPLE[SAMPLE.index("\n", line) + 1 :]
    )  # that line deleted, cursor at column 0
    res, gen = run_complete(engine, text, line, monkeypatch)
    healed = gen.params.healed_prefix
    assert healed and not healed.strip("\r\n") and text[:line].endswith(healed)
    assert res.stats["healed"] == len(healed)
    assert engine.tokenizer.decode(gen.tokens).startswith(healed + gen.text)
    # the prompt is the unhealed one less the newline token (before the FIM middle token): the
    # prefix cache still hits
    unhealed = (
        PromptBuilder(engine.tokenizer, heal=False)
        .build(text, line, OPTIONS["contextTokens"], key="doc")
        .ids
    )
    assert list(gen.prompt) == unhealed[:-2] + unhealed[-1:]


def test_typing_on_a_healed_word_reuses_the_prompt_cache(engine, monkeypatch):
    text, off = mid_word_doc("        out.app")
    res1, gen1 = run_complete(engine, text, off, monkeypatch, slot="cache")
    text2 = text[:off] + "e" + text[off:]
    res2, gen2 = run_complete(engine, text2, off + 1, monkeypatch, slot="cache")
    assert gen2.params.healed_prefix.endswith("appe")
    # only the healed tail of the prefix and the middle token are prefilled again
    assert gen2.stats["reused_tokens"] >= len(gen2.prompt) - 4, gen2.stats


async def test_lsp_mid_word_item_is_the_rest_of_the_word(tiny_llama, engine, monkeypatch):
    expected = None
    for partial in PARTIAL:  # a cursor where the tiny random model suggests something
        text, off = mid_word_doc(partial)
        res, gen = run_complete(engine, text, off, monkeypatch, slot=URI)
        if res.items and len(res.items[0]) >= 2:
            expected = (text, off, res.items[0], gen.params.healed_prefix)
            break
    assert expected, "the tiny model suggested nothing at any mid-word cursor"
    text, off, item, healed = expected
    client, ed = await start_editor(tiny_llama, {"precision": "fp32"})
    try:
        ed.open(URI, text)
        got = await ed.inline(URI, off)
        assert [i.insert_text for i in got.items] == [item]
        assert not healed.strip() or not item.startswith(healed.strip())  # not the typed word again
        # typing the suggestion's first character is answered from it, without the model
        before = await ed.metrics()
        off = ed.type(URI, off, item[0])
        got = await ed.inline(URI, off)
        assert [i.insert_text for i in got.items] == [item[1:]]
        assert (await ed.metrics())["modelCalls"] == before["modelCalls"]
    finally:
        await client.shutdown_session()
        await client.stop()
