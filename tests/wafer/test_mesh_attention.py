"""spark.wafer::DecoderAttention, the decoder's attention op.

Against the numpy reference (``mesh_op.reference_attention``) and against
com.microsoft::GroupQueryAttention for 1, 2, 9 and 64 new rows at several past lengths and GQA
group sizes 1, 2 and 7 (Qwen2.5-0.5B: 14 heads over 2 KV heads, head size 64); packed Q|K|V and
separate q, k, v; present bound to the past buffer (in place, as the runtime does) and a fresh one;
a rewind (a smaller seqlens_k than the last pass); the emitters' choice of op; and the bundled
model's greedy tokens with the op against its GroupQueryAttention graph."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from engine import Engine, GenerationParams
from engine.graph import build_decoder
from engine.linears import make_linear
from engine.wafer import mesh_op

SHAPES = [(8, 4, 32), (14, 2, 64), (7, 1, 16)]  # (heads, kv_heads, H): groups of 2, 7, 7


@pytest.fixture(scope="module", autouse=True)
def _op_built():
    if not mesh_op.attention():  # CI has a compiler; say why if this machine does not
        pytest.fail(f"DecoderAttention unavailable: {mesh_op.why_not()}")


def _session(heads, kv_heads, H, op=mesh_op.ATTN_OP, split=False, threads=2):
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    if op == mesh_op.ATTN_OP:
        so.register_custom_ops_library(mesh_op.library())
    model = mesh_op.attention_model(heads, kv_heads, H, H**-0.5, op=op, split=split)
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _feeds(x, pk, pv, past, cos, sin, split=False, heads=0, kv_heads=0):
    f = mesh_op.attention_feeds(x, pk, pv, past, cos, sin)
    if split:
        H = pk.shape[-1]
        q, k, v = np.split(f.pop("x"), [heads * H, (heads + kv_heads) * H], axis=-1)
        f.update(q=np.ascontiguousarray(q), k=np.ascontiguousarray(k), v=np.ascontiguousarray(v))
    return f


def _close(got, want, T, tol=2e-5):
    attn, pk, pv = got
    assert np.abs(attn - want[0]).max() <= tol
    assert np.abs(pk[:, :, :T] - want[1][:, :, :T]).max() <= tol
    assert np.abs(pv[:, :, :T] - want[2][:, :, :T]).max() <= tol


@pytest.mark.parametrize("heads,kv_heads,H", SHAPES)
@pytest.mark.parametrize("S", [1, 2, 9, 64])
@pytest.mark.parametrize("past", [0, 5, 300])
@pytest.mark.parametrize("split", [False, True])
def test_matches_numpy_and_gqa(heads, kv_heads, H, S, past, split):
    x, pk, pv, cos, sin = mesh_op.attention_inputs(S, past, heads, kv_heads, H, 400, seed=S + past)
    feeds = _feeds(x, pk, pv, past, cos, sin, split, heads, kv_heads)
    got = _session(heads, kv_heads, H, split=split).run(None, feeds)
    want = mesh_op.reference_attention(x, pk, pv, past, cos, sin, heads, kv_heads, H**-0.5)
    _close(got, want, past + S)
    gqa = _session(heads, kv_heads, H, op="GroupQueryAttention", split=split).run(None, feeds)
    _close(got, gqa, past + S)
    # positions past the new rows are the fresh buffer's: only [0, past + S) is the cache
    assert got[0].shape == (1, S, heads * H)


@pytest.mark.parametrize("heads,kv_heads,H", SHAPES)
def test_in_place_and_rewind(heads, kv_heads, H):
    """Present bound to the past OrtValue (the runtime's KVBuffers): a prefill, decode steps, a
    rewind to an earlier length and a 9-row pass from there, each against numpy on a copy."""
    max_len = 96
    sess = _session(heads, kv_heads, H)
    _, pk, pv, cos, sin = mesh_op.attention_inputs(1, 0, heads, kv_heads, H, max_len)
    ref_k, ref_v = pk.copy(), pv.copy()
    k_val, v_val = ort.OrtValue.ortvalue_from_numpy(pk), ort.OrtValue.ortvalue_from_numpy(pv)
    rng = np.random.default_rng(1)
    for past, S in [(0, 20), (20, 1), (21, 1), (22, 9), (13, 9), (22, 1), (5, 64)]:
        x = rng.standard_normal((1, S, (heads + 2 * kv_heads) * H)).astype(np.float32)
        binding = sess.io_binding()
        binding.bind_output("attn")
        for name, value in _feeds(x, pk, pv, past, cos, sin).items():
            if not name.startswith("past"):
                binding.bind_cpu_input(name, value)
        binding.bind_ortvalue_input("past_key", k_val)
        binding.bind_ortvalue_input("past_value", v_val)
        binding.bind_ortvalue_output("present_key", k_val)
        binding.bind_ortvalue_output("present_value", v_val)
        sess.run_with_iobinding(binding)
        attn = binding.copy_outputs_to_cpu()[0]
        want = mesh_op.reference_attention(
            x, ref_k, ref_v, past, cos, sin, heads, kv_heads, H**-0.5
        )
        ref_k, ref_v = want[1], want[2]
        T = past + S
        _close((attn, k_val.numpy(), v_val.numpy()), want, T)


def test_bad_inputs_give_clear_errors():
    heads, kv_heads, H = 4, 2, 16
    sess = _session(heads, kv_heads, H, threads=1)
    x, pk, pv, cos, sin = mesh_op.attention_inputs(3, 10, heads, kv_heads, H, 12)
    feeds = _feeds(x, pk, pv, 10, cos, sin)  # past + S = 13 > max_len 12
    with pytest.raises(Exception, match="seqlens_k"):
        sess.run(None, feeds)
    feeds = _feeds(x[..., :-1], pk, pv, 0, cos, sin)
    with pytest.raises(Exception, match="qkv must be float"):
        sess.run(None, feeds)


def test_emitters_choose_the_op_and_fall_back_to_gqa(tiny_models, monkeypatch):
    """The op form of the wafer emitters (float and quantised) emits DecoderAttention; dense
    graphs and an unavailable op keep GroupQueryAttention."""
    from engine.config import load_config
    from engine.weights import load_weights

    path = tiny_models["llama"]
    config, weights = load_config(path), None
    weights = load_weights(path, config)

    def attention_ops(linear):
        model = build_decoder(config, weights, linear, max_len=32)
        return {n.op_type for n in model.graph.node} & {"GroupQueryAttention", mesh_op.ATTN_OP}

    for precision in ("fp32", "int8", "int4"):
        assert attention_ops(make_linear(precision, grid=(2, 2))) == {mesh_op.ATTN_OP}
    assert attention_ops(make_linear("fp32", wafer=False)) == {"GroupQueryAttention"}
    monkeypatch.setattr(mesh_op, "attention", lambda: False)
    assert attention_ops(make_linear("int4", grid=(2, 2))) == {"GroupQueryAttention"}


class _WithGQA:
    """An emitter as given, but without its attention op (and its own graph cache key)."""

    def __init__(self, inner):
        self._inner = inner

    def cache_key(self) -> str:
        return self._inner.cache_key() + "-gqa"

    def __getattr__(self, name):
        if name == "emit_attention":
            raise AttributeError(name)
        return getattr(self._inner, name)


@pytest.mark.parametrize("precision", ["fp32", "int4"])
def test_bundled_model_greedy_tokens_unchanged(precision, tmp_path):
    """Prefill, decode steps and (int4) speculative verification passes with the op give the
    tokens the GroupQueryAttention graph gives on the bundled model."""
    prompt = "def fibonacci(n):\n    " * 6
    tokens = {}
    for kind in ("op", "gqa"):
        linear = make_linear(precision, grid=None)
        engine = Engine.load(
            None, linear=linear if kind == "op" else _WithGQA(linear), cache_dir=tmp_path, threads=2
        )
        gen = engine.generate(prompt, GenerationParams(max_new_tokens=48, ignore_eos=True))
        gen.result()
        tokens[kind] = gen.tokens
    assert tokens["op"] == tokens["gqa"]
