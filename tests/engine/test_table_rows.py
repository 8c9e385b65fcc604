"""Vocabulary-sized tensors are read a slice of rows at a time (engine.weights.TensorRows): the
embedding table's conversion and a tied LM head's quantisation never hold the float32 table whole,
which was the peak of a first (graph-building) load, and they give the same graph bit for bit."""

from __future__ import annotations

import json
import tracemalloc

import numpy as np
import onnx
import pytest
from engine_helpers import assert_same_table
from onnx import numpy_helper

from engine import graph as graph_mod
from engine import quant
from engine.config import ModelError, load_config
from engine.graph import build_decoder
from engine.linears import make_linear
from engine.weights import LazyColumns, load_weights, open_weights, save_safetensors


def _table_model(folder, vocab: int, hidden: int = 64, dtype: str = "BF16"):
    """A two-layer tied model whose embedding table is most of its weights (as at 0.5B)."""
    folder.mkdir()
    cfg = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": vocab,
        "max_position_embeddings": 64,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "eos_token_id": 0,
        "torch_dtype": "bfloat16",
    }
    (folder / "config.json").write_text(json.dumps(cfg))
    rng = np.random.default_rng(7)
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    kv = hidden // 2
    for n in range(2):
        p = f"model.layers.{n}."
        shapes.update(
            {
                p + "input_layernorm.weight": (hidden,),
                p + "post_attention_layernorm.weight": (hidden,),
                p + "self_attn.q_proj.weight": (hidden, hidden),
                p + "self_attn.q_proj.bias": (hidden,),
                p + "self_attn.k_proj.weight": (kv, hidden),
                p + "self_attn.k_proj.bias": (kv,),
                p + "self_attn.v_proj.weight": (kv, hidden),
                p + "self_attn.v_proj.bias": (kv,),
                p + "self_attn.o_proj.weight": (hidden, hidden),
                p + "mlp.gate_proj.weight": (2 * hidden, hidden),
                p + "mlp.up_proj.weight": (2 * hidden, hidden),
                p + "mlp.down_proj.weight": (hidden, 2 * hidden),
            }
        )
    tensors = {k: rng.standard_normal(s).astype(np.float32) * 0.05 for k, s in shapes.items()}
    save_safetensors(folder / "model.safetensors", tensors, dtype=dtype)
    return load_config(folder), vocab * hidden * 4


@pytest.mark.parametrize("dtype", ["BF16", "F16", "F32"])
def test_rows_read_what_the_whole_tensor_holds(tmp_path, dtype):
    cfg, _ = _table_model(tmp_path / "m", vocab=1000, dtype=dtype)
    key = "model.embed_tokens.weight"
    with open_weights(tmp_path / "m", cfg) as w:
        whole, rows = w[key], w.rows(key)
        assert rows.shape == whole.shape and len(rows) == 1000
        for a, b in [(0, 1), (0, 1000), (17, 333), (999, 1000), (998, 5000), (500, 500)]:
            np.testing.assert_array_equal(rows[a:b], whole[a:b])
        np.testing.assert_array_equal(np.asarray(rows), whole)
        head = w.rows("lm_head.weight").T  # tied: the alias reads the table
        assert isinstance(head, LazyColumns) and head.shape == (64, 1000)
        np.testing.assert_array_equal(head[:, 100:260], whole.T[:, 100:260])
        np.testing.assert_array_equal(head[16:48][:, 5:9], whole.T[16:48, 5:9])
        np.testing.assert_array_equal(head[16:48][8:24][:, :], whole.T[24:40])
        np.testing.assert_array_equal(np.asarray(head[32:]), whole.T[32:])
        with pytest.raises(ValueError):
            rows[::2]
        with pytest.raises(TypeError):
            head[3]


def test_a_non_finite_value_in_the_rows_read_is_refused(tmp_path):
    cfg, _ = _table_model(tmp_path / "m", vocab=1000, dtype="F32")
    path = tmp_path / "m" / "model.safetensors"
    raw = bytearray(path.read_bytes())
    header = 8 + int.from_bytes(raw[:8], "little")
    meta = json.loads(raw[8:header])["model.embed_tokens.weight"]
    start = header + meta["data_offsets"][0] + (900 * 64 + 3) * 4  # row 900
    raw[start : start + 4] = np.array([np.nan], np.float32).tobytes()
    path.write_bytes(bytes(raw))
    with open_weights(tmp_path / "m", cfg) as w:
        rows = w.rows("model.embed_tokens.weight")
        assert np.isfinite(rows[0:899]).all()  # rows before the damage read fine
        with pytest.raises(ModelError, match="NaN or infinite"):
            rows[850:950]


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("bits", [4, 8])
def test_a_lazy_weight_quantises_to_the_same_codes(tmp_path, bits, threads, monkeypatch):
    """A lazy weight reads its columns a chunk at a time, one reader at a time however many
    threads quantise: the codes of the eager weight."""
    monkeypatch.setattr(quant, "QUANT_CHUNK", 1 << 14)  # several column chunks
    monkeypatch.setenv("SPARK_LSP_BUILD_THREADS", str(threads))
    cfg, _ = _table_model(tmp_path / "m", vocab=3000)
    with open_weights(tmp_path / "m", cfg) as w:
        lazy = w.rows("lm_head.weight").T
        eager = w["lm_head.weight"].T
        a = quant.quantize_blockwise(lazy, bits, 32)
        b = quant.quantize_blockwise(eager, bits, 32)
    for f in ("packed", "scales", "zero_points"):
        np.testing.assert_array_equal(getattr(a, f), getattr(b, f), err_msg=f)


def _arrays(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


@pytest.mark.parametrize("precision", ["int4", "int8", "fp32"])
def test_a_tied_model_builds_without_its_float32_table_whole(tmp_path, monkeypatch, precision):
    """The first load's peak: the streamed build of a table-heavy tied model holds well under one
    float32 copy of its table (before, it read the table whole twice: once to store the Gather's
    table, once to quantise the head), and gives the graph an in-memory build gives."""
    monkeypatch.setattr(quant, "QUANT_CHUNK", 1 << 15)
    monkeypatch.setattr(graph_mod, "_TABLE_CHUNK", 1024)
    cfg, table_bytes = _table_model(tmp_path / "m", vocab=32768)
    tracemalloc.start()
    try:
        with open_weights(tmp_path / "m", cfg) as w:
            streamed = build_decoder(
                cfg,
                w,
                make_linear(precision),
                max_len=64,
                external_data=tmp_path / "model.onnx.data",
            )
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    if precision != "fp32":  # fp32's tied head reads the float32 table in place: it is stored
        assert peak < 0.75 * table_bytes, (peak, table_bytes)  # was 1.5x the table
    onnx.save_model(streamed, str(tmp_path / "model.onnx"))
    got = _arrays(onnx.load(str(tmp_path / "model.onnx")))
    eager = load_weights(tmp_path / "m", cfg)  # a plain dict: every tensor whole
    ref = build_decoder(cfg, eager, make_linear(precision), max_len=64)
    want = _arrays(ref)
    if precision != "fp32":  # the table only a Gather read is left to the runtime
        assert_same_table(streamed, tmp_path / "model.onnx.data", ref)
        del want["embed_tokens"]
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
