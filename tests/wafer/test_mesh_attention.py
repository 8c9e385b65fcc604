"""spark.wafer::DecoderAttention, the decoder's attention op.

Against the numpy reference (``mesh_op.reference_attention``) and against
com.microsoft::GroupQueryAttention for 1, 2, 9 and 64 new rows at several past lengths and GQA
group sizes 1, 2 and 7 (Qwen2.5-0.5B: 14 heads over 2 KV heads, head size 64); packed Q|K|V and
separate q, k, v; present bound to the past buffer (in place, as the runtime does) and a fresh one;
a rewind (a smaller seqlens_k than the last pass); the emitters' choice of op; and the bundled
model's greedy tokens with the op against its GroupQueryAttention graph.  A float16 cache: the
same checks against numpy on the rounded cache, the new rows rounded to nearest even exactly as
numpy rounds (ties, subnormals, overflow), and a model built with one."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from op_forms import op_linear

from engine import Engine, GenerationParams
from engine.graph import build_decoder
from engine.linears import make_linear
from engine.wafer import mesh_op

SHAPES = [(8, 4, 32), (14, 2, 64), (7, 1, 16)]  # (heads, kv_heads, H): groups of 2, 7, 7


@pytest.fixture(scope="module", autouse=True)
def _op_built():
    if not mesh_op.attention():  # CI has a compiler; say why if this machine does not
        pytest.fail(f"DecoderAttention unavailable: {mesh_op.why_not()}")


def _session(heads, kv_heads, H, op=mesh_op.ATTN_OP, split=False, threads=2, kv_dtype="float32"):
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    if op == mesh_op.ATTN_OP:
        so.register_custom_ops_library(mesh_op.library())
    model = mesh_op.attention_model(
        heads, kv_heads, H, H**-0.5, op=op, split=split, kv_dtype=kv_dtype
    )
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _feeds(x, pk, pv, past, cos, sin, split=False, heads=0, kv_heads=0):
    f = mesh_op.attention_feeds(x, pk, pv, past, cos, sin)
    if split:
        H = pk.shape[-1]
        q, k, v = np.split(f.pop("x"), [heads * H, (heads + kv_heads) * H], axis=-1)
        f.update(q=np.ascontiguousarray(q), k=np.ascontiguousarray(k), v=np.ascontiguousarray(v))
    return f


def _close(got, want, T, tol=2e-5):
    """Attention within ``tol``; a float32 cache's rows too, a float16 cache's values exactly
    and its keys within one half-float unit (the op rounds its float32 rotation, numpy its
    float64 one, so a key near a rounding boundary can go either way)."""
    attn, pk, pv = got
    assert np.abs(attn - want[0]).max() <= tol
    if pk.dtype == np.float16:
        assert want[1].dtype == want[2].dtype == pv.dtype == np.float16
        assert np.array_equal(pv[:, :, :T], want[2][:, :, :T])
        k, wk = pk[:, :, :T].astype(np.float64), want[1][:, :, :T].astype(np.float64)
        ulp = np.spacing(np.abs(want[1][:, :, :T])).astype(np.float64)
        assert (np.abs(k - wk) <= ulp).all()
        assert (k != wk).mean() < 0.01
        return
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
@pytest.mark.parametrize("S", [1, 2, 9, 64])
@pytest.mark.parametrize("past", [0, 5, 300])
def test_half_cache_matches_numpy(heads, kv_heads, H, S, past):
    """A float16 cache: the op reads the rounded past rows, writes the new ones rounded, and
    attends over the rounded values, as numpy does on the same cache."""
    x, pk, pv, cos, sin = mesh_op.attention_inputs(
        S, past, heads, kv_heads, H, 400, seed=S + past, kv_dtype="float16"
    )
    feeds = _feeds(x, pk, pv, past, cos, sin)
    got = _session(heads, kv_heads, H, kv_dtype="float16").run(None, feeds)
    assert got[1].dtype == got[2].dtype == np.float16
    want = mesh_op.reference_attention(x, pk, pv, past, cos, sin, heads, kv_heads, H**-0.5)
    _close(got, want, past + S, tol=1e-3)  # the caches; attention again below, on the op's cache
    on_ops = mesh_op.reference_attention(
        x, pk, pv, past, cos, sin, heads, kv_heads, H**-0.5, written=(got[1], got[2])
    )
    assert np.abs(got[0] - on_ops[0]).max() <= 2e-5
    # the cached rows before the new ones are the past buffer's (a fresh present: copied)
    assert np.array_equal(got[1][:, :, :past], pk[:, :, :past])


#: float32 values whose half rounding is easy to get wrong: ties to even up and down, the largest
#: finite half and the first value that overflows, subnormals and their ties, signed zeros,
#: infinities and NaN.
ROUNDING = np.array(
    [1 + 2**-11, 1 + 3 * 2**-11, 1 + 2**-11 + 2**-20, 2048 + 1, 2048 + 3, 65504, 65519.996,
     65520, 1e6, 2**-14, 2**-14 - 2**-26, 2**-24, 2**-25, 1.5 * 2**-25, 2**-26, 3 * 2**-25,
     5 * 2**-25, 1e-30, 0.0, -0.0, -(1 + 2**-11), -65520, np.inf, -np.inf, np.nan, 0.1, -3.14159,
     1 / 3],
    np.float32,
)  # fmt: skip


def half_rounding_matches_numpy(session) -> None:
    """Write :data:`ROUNDING` as value rows through ``session`` (a one-node half-cache model,
    1 kv head, H 16) and check the cached halves are numpy's float32 -> float16, bit for bit."""
    heads, kv_heads, H = 1, 1, 16
    vals = np.resize(ROUNDING, ((len(ROUNDING) + H - 1) // H) * H).reshape(-1, H)
    S = len(vals)
    x, pk, pv, cos, sin = mesh_op.attention_inputs(S, 0, heads, kv_heads, H, S, kv_dtype="float16")
    x[0, :, 2 * H :] = vals  # the V part of each packed Q|K|V row
    x[0, :, : 2 * H] = 0.0  # q and k zero: uniform attention, no overflow in the scores
    _, _, present_v = session.run(None, _feeds(x, pk, pv, 0, cos, sin))
    with np.errstate(over="ignore"):  # 65520 and 1e6 overflow to infinity, as they should
        want = vals.astype(np.float16)
    assert np.array_equal(present_v[0, 0].view(np.uint16), want.view(np.uint16))


def test_half_rounding_matches_numpy():
    half_rounding_matches_numpy(_session(1, 1, 16, threads=1, kv_dtype="float16"))


@pytest.mark.parametrize("heads,kv_heads,H", SHAPES)
@pytest.mark.parametrize("kv_dtype", ["float32", "float16"])
def test_in_place_and_rewind(heads, kv_heads, H, kv_dtype):
    in_place_and_rewind(heads, kv_heads, H, kv_dtype)


def in_place_and_rewind(heads, kv_heads, H, kv_dtype):
    """Present bound to the past OrtValue (the runtime's KVBuffers): a prefill, decode steps, a
    rewind to an earlier length and a 9-row pass from there, each against numpy on a copy."""
    max_len = 96
    sess = _session(heads, kv_heads, H, kv_dtype=kv_dtype)
    _, pk, pv, cos, sin = mesh_op.attention_inputs(
        1, 0, heads, kv_heads, H, max_len, kv_dtype=kv_dtype
    )
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
        if kv_dtype == "float16":  # a key may round one unit the other way: go on from the op's
            _close((attn, k_val.numpy(), v_val.numpy()), want, T, tol=1e-3)
            ref_k = k_val.numpy().copy()
            written = (ref_k, v_val.numpy().copy())
            want = mesh_op.reference_attention(
                x, ref_k, ref_v, past, cos, sin, heads, kv_heads, H**-0.5, written=written
            )
        _close((attn, k_val.numpy(), v_val.numpy()), want, T)


@pytest.mark.parametrize("heads,kv_heads,H", [*SHAPES, (4, 2, 128), (12, 2, 64), (5, 1, 32)])
@pytest.mark.parametrize("kv_dtype", ["float32", "float16"])
def test_a_pass_gives_each_row_its_single_steps_numbers(heads, kv_heads, H, kv_dtype):
    """A 9-row pass (speculative verification) and the same rows one step at a time give
    the same attention outputs bit for bit, whatever the group size: a row's scores, softmax and
    value sums do not depend on the other rows of its pass."""
    sess = _session(heads, kv_heads, H, kv_dtype=kv_dtype)
    S, past = 9, 300
    x, pk, pv, cos, sin = mesh_op.attention_inputs(
        S, past, heads, kv_heads, H, 400, seed=5, kv_dtype=kv_dtype
    )
    wide, _, _ = sess.run(None, _feeds(x, pk, pv, past, cos, sin))
    steps = []
    for i in range(S):
        attn, pk, pv = sess.run(None, _feeds(x[:, i : i + 1], pk, pv, past + i, cos, sin))
        steps.append(attn)
    assert np.array_equal(np.concatenate(steps, axis=1), wide)


@pytest.mark.parametrize("precision", ["fp32", "int8", "int4"])
def test_a_models_pass_gives_its_steps_logits(precision, tmp_path, monkeypatch):
    """Qwen2.5-Coder-0.5B's attention groups (14 query heads over 2 KV heads: 7 a group) in a
    small random model: a 9-row pass (a speculative verification; AMX where the CPU has it)
    gives the logits of 9 single decode steps bit for bit, so verifying drafted tokens accepts
    exactly what decoding them one by one would have produced."""
    from engine.lab import models as lab_models

    shape = dict(lab_models.SYNTHETIC["synthetic-8m"], hidden_size=224, intermediate_size=448)
    shape.update(num_attention_heads=14, num_key_value_heads=2, num_hidden_layers=2, vocab_size=512)
    monkeypatch.setitem(lab_models.SYNTHETIC, "synthetic-gqa7", shape)
    folder = lab_models.synthetic_model("synthetic-gqa7", root=tmp_path)
    rt = Engine.load(folder, linear=op_linear(precision), cache_dir=tmp_path, threads=2).runtime
    ids = [(7 * i + 3) % 500 + 10 for i in range(59)]
    kv = rt.new_kv()
    rt.forward(kv, ids[:50], 0)
    wide = rt.forward(kv, ids[50:], 50, num_logits=9)
    steps = np.concatenate([rt.forward(kv, [t], 50 + i) for i, t in enumerate(ids[50:])])
    assert np.array_equal(wide, steps)


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
        assert attention_ops(op_linear(precision, grid=(2, 2))) == {mesh_op.ATTN_OP}
    assert attention_ops(make_linear("fp32", wafer=False)) == {"GroupQueryAttention"}
    monkeypatch.setattr(mesh_op, "attention", lambda: False)
    assert attention_ops(op_linear("int4", grid=(2, 2))) == {"GroupQueryAttention"}


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
