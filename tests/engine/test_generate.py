"""Generation behaviour: streaming text, stop strings, eos, sampling seeds, limits, cancel, errors."""

from __future__ import annotations

import threading
import time

import pytest
from engine_helpers import greedy, hf_greedy, load_engine, random_ids

from engine import GenerationParams, ModelError
from engine.generate import _held_suffix


@pytest.fixture(scope="module")
def eng(tiny_llama, tmp_path_factory):
    return load_engine(tiny_llama, tmp_path_factory)


def test_streamed_text_is_the_decoded_tokens(eng):
    gen = eng.generate(
        "def add(a, b):\n    return", GenerationParams(max_new_tokens=24, ignore_eos=True)
    )
    chunks = list(gen)
    assert [c.token_id for c in chunks] == gen.tokens
    assert "".join(c.text for c in chunks) == gen.text == eng.tokenizer.decode(gen.tokens)
    assert gen.finish_reason == "length"
    s = gen.stats
    assert s["prompt_tokens"] == len(eng.tokenizer.encode("def add(a, b):\n    return"))
    assert (
        s["new_tokens"] == 24
        and s["ttft_ms"] > 0
        and s["decode_tok_s"] > 0
        and s["total_ms"] >= s["ttft_ms"]
    )


def _full_text(eng, ids, n=48):
    return eng.tokenizer.decode(greedy(eng, ids, n).tokens)


def test_stop_string_cuts_text(eng):
    ids = random_ids(eng, 12, seed=21)
    full = _full_text(eng, ids)
    assert len(full) > 10
    stop = full[5:8]
    cut = full.find(stop)
    gen = eng.generate(
        ids, GenerationParams(max_new_tokens=48, stop=(stop, "\x00never"), ignore_eos=True)
    )
    streamed = "".join(c.text for c in gen)
    assert gen.finish_reason == "stop"
    assert gen.text == streamed == full[:cut]
    assert stop not in streamed


def test_stop_string_prefix_is_held_then_released(eng):
    ids = random_ids(eng, 12, seed=22)
    full = _full_text(eng, ids, 32)
    # a stop string that starts like the text but never matches: all text must still come out
    stop = full[3:6] + "\x00"
    gen = eng.generate(ids, GenerationParams(max_new_tokens=32, stop=stop, ignore_eos=True))
    assert "".join(c.text for c in gen) == full
    assert gen.finish_reason == "length"


def test_held_suffix():
    assert _held_suffix("abc\n", ("\n\n",)) == 1
    assert _held_suffix("abc", ("\n\n",)) == 0
    assert _held_suffix("xxab", ("abc", "b")) == 2
    assert _held_suffix("", ("ab",)) == 0


def test_eos_stops(eng):
    ids = random_ids(eng, 10, seed=23)
    first = greedy(eng, ids, 6).tokens
    saved = eng.eos_ids
    eng.eos_ids = frozenset({first[3]})
    try:
        gen = eng.generate(ids, GenerationParams(max_new_tokens=20))
        list(gen)
    finally:
        eng.eos_ids = saved
    assert gen.finish_reason == "eos"
    assert gen.tokens == first[:3]  # the eos token itself is not part of the output


def test_seeded_sampling_is_reproducible(eng):
    ids = random_ids(eng, 10, seed=24)
    p = GenerationParams(
        max_new_tokens=32, temperature=1.0, top_k=50, top_p=0.95, seed=7, ignore_eos=True
    )
    a = eng.generate(ids, p)
    a.result()
    b = eng.generate(ids, p, slot="other")
    b.result()
    c = eng.generate(
        ids, GenerationParams(max_new_tokens=32, temperature=1.0, seed=8, ignore_eos=True)
    )
    c.result()
    assert a.tokens == b.tokens
    assert a.tokens != c.tokens


