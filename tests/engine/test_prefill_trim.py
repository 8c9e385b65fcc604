"""A generation whose prefill ran many prompt tokens gives the C heap's free pages back once its
first tokens are out (engine.generate.Generation._release_prefill_memory); one that reused its
prompt, or prefilled a few tokens, does not pay for a trim."""

from __future__ import annotations

import pytest
from engine_helpers import load_engine, random_ids

from engine import GenerationParams
from engine import generate as generate_module
from engine.speculative import generate as speculative_generate


@pytest.fixture(scope="module")
def eng(tiny_llama, tmp_path_factory):
    eng = load_engine(tiny_llama, tmp_path_factory)
    eng.prefill_chunk = 64  # several chunks, as a long prompt runs
    return eng


@pytest.fixture
def trims(monkeypatch):
    calls: list[int] = []
    monkeypatch.setattr(generate_module, "trim_heap", lambda: calls.append(1))
    return calls


def _long_prompt(eng, seed: int) -> list[int]:
    n = generate_module.TRIM_AFTER_PREFILL + 40
    assert n + 16 < eng.runtime.max_len, "the tiny model's context holds the prompt"
    return random_ids(eng, n, seed=seed)


def test_a_long_prefill_trims_once_after_its_first_token(eng, trims):
    gen = eng.generate(
        _long_prompt(eng, 1), GenerationParams(max_new_tokens=6, ignore_eos=True), slot="a"
    )
    it = iter(gen)
    next(it)
    assert trims == []  # the first token is not held back by the trim (time to first token)
    next(it)
    assert trims == [1]
    list(it)
    assert trims == [1] and gen.finish_reason == "length"


def test_a_generation_that_ends_at_its_first_token_still_trims(eng, trims):
    gen = eng.generate(_long_prompt(eng, 2), GenerationParams(max_new_tokens=1), slot="b")
    gen.result()
    assert trims == [1]


def test_a_reused_or_short_prefill_does_not_trim(eng, trims):
    prompt = _long_prompt(eng, 3)
    params = GenerationParams(max_new_tokens=4, ignore_eos=True)
    eng.generate(prompt, params, slot="c").result()
    assert trims == [1]
    eng.generate(prompt + random_ids(eng, 8, seed=4), params, slot="c").result()  # 8 new tokens
    eng.generate(random_ids(eng, 20, seed=5), params, slot="d").result()  # a short prompt
    assert trims == [1]


def test_a_prefill_cancelled_after_some_chunks_trims(eng, trims, monkeypatch):
    gens: list = []
    forward = eng.runtime.forward
    calls = 0

    def forward_then_cancel(*args, **kw):
        nonlocal calls
        out = forward(*args, **kw)
        calls += 1
        if calls == 5:  # 5 chunks of 64 tokens ran, then the editor's cancel arrives
            gens[0].cancel()
        return out

    monkeypatch.setattr(eng.runtime, "forward", forward_then_cancel)
    gen = eng.generate(
        _long_prompt(eng, 6), GenerationParams(max_new_tokens=8, ignore_eos=True), slot="e"
    )
    gens.append(gen)
    gen.result()
    assert gen.finish_reason == "cancelled" and gen.tokens == [] and trims == [1]


def test_speculative_decoding_trims_after_its_first_token(eng, trims):
    prompt = _long_prompt(eng, 7)
    gen = speculative_generate(
        eng, prompt, GenerationParams(max_new_tokens=12, ignore_eos=True), draft=prompt[-30:]
    )
    it = iter(gen)
    next(it)
    assert trims == []
    next(it)
    assert trims == [1]  # before its first pass, not only when the generation ends
    list(it)
    assert trims == [1] and len(gen.tokens) == 12
