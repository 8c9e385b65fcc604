"""The KV cache's element type (``Engine.load(kv_cache=...)``).

int8 and int4 engines hold their cache in float16 by default (half the bytes attention reads per
token and half the memory a long context holds), fp32 engines in float32 (the exact path); either
can be asked for.  Checked here: what each load gets, the graph cache keeping the two apart, a
graph that falls back to GroupQueryAttention keeping float32, logits against a float32 cache on
every tiny architecture, and prefix reuse and generation over a half cache."""

from __future__ import annotations

import os

import numpy as np
import pytest
from op_forms import needs_op_default, op_linear

from engine import Engine, GenerationParams
from engine.graph import DenseLinear, build_decoder
from engine.wafer import mesh_op


@pytest.fixture(scope="module", autouse=True)
def _op_built():
    if not mesh_op.attention():  # CI has a compiler; say why if this machine does not
        pytest.fail(f"DecoderAttention unavailable: {mesh_op.why_not()}")


def _kv_types(eng: Engine) -> set[str]:
    kv = eng.runtime.new_kv()
    return {v.data_type() for v in kv.values.values()}


@pytest.mark.parametrize(
    "precision,kv_cache,want",
    [
        pytest.param("int8", "auto", np.float16, marks=needs_op_default),
        pytest.param("int4", "auto", np.float16, marks=needs_op_default),
        ("fp32", "auto", np.float32),
        ("int8", "float32", np.float32),
        ("fp32", "float16", np.float16),
    ],
)
def test_each_load_gets_its_cache_type(tiny_models, tmp_path, precision, kv_cache, want):
    eng = Engine.load(
        tiny_models["qwen2"], precision=precision, kv_cache=kv_cache, cache_dir=tmp_path
    )
    assert eng.runtime.kv_dtype == want
    name = "tensor(float16)" if want == np.float16 else "tensor(float)"
    assert _kv_types(eng) == {name}
    c = eng.config
    per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * eng.runtime.head_dim
    assert eng.runtime.kv_bytes() == per_token * eng.context * np.dtype(want).itemsize


@needs_op_default
def test_the_graph_cache_keeps_the_two_apart(tiny_models, tmp_path):
    half = Engine.load(tiny_models["llama"], precision="int8", cache_dir=tmp_path)
    full = Engine.load(
        tiny_models["llama"], precision="int8", kv_cache="float32", cache_dir=tmp_path
    )
    assert half.graph_path != full.graph_path
    again = Engine.load(tiny_models["llama"], precision="int8", cache_dir=tmp_path)
    assert again.graph_path == half.graph_path and not again.graph_built
    assert again.runtime.kv_dtype == np.float16


def test_bad_value_is_a_clear_error(tiny_models, tmp_path):
    with pytest.raises(ValueError, match="kv_cache='int8'"):
        Engine.load(tiny_models["llama"], precision="int8", kv_cache="int8", cache_dir=tmp_path)


def test_groupqueryattention_graphs_keep_float32(tiny_models):
    """Dense MatMuls have no attention op of their own: GroupQueryAttention reads float32 on CPU,
    so asking for float16 gives a float32 graph that says so."""
    from engine.config import load_config
    from engine.weights import load_weights

    path = tiny_models["llama"]
    config = load_config(path)
    weights = load_weights(path, config)
    model = build_decoder(config, weights, DenseLinear(), kv_dtype="float16")
    assert {n.op_type for n in model.graph.node} >= {"GroupQueryAttention"}
    kv_inputs = [i for i in model.graph.input if i.name.startswith("past.")]
    assert kv_inputs and all(i.type.tensor_type.elem_type == 1 for i in kv_inputs)
    meta = {p.key: p.value for p in model.metadata_props}
    assert meta["spark_lsp.kv_dtype"] == "float32"
    with pytest.raises(ValueError, match="kv_dtype"):
        build_decoder(config, weights, DenseLinear(), kv_dtype="bf16")


def _logits(eng: Engine, ids: list[int]) -> np.ndarray:
    """A 24-token prefill, then one position at a time: later runs read the cache earlier ones
    wrote."""
    kv = eng.runtime.new_kv()
    rows = [eng.runtime.forward(kv, ids[:24], 0, num_logits=24)]
    rows += [eng.runtime.forward(kv, [t], 24 + i) for i, t in enumerate(ids[24:])]
    return np.concatenate(rows, axis=0)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma", "starcoder2"])
