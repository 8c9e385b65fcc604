"""Prefix reuse across requests and slots, the on-disk graph cache, and the sampler."""

from __future__ import annotations

import numpy as np
import pytest
from engine_helpers import greedy, hf_greedy, load_engine, random_ids

import engine.engine as engine_mod
import engine.source as source_mod
from engine import Engine, graph_cache
from engine.prefix_cache import common_prefix
from engine.sampling import Sampler


@pytest.mark.parametrize(
    "a,b,n",
    [
        ([], [], 0),
        ([1, 2, 3], [1, 2, 3], 3),
        ([1, 2, 3], [1, 2], 2),
        ([1, 2, 3], [1, 9, 3], 1),
        ([5], [6], 0),
        (list(range(1000)), list(range(999)) + [7], 999),
    ],
)
def test_common_prefix(a, b, n):
    assert common_prefix(a, b) == n == common_prefix(b, a)


def test_reuse_counts_and_lru(tiny_llama, tmp_path_factory):
    eng = load_engine(tiny_llama, tmp_path_factory, slots=2)
    a, b, c = (random_ids(eng, 30, seed=s) for s in (40, 41, 42))
    assert greedy(eng, a, 4, slot="a").stats["reused_tokens"] == 0
    assert greedy(eng, b, 4, slot="b").stats["reused_tokens"] == 0
    assert greedy(eng, a[:25] + b[:3], 4, slot="a").stats["reused_tokens"] == 25
    assert eng.slot_tokens("a") == 28 + 3 and eng.slot_tokens("b") == 30 + 3
    # a third key recycles the least recently used slot ("b"), keeping its tokens for reuse
    gen = greedy(eng, b[:20] + c[:5], 8, slot="c")
    assert gen.stats["reused_tokens"] == 20
    assert gen.tokens == hf_greedy(tiny_llama, b[:20] + c[:5], 8)
    assert eng.slot_tokens("b") == 0 and eng.slot_tokens("a") == 31
    assert greedy(eng, a[:25] + b[:3], 4, slot="a").stats["reused_tokens"] == 27


def test_one_token_edit_at_end_prefills_one_token(tiny_llama, tmp_path_factory):
    eng = load_engine(tiny_llama, tmp_path_factory)
    ids = random_ids(eng, 300, seed=43)
    greedy(eng, ids, 2)
    edited = ids[:-1] + [(ids[-1] + 1) % eng.sample_vocab]
    gen = greedy(eng, edited, 16)
    assert gen.stats["reused_tokens"] == 299
    assert gen.tokens == hf_greedy(tiny_llama, edited, 16)


def test_graph_cache_hit_on_second_load(tiny_qwen2, tmp_path, monkeypatch):
    before = graph_cache.builds
    first = Engine.load(tiny_qwen2, cache_dir=tmp_path, wafer=False)
    assert first.graph_built and graph_cache.builds == before + 1

    def no_build(*a, **k):
        raise AssertionError("the graph was rebuilt although it is cached")

    monkeypatch.setattr(engine_mod, "build_decoder", no_build)
    monkeypatch.setattr(source_mod, "open_weights", no_build)  # where a load reads weights
    second = Engine.load(tiny_qwen2, cache_dir=tmp_path, wafer=False)
    assert not second.graph_built and graph_cache.builds == before + 1
    assert second.graph_path == first.graph_path
    ids = random_ids(second, 12, seed=44)
    np.testing.assert_array_equal(second.forward_logits(ids), first.forward_logits(ids))
    # no temporary folders left behind
    assert [p.name for p in tmp_path.iterdir()] == [first.graph_path.parent.name]


def test_graph_cache_key_depends_on_options_and_emitter(tiny_qwen2, tmp_path):
    from engine.config import load_config
    from engine.graph import DenseLinear
    from engine.weights import weights_digest

    cfg, digest = load_config(tiny_qwen2), weights_digest(tiny_qwen2)

    class Other(DenseLinear):
        def cache_key(self):
            return "other"

    k = graph_cache.graph_key(digest, cfg, {"rope_len": 512}, DenseLinear())
    assert k == graph_cache.graph_key(digest, cfg, {"rope_len": 512}, DenseLinear())
    assert k != graph_cache.graph_key(digest, cfg, {"rope_len": 256}, DenseLinear())
    assert k != graph_cache.graph_key(digest, cfg, {"rope_len": 512}, Other())
    assert k != graph_cache.graph_key("0" * 32, cfg, {"rope_len": 512}, DenseLinear())


