"""The engine against transformers on the tiny Llama (tied), Qwen2 (q/k/v biases), Mistral (GQA), Qwen3
(per-head q/k norm, padded head_dim), Starcoder2 (LayerNorm, GELU MLP, biases) and Gemma (GeGLU,
norm weight + 1, scaled embeddings):
logits within 1e-4 and 64 identical greedy tokens — cold, after prefix reuse, after a cancel, and
when a longer prompt follows a shorter one."""

from __future__ import annotations

import numpy as np
import pytest
from engine_helpers import greedy, hf_greedy, hf_logits, load_engine, random_ids

from engine import GenerationParams

ARCHS = ("llama", "qwen2", "mistral", "qwen3", "starcoder2", "gemma")
STEPS = 64


@pytest.fixture(scope="module", params=ARCHS)
def arch_engine(request, tiny_models, tmp_path_factory):
    path = tiny_models[request.param]
    return path, load_engine(path, tmp_path_factory, slots=2)


def test_logits_match(arch_engine):
    path, eng = arch_engine
    ids = random_ids(eng, 48, seed=1)
    got = eng.forward_logits(ids)
    ref = hf_logits(path, ids)
    assert got.shape == ref.shape
    np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)


def test_logits_match_chunked(arch_engine):
    """Prefill split in chunks (KV written by earlier runs) gives the same logits."""
    path, eng = arch_engine
    ids = random_ids(eng, 40, seed=2)
    old = eng.prefill_chunk
    eng.prefill_chunk = 7
    try:
        got = eng.forward_logits(ids)
    finally:
        eng.prefill_chunk = old
    np.testing.assert_allclose(got, hf_logits(path, ids), atol=1e-4, rtol=0)


def test_trailing_logits_and_kv_match(arch_engine):
    """A run asking for the last k logits (the last layer's O-proj and MLP then run on those k
    positions only) gives the same rows, and leaves the same KV cache, as a run asking for all."""
    path, eng = arch_engine
    ids = random_ids(eng, 30, seed=3)
    rt = eng.runtime
    full_kv = rt.new_kv()
    full = rt.forward(full_kv, ids, 0, num_logits=len(ids))
    np.testing.assert_allclose(full, hf_logits(path, ids), atol=1e-4, rtol=0)
    for k in (1, 2, 17):
        kv = rt.new_kv()
        np.testing.assert_allclose(
            rt.forward(kv, ids, 0, num_logits=k), full[-k:], atol=1e-5, rtol=0
        )
        for key, v in kv.values.items():
            np.testing.assert_array_equal(
                v.numpy()[:, :, : len(ids)], full_kv.values[key].numpy()[:, :, : len(ids)]
            )


def test_greedy_cold(arch_engine):
    path, eng = arch_engine
    eng.reset()
    ids = random_ids(eng, 20, seed=3)
    gen = greedy(eng, ids, STEPS)
    assert gen.finish_reason == "length"
    assert gen.stats["reused_tokens"] == 0
    assert gen.tokens == hf_greedy(path, ids, STEPS)


def test_greedy_after_prefix_reuse(arch_engine):
    path, eng = arch_engine
    eng.reset()
    base = random_ids(eng, 40, seed=4)
    greedy(eng, base, 8, slot="doc")
    edited = base[:30] + random_ids(eng, 5, seed=5)  # an edit near the end of the prompt
    gen = greedy(eng, edited, STEPS, slot="doc")
    assert gen.stats["reused_tokens"] == 30
    assert gen.tokens == hf_greedy(path, edited, STEPS)


def test_greedy_longer_prompt_after_shorter(arch_engine):
    path, eng = arch_engine
    eng.reset()
    short = random_ids(eng, 16, seed=6)
    first = greedy(eng, short, 10, slot="doc")
    longer = short + first.tokens + random_ids(eng, 12, seed=7)
    gen = greedy(eng, longer, STEPS, slot="doc")
    # everything whose KV was written: the prompt and all generated tokens but the last
    assert gen.stats["reused_tokens"] == len(short) + len(first.tokens) - 1
    assert gen.tokens == hf_greedy(path, longer, STEPS)


def test_greedy_same_prompt_twice(arch_engine):
    path, eng = arch_engine
    eng.reset()
    ids = random_ids(eng, 24, seed=8)
    a = greedy(eng, ids, 12, slot="doc")
    b = greedy(eng, ids, STEPS, slot="doc")
    assert (
        b.stats["reused_tokens"] == len(ids) - 1
    )  # the last prompt token is re-run for its logits
    assert b.tokens[:12] == a.tokens
    assert b.tokens == hf_greedy(path, ids, STEPS)


def test_greedy_after_cancel(arch_engine):
    path, eng = arch_engine
    eng.reset()
    ids = random_ids(eng, 30, seed=9)
    gen = eng.generate(ids, GenerationParams(max_new_tokens=STEPS, ignore_eos=True), slot="doc")
    for i, _ in enumerate(gen):
        if i == 4:
            gen.cancel()
    assert gen.finish_reason == "cancelled"
    assert len(gen.tokens) == 5
    follow = ids + gen.tokens[:3] + random_ids(eng, 4, seed=10)
    again = greedy(eng, follow, STEPS, slot="doc")
    assert again.stats["reused_tokens"] == len(ids) + 3
    assert again.tokens == hf_greedy(path, follow, STEPS)


def test_wafer_emitter_matches(tiny_llama, tmp_path_factory):
    """The partitioned (wafer) linear emitter gives the same logits as transformers."""
    eng = load_engine(tiny_llama, tmp_path_factory, wafer=True, grid=(2, 2))
    ids = random_ids(eng, 32, seed=11)
    np.testing.assert_allclose(
        eng.forward_logits(ids), hf_logits(tiny_llama, ids), atol=1e-4, rtol=0
    )
    assert greedy(eng, ids, 16).tokens == hf_greedy(tiny_llama, ids, 16)


def test_bf16_sharded_folder_matches(tiny_qwen2, tmp_path, tmp_path_factory):
    """bf16 weights in shards: the engine upcasts to fp32 like transformers loading them in fp32."""
    from tiny_models import write_variant

    folder = write_variant(
        tiny_qwen2, tmp_path / "qwen2_bf16_sharded", dtype="bfloat16", max_shard_size="100KB"
    )
    assert (folder / "model.safetensors.index.json").is_file()
    eng = load_engine(folder, tmp_path_factory)
    ids = random_ids(eng, 24, seed=12)
    np.testing.assert_allclose(eng.forward_logits(ids), hf_logits(folder, ids), atol=1e-4, rtol=0)
    assert greedy(eng, ids, 16).tokens == hf_greedy(folder, ids, 16)