def test_prompt_too_long_is_a_clear_error(eng):
    n = eng.context + 5
    with pytest.raises(ModelError, match=rf"{n} tokens.*context is {eng.context}"):
        eng.generate([1] * n)
    # the engine stays usable
    assert greedy(eng, random_ids(eng, 8, seed=25), 4).finish_reason == "length"


def test_generation_stops_at_context_end(tiny_llama, tmp_path_factory):
    small = load_engine(tiny_llama, tmp_path_factory, max_context=40)
    gen = greedy(small, random_ids(small, 30, seed=26), 64)
    assert gen.finish_reason == "length" and len(gen.tokens) == 10


def test_bad_params():
    with pytest.raises(ValueError, match="max_new_tokens"):
        GenerationParams(max_new_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        GenerationParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        GenerationParams(top_p=0)
    with pytest.raises(ValueError, match="stop"):
        GenerationParams(stop=("",))
    assert GenerationParams(stop="\n").stop == ("\n",)


def test_bad_prompt_ids(eng):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        eng.generate([eng.config.vocab_size + 3])


def test_max_time(eng):
    gen = eng.generate(
        random_ids(eng, 8, seed=27),
        GenerationParams(max_new_tokens=400, max_time_s=1e-6, ignore_eos=True),
    )
    list(gen)
    assert gen.finish_reason == "time" and len(gen.tokens) == 1


def test_cancel_before_start(eng):
    gen = eng.generate(random_ids(eng, 8, seed=28), GenerationParams(max_new_tokens=8))
    gen.cancel()
    assert list(gen) == [] and gen.finish_reason == "cancelled"


def test_cancel_from_another_thread(eng, tiny_llama):
    ids = random_ids(eng, 16, seed=29)
    gen = eng.generate(ids, GenerationParams(max_new_tokens=400, ignore_eos=True), slot="c")
    started = threading.Event()
    done_at = {}

    def consume():
        for _ in gen:
            started.set()
            time.sleep(0.005)  # a consumer doing work per chunk: 400 tokens take >= 2 s
        done_at["t"] = time.perf_counter()

    t = threading.Thread(target=consume)
    t.start()
    assert started.wait(30)
    t_cancel = time.perf_counter()
    gen.cancel()
    t.join(30)
    assert not t.is_alive()
    assert gen.finish_reason == "cancelled" and 0 < len(gen.tokens) < 400
    assert done_at["t"] >= t_cancel
    # the slot only holds tokens whose KV was written: greedy continues exactly as the reference
    follow = ids + gen.tokens
    again = greedy(eng, follow, 16, slot="c")
    assert again.stats["reused_tokens"] >= len(ids)
    assert again.tokens == hf_greedy(tiny_llama, follow, 16)


def test_cancel_aborts_prefill_in_flight(eng, tiny_llama):
    """A cancel during a long prefill terminates the ORT run; the cache stays consistent."""
    ids = random_ids(eng, eng.context - 8, seed=30)
    eng.reset()
    for delay in (0.0, 0.002, 0.01):
        gen = eng.generate(ids, GenerationParams(max_new_tokens=4, ignore_eos=True), slot="p")
        threading.Timer(delay, gen.cancel).start()
        list(gen)
        assert gen.finish_reason in ("cancelled", "length")
        assert eng.slot_tokens("p") <= len(ids) + 3
    short = ids[:20]
    again = greedy(eng, short, 16, slot="p")
    assert again.tokens == hf_greedy(tiny_llama, short, 16)


def test_slot_taken_over_by_new_generation(eng):
    """Starting a new generation on a slot stops an unfinished one on the same slot."""
    ids = random_ids(eng, 10, seed=31)
    old = eng.generate(ids, GenerationParams(max_new_tokens=50, ignore_eos=True), slot="s")
    next(old)
    new = greedy(eng, ids, 5, slot="s")
    assert new.finish_reason == "length"
    assert list(old) == [] and old.finish_reason == "cancelled"


def test_interleaved_generations_on_two_slots(tiny_llama, tmp_path_factory):
    two = load_engine(tiny_llama, tmp_path_factory, slots=2)
    a_ids, b_ids = random_ids(two, 12, seed=32), random_ids(two, 14, seed=33)
    p = GenerationParams(max_new_tokens=20, ignore_eos=True)
    a, b = two.generate(a_ids, p, slot="a"), two.generate(b_ids, p, slot="b")
    for _ in range(20):
        next(a)
        next(b)
    assert a.tokens == hf_greedy(tiny_llama, a_ids, 20)
    assert b.tokens == hf_greedy(tiny_llama, b_ids, 20)


def test_cancel_during_run_terminates_ort(eng, tiny_llama, monkeypatch):
    """A cancel that lands while ORT is running: the run is terminated and the chunk is not cached."""
    eng.reset()
    ids = random_ids(eng, 64, seed=34)
    greedy(eng, ids[:10], 1, slot="t")
    gen = eng.generate(ids, GenerationParams(max_new_tokens=4, ignore_eos=True), slot="t")
    real_forward = eng.runtime.forward
    calls = []

    def forward_cancelled_midway(*args, **kw):
        calls.append(1)
        gen.cancel()  # as if another thread cancelled right now; RunOptions.terminate is set
        return real_forward(*args, **kw)

    monkeypatch.setattr(eng.runtime, "forward", forward_cancelled_midway)
    assert list(gen) == [] and gen.finish_reason == "cancelled" and calls
    monkeypatch.undo()
    assert eng.slot_tokens("t") == 10  # the aborted prefill chunk is not counted as cached
    again = greedy(eng, ids, 8, slot="t")
    assert again.stats["reused_tokens"] == 10
    assert again.tokens == hf_greedy(tiny_llama, ids, 8)


def test_held_text_is_flushed_at_eos(eng):
    ids = random_ids(eng, 10, seed=35)
    first = greedy(eng, ids, 6).tokens
    text3 = eng.tokenizer.decode(first[:3])
    saved = eng.eos_ids
    eng.eos_ids = frozenset({first[3]})
    try:
        gen = eng.generate(ids, GenerationParams(max_new_tokens=20, stop=(text3[-1] + "\x00",)))
        chunks = list(gen)
    finally:
        eng.eos_ids = saved
    assert gen.finish_reason == "eos" and gen.tokens == first[:3]
    assert "".join(c.text for c in chunks) == gen.text == text3
    assert chunks[-1].token_id == first[3] and chunks[-1].text.endswith(text3[-1])


def test_chunks_carry_the_models_logprobs_when_asked(eng):
    """`logprobs=True`: each chunk's logprob is the log-softmax of its token under the model, the
    same in plain and speculative decoding; without it no chunk carries one."""
    import numpy as np

    from engine import speculative

    prompt = eng.tokenizer.encode(
        "def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n    return"
    )
    params = GenerationParams(max_new_tokens=20, ignore_eos=True, logprobs=True)
    gen = eng.generate(prompt, params)
    lps = [c.logprob for c in gen]
    assert len(lps) == len(gen.tokens) == len(gen.logprobs) == 20 and lps == gen.logprobs
    logits = eng.forward_logits(prompt + gen.tokens[:-1]).astype(np.float64)[len(prompt) - 1 :]
    ref = (
        logits
        - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
        - logits.max(-1, keepdims=True)
    )
    want = ref[np.arange(20), gen.tokens]
    assert np.allclose(lps, want, atol=1e-3) and all(lp <= 0 for lp in lps)
    spec = speculative.generate(eng, prompt, params)
    assert [c.token_id for c in spec] == gen.tokens[
        : len(spec.tokens)
    ] and spec.tokens == gen.tokens
    assert np.allclose(spec.logprobs, gen.logprobs, atol=1e-3)
    plain = eng.generate(prompt, GenerationParams(max_new_tokens=5, ignore_eos=True))
    assert all(c.logprob is None for c in plain) and plain.logprobs == []