def test_graph_cache_env(monkeypatch, tmp_path):
    monkeypatch.setenv("SPARK_LSP_CACHE", str(tmp_path))
    assert graph_cache.cache_root() == tmp_path / "graphs"
    assert graph_cache.cache_root(tmp_path / "x") == tmp_path / "x"


def test_default_model_error_is_clear(monkeypatch, tmp_path):
    """An install without the bundled model folder (and no $SPARK_LSP_MODEL) says so."""
    monkeypatch.delenv("SPARK_LSP_MODEL", raising=False)
    monkeypatch.setattr(engine_mod.models, "bundled_model_dir", lambda: tmp_path / "missing")
    with pytest.raises(engine_mod.ModelError, match="bundled default model"):
        Engine.load()


def test_sampler_greedy_and_filters():
    logits = np.array([0.1, 3.0, 2.9, -1.0, 0.5], np.float32)
    assert Sampler()(logits) == 1
    assert Sampler(temperature=1.0, top_k=1, seed=0)(logits) == 1
    assert Sampler(temperature=1.0, top_p=1e-6, seed=0)(logits) == 1
    picks = {Sampler(temperature=1.0, top_k=2, seed=s)(logits) for s in range(50)}
    assert picks == {1, 2}
    picks = {Sampler(temperature=5.0, seed=s)(logits) for s in range(200)}
    assert picks == {0, 1, 2, 3, 4}
    draws = [Sampler(temperature=0.7, top_p=0.9, seed=3)(logits) for _ in range(3)]
    assert len(set(draws)) == 1


def test_sampler_rejects_bad_values():
    for kw in ({"temperature": -0.1}, {"top_k": -1}, {"top_p": 1.5}):
        with pytest.raises(ValueError, match=next(iter(kw))):
            Sampler(**kw)


def test_corrupt_cached_graph_is_rebuilt(tiny_qwen2, tmp_path):
    first = Engine.load(tiny_qwen2, cache_dir=tmp_path, wafer=False)
    ids = random_ids(first, 10, seed=45)
    expected = first.forward_logits(ids)
    data = first.graph_path.parent / graph_cache.DATA_FILE
    data.write_bytes(data.read_bytes()[:1000])  # truncated, as after a full disk
    before = graph_cache.builds
    again = Engine.load(tiny_qwen2, cache_dir=tmp_path, wafer=False)
    assert again.graph_built and graph_cache.builds == before + 1
    np.testing.assert_array_equal(again.forward_logits(ids), expected)


def test_unwritable_cache_falls_back_to_temp(tiny_llama, tmp_path, monkeypatch):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("a file where the cache folder should be")
    monkeypatch.setattr(graph_cache.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    eng = Engine.load(tiny_llama, cache_dir=blocker / "graphs", wafer=False)
    assert eng.graph_path.is_relative_to(tmp_path / "tmp")
    assert greedy(eng, random_ids(eng, 8, seed=46), 4).finish_reason == "length"


def test_forget_frees_the_slots_it_names(tiny_llama, tmp_path_factory):
    """A client that goes away (a closed session of the session host) frees its KV slots; the
    others keep theirs, and a forgotten key starts cold."""
    eng = load_engine(tiny_llama, tmp_path_factory, slots=4)
    a, b = random_ids(eng, 30, seed=50), random_ids(eng, 30, seed=51)
    greedy(eng, a, 4, slot="s1:a")
    greedy(eng, b, 4, slot="s2:b")
    assert eng.forget(["s1:a", "s1:never-used"]) == 1
    assert eng.cached_slots() == ["s2:b"]
    assert eng.slot_tokens("s1:a") == 0
    assert greedy(eng, b, 4, slot="s2:b").stats["reused_tokens"] == 29  # untouched
    gen = greedy(eng, a, 4, slot="s1:a")
    assert gen.stats["reused_tokens"] == 0 and gen.tokens == hf_greedy(tiny_llama, a, 4)
