"""Engine façade: load options, exposed attributes, bad arguments."""

from __future__ import annotations

import pytest
from engine_helpers import graph_cache_dir, load_engine, random_ids
from op_forms import needs_op_default

from engine import Engine, ModelError


@pytest.fixture(scope="module")
def eng(tiny_mistral, tmp_path_factory):
    return load_engine(tiny_mistral, tmp_path_factory)


def test_attributes(eng, tiny_mistral):
    assert eng.name == tiny_mistral.name and eng.model_dir == tiny_mistral
    assert eng.config.architecture == "mistral"
    assert eng.context == min(eng.config.max_position_embeddings, 8192)
    assert eng.tokenizer.decode(eng.tokenizer.encode("x = 1")) == "x = 1"
    assert eng.eos_ids >= set(eng.config.eos_token_ids)
    assert "mistral" in repr(eng)


@pytest.mark.parametrize(
    "kw,match",
    [({"threads": 0}, "threads"), ({"max_context": 1}, "max_context"), ({"slots": 0}, "slots")],
)
def test_bad_load_arguments(tiny_mistral, tmp_path_factory, kw, match):
    with pytest.raises(ValueError, match=match):
        Engine.load(tiny_mistral, cache_dir=graph_cache_dir(tmp_path_factory), wafer=False, **kw)


def test_missing_folder_is_model_error(tmp_path):
    with pytest.raises(ModelError, match="not found"):
        Engine.load(tmp_path / "nope", cache_dir=tmp_path)


def test_forward_logits_errors(eng):
    with pytest.raises(ValueError, match="at least one token"):
        eng.forward_logits([])
    with pytest.raises(ModelError, match="context"):
        eng.forward_logits([1] * (eng.context + 1))
    assert eng.forward_logits(random_ids(eng, 3, seed=50)).shape == (3, eng.config.vocab_size)


def test_empty_prompt(eng):
    if eng.config.bos_token_id is None:
        with pytest.raises(ValueError, match="empty"):
            eng.generate("")
    else:
        assert eng.generate("").prompt == [eng.config.bos_token_id]


def test_max_context_caps_kv(tiny_mistral, tmp_path_factory):
    small = load_engine(tiny_mistral, tmp_path_factory, max_context=64)
    assert small.context == 64
    with pytest.raises(ModelError, match="64"):
        small.generate([3] * 64)


def test_explicit_linear_emitter(tiny_llama, tmp_path):
    from engine.graph import DenseLinear

    class Counting(DenseLinear):
        roles: list = []

        def emit(self, gb, x, weight, *, name, role, bias=None):
            self.roles.append(role)
            return super().emit(gb, x, weight, name=name, role=role, bias=bias)

        def cache_key(self):
            return "counting"

    lin = Counting()
    eng = Engine.load(tiny_llama, cache_dir=tmp_path, linear=lin, wafer=True)
    assert eng.linear is lin and "counting" in repr(eng)
    n = eng.config.num_hidden_layers
    assert (
        sorted(set(lin.roles)) == ["down", "gate_up", "lm_head", "o", "qkv"]
        and len(lin.roles) == 4 * n + 1
    )


@pytest.mark.parametrize("contended", [False, True])
def test_spinning_session_only_while_calm(tiny_llama, tmp_path_factory, monkeypatch, contended):
    """Auto mode: a spinning decode session while the CPU is calm, the plain one when contended;
    both share the KV buffers and give the same tokens."""
    from engine_helpers import greedy, hf_greedy

    import engine.runtime as runtime_mod

    monkeypatch.setattr(runtime_mod, "cpu_contended", lambda *a: contended)
    eng = load_engine(tiny_llama, tmp_path_factory, threads=2)
    rt = eng.runtime
    assert (
        rt.calm is not rt.busy
        and rt.calm.spinning
        and not rt.busy.spinning
        and not rt.wide.spinning
    )
    ids = random_ids(eng, 40, seed=51)  # > SMALL_RUN_TOKENS: prefill on the wide session
    gen = greedy(eng, ids, 24, slot="x")
    assert rt.target is (rt.busy if contended else rt.calm)
    assert gen.tokens == hf_greedy(tiny_llama, ids, 24)
    monkeypatch.setattr(runtime_mod, "cpu_contended", lambda *a: not contended)  # switch mid-slot
    more = ids + gen.tokens + random_ids(eng, 5, seed=52)  # short prefill on the decode session
    again = greedy(eng, more, 16, slot="x")
    assert rt.target is (rt.calm if contended else rt.busy)
    assert again.stats["reused_tokens"] == len(ids) + len(gen.tokens) - 1
    assert again.tokens == hf_greedy(tiny_llama, more, 16)


def _mappings(path) -> int:
    """How many times this process maps ``path`` (lines of /proc/self/maps naming it)."""
    with open("/proc/self/maps") as f:
        return sum(line.rstrip("\n").endswith(" " + str(path)) for line in f)