def test_half_cache_logits_match_float32(tiny_models, tmp_path, arch):
    """With fp32 weights only the cache differs: logits within half rounding's reach (its
    relative step is 2^-11) of the float32 cache's.  With int8 weights the activations are
    quantised again in every layer, so the small change can move a code and the logits differ
    more, but far less than int8 differs from fp32, and they pick the same tokens."""
    ids = [(7 * i + 3) % 200 + 10 for i in range(40)]
    out = {}
    for precision, kv in [
        ("fp32", "float32"),
        ("fp32", "float16"),
        ("int8", "float32"),
        ("int8", "float16"),
    ]:
        eng = Engine.load(tiny_models[arch], precision=precision, kv_cache=kv, cache_dir=tmp_path)
        out[precision, kv] = _logits(eng, ids)
    full = out["fp32", "float32"]
    scale = float(np.abs(full).max())
    assert float(np.abs(out["fp32", "float16"] - full).max()) <= 5e-3 * scale
    assert (out["fp32", "float16"].argmax(-1) == full.argmax(-1)).all()
    int8_half, int8_full = out["int8", "float16"], out["int8", "float32"]
    cache_error = float(np.abs(int8_half - int8_full).max())
    assert cache_error <= 0.75 * float(np.abs(int8_full - full).max())
    assert (int8_half.argmax(-1) == int8_full.argmax(-1)).mean() >= 0.9


def test_generation_and_prefix_reuse_over_a_half_cache(tmp_path):
    """The bundled model at int8: the same greedy tokens as over a float32 cache up to a near
    tie, and a second request sharing the prompt reuses its cached prefix.  A float16 cache moves
    a logit by about 1e-3 of the largest; int8 activation codes can carry that across a rounding
    boundary, so where the float32 run's top two logits are closer than that, either token is a
    correct greedy choice (which one depends on the CPU's kernels), and the runs may part there."""
    prompt = "def fibonacci(n):\n    " * 4
    params = GenerationParams(max_new_tokens=32, ignore_eos=True)
    tokens, engines = {}, {}
    for kv in ("float16", "float32"):
        eng = Engine.load(None, precision="int8", kv_cache=kv, cache_dir=tmp_path, threads=2)
        gen = eng.generate(prompt, params, slot="doc")
        gen.result()
        tokens[kv], engines[kv] = list(gen.tokens), eng
        again = eng.generate(prompt + "return", params, slot="doc")
        again.result()
        assert again.stats["reused_tokens"] >= len(eng.encode_prompt(prompt)) - 1
    assert len(tokens["float16"]) == len(tokens["float32"]) == 32
    half, full = tokens["float16"], tokens["float32"]
    parted = next((i for i, (a, b) in enumerate(zip(half, full)) if a != b), None)
    if parted is not None:
        ids = engines["float32"].encode_prompt(prompt) + full[:parted]
        logits = engines["float32"].forward_logits(ids)[-1]
        top = np.sort(logits)[-2:]
        assert parted >= 4, (parted, half, full)
        assert top[1] - top[0] <= 5e-3 * float(np.abs(logits).max()), (parted, top)


def test_an_explicit_quantising_emitter_gets_a_half_cache(tiny_models, tmp_path):
    eng = Engine.load(tiny_models["llama"], linear=op_linear("int4"), cache_dir=tmp_path)
    assert eng.runtime.kv_dtype == np.float16


def _resident_bytes(address: int) -> int:
    """Rss of the mapping holding ``address`` (Linux: /proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and line.startswith("Rss:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="Linux /proc")
def test_a_slot_holds_the_positions_it_wrote_not_its_whole_buffer(tiny_llama):
    """A slot's KV cache is a mapping of its own whose pages stay untouched until a position is
    written: a short prompt costs its positions, not the whole buffer (on the heap, the buffer
    landed in memory earlier runs' temporaries had touched: every slot cost all of it)."""
    eng = Engine.load(tiny_llama, slots=2)
    rt = eng.runtime
    kv = rt.new_kv()
    address = kv.values[0, "key"].data_ptr()
    assert all(v.data_ptr() != address for k, v in kv.values.items() if k != (0, "key"))
    assert _resident_bytes(address) == 0
    n = 16  # positions; one page per head of each buffer holds them
    logits = rt.forward(kv, list(range(16, 16 + n)), 0)
    page = os.sysconf("SC_PAGE_SIZE")
    per_head = -(-n * rt.head_dim * rt.kv_dtype.itemsize // page) * page
    written = 2 * rt.num_layers * rt.kv_heads * per_head
    assert 0 < _resident_bytes(address) <= written < rt.kv_bytes() // 2
    # the cache is the one the graph writes and reads: a step after it continues the prompt
    want = Engine.load(tiny_llama, slots=2)
    kv2 = want.runtime.new_kv()
    whole = want.runtime.forward(kv2, list(range(16, 16 + n + 1)), 0, num_logits=2)
    np.testing.assert_allclose(rt.decode(kv, 16 + n, n), whole[-1], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(logits[-1], whole[0], rtol=1e-4, atol=1e-4)
    del kv, kv2