@pytest.mark.parametrize("kw", [{}, {"decode_threads": 1}])
def test_the_sessions_share_one_mapping_of_the_weights(tiny_llama, tmp_path, kw):
    """Auto mode's two or three sessions read one memory map of the graph's data file
    (runtime.SharedWeights): a model of any size keeps its spinning decode session without its
    weights counted twice in resident memory (ONNX Runtime maps each initializer once per
    session: hundreds of mappings, and every page counted per session)."""
    from pathlib import Path

    from engine_helpers import greedy, hf_greedy

    eng = Engine.load(tiny_llama, cache_dir=tmp_path, threads=2, **kw)  # a graph of its own
    rt = eng.runtime
    sessions = {id(t) for t in (rt.wide, rt.busy, rt.calm)}
    assert len(sessions) == (3 if kw else 2) and rt.calm.spinning
    assert rt.shared is not None and len(rt.shared.values) > 0
    ids = random_ids(eng, 30, seed=54)
    assert greedy(eng, ids, 12).tokens == hf_greedy(tiny_llama, ids, 12)  # every session ran
    assert _mappings(Path(eng.graph_path).parent / "model.onnx.data") == 1


@needs_op_default
@pytest.mark.parametrize("mode", ["huge", "env", "no-thp"])
def test_streamed_weights_are_read_into_memory_and_the_table_stays_outside(
    tiny_llama, tmp_path, monkeypatch, mode
):
    """The weights each step streams are read into one anonymous buffer (advised for huge pages:
    4 KB file pages miss the TLB on every page); the embedding table, read a row per token, is
    not among the graph's weights at all (the runtime reads its rows: engine.embedding);
    SPARK_LSP_WEIGHTS_MMAP=1, or no transparent huge pages, maps everything. Same tokens either
    way."""
    from engine_helpers import greedy, hf_greedy

    import engine.runtime as runtime_mod

    monkeypatch.setattr(runtime_mod, "huge_pages_available", lambda: mode != "no-thp")
    monkeypatch.setenv("SPARK_LSP_WEIGHTS_MMAP", "1" if mode == "env" else "")
    # int8: the tied head has weights of its own (a float head reads the table in place, so the
    # table is streamed too and read into memory with the rest)
    eng = Engine.load(tiny_llama, cache_dir=tmp_path, threads=2, precision="int8")
    shared = eng.runtime.shared
    assert eng.runtime.embedding is not None
    assert "embed_tokens" not in {n for n, _ in shared.values}
    (data,) = shared._maps.values()
    mapped = range(data.ctypes.data, data.ctypes.data + data.size)
    weights = [v.data_ptr() for _, v in shared.values]
    if mode != "huge":
        assert shared._heap is None and all(p in mapped for p in weights)
    else:
        heap = range(shared._heap.ctypes.data, shared._heap.ctypes.data + shared._heap.size)
        assert weights and all(p in heap for p in weights)
    ids = random_ids(eng, 30, seed=55)
    assert greedy(eng, ids, 12).tokens == hf_greedy(tiny_llama, ids, 12)


def test_a_graph_of_onnx_runtime_linears_keeps_its_own_weights(tiny_llama, tmp_path):
    """MatMul and MatMulNBits pre-pack their weights when a session loads, which ONNX Runtime
    skips for an initializer handed to it: such a graph (no wafer ops) is not shared, and only a
    small one gets the second, spinning session (a copy of the pre-packed weights each)."""
    import engine.runtime as runtime_mod

    eng = Engine.load(tiny_llama, cache_dir=tmp_path, threads=2, wafer=False)
    rt = eng.runtime
    assert rt.shared is None and rt.calm.spinning and rt.calm is not rt.busy
    assert runtime_mod.SharedWeights.of(eng.graph_path) is None


@pytest.mark.parametrize("kw", [{"spinning": False}, {"spinning": True}, {"decode_threads": 1}])
def test_forced_session_modes(tiny_llama, tmp_path_factory, kw):
    from engine_helpers import greedy, hf_greedy

    eng = load_engine(tiny_llama, tmp_path_factory, threads=2, **kw)
    rt = eng.runtime
    if "spinning" in kw:
        assert rt.calm is rt.busy is rt.wide and rt.wide.spinning == kw["spinning"]
    else:
        assert rt.busy.threads == 1 and rt.wide.threads == 2
    ids = random_ids(eng, 30, seed=53)
    assert greedy(eng, ids, 12).tokens == hf_greedy(tiny_llama, ids, 12)


def test_cpu_contended_reads_pressure():
    import os

    import engine.runtime as runtime_mod

    assert isinstance(runtime_mod.cpu_contended(), bool)
    if os.path.exists("/proc/pressure/cpu"):
        assert runtime_mod.cpu_contended(threshold=1e9) is False
        assert runtime_mod.cpu_contended(threshold=0.0) is True
