"""Building a graph streams its weights: tensors read on access, initializers written to the
external data file as they are emitted, so a model's build holds about one tensor in memory."""

from __future__ import annotations

import json
import tracemalloc

import numpy as np
import onnx
import pytest
from engine_helpers import assert_same_table, runtime_table
from onnx import numpy_helper

from engine import quant
from engine.config import load_config
from engine.graph import DenseLinear, build_decoder
from engine.quant import QuantLinear
from engine.wafer.partition import TiledLinear
from engine.weights import load_weights, open_weights, save_safetensors


def _emitter(kind: str):
    return {
        "dense": DenseLinear,
        "int4": lambda: QuantLinear(4),
        "int8-tiled": lambda: QuantLinear(8, TiledLinear()),
        "tiled": lambda: TiledLinear(form="graph"),
    }[kind]()


def _arrays(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("kind", ["dense", "int4", "int8-tiled", "tiled"])
def test_streamed_build_equals_in_memory(tiny_models, tmp_path, arch, kind):
    """Same nodes, same initializers (bit for bit), whether built in memory or streamed to disk."""
    folder = tiny_models[arch]
    cfg = load_config(folder)
    ref = build_decoder(cfg, load_weights(folder, cfg), _emitter(kind), max_len=64)
    data = tmp_path / "model.onnx.data"
    with open_weights(folder, cfg) as w:
        streamed = build_decoder(cfg, w, _emitter(kind), max_len=64, external_data=data)
    assert data.stat().st_size > 0
    external = [
        t for t in streamed.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL
    ]
    assert external and all(not t.HasField("raw_data") for t in external)
    assert all(
        int(next(e.value for e in t.external_data if e.key == "offset")) % 4096 == 0
        for t in external
    )
    onnx.save_model(streamed, str(tmp_path / "model.onnx"))
    loaded = onnx.load(str(tmp_path / "model.onnx"))
    ops, want = [n.op_type for n in ref.graph.node], _arrays(ref)
    if runtime_table(loaded, data) is not None:
        # the table only a Gather read lies in the data file, outside the graph (engine.embedding)
        assert_same_table(loaded, data, ref)
        ops.remove("Gather")
        del want["embed_tokens"]
    assert [n.op_type for n in loaded.graph.node] == ops
    got = _arrays(loaded)
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def _deep_model(folder, layers: int = 24, hidden: int = 128, vocab: int = 4096):
    folder.mkdir()
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": 3 * hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": vocab,
        "max_position_embeddings": 64,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "eos_token_id": 0,
        "torch_dtype": "bfloat16",
    }
    (folder / "config.json").write_text(json.dumps(cfg))
    rng = np.random.default_rng(0)
    shapes = {
        "model.embed_tokens.weight": (vocab, hidden),
        "lm_head.weight": (vocab, hidden),
        "model.norm.weight": (hidden,),
    }
    for n in range(layers):
        p = f"model.layers.{n}."
        shapes.update(
            {
                p + "input_layernorm.weight": (hidden,),
                p + "post_attention_layernorm.weight": (hidden,),
                p + "self_attn.q_proj.weight": (hidden, hidden),
                p + "self_attn.k_proj.weight": (hidden // 2, hidden),
                p + "self_attn.v_proj.weight": (hidden // 2, hidden),
                p + "self_attn.o_proj.weight": (hidden, hidden),
                p + "mlp.gate_proj.weight": (3 * hidden, hidden),
                p + "mlp.up_proj.weight": (3 * hidden, hidden),
                p + "mlp.down_proj.weight": (hidden, 3 * hidden),
            }
        )
    save_safetensors(
        folder / "model.safetensors",
        {k: rng.standard_normal(s).astype(np.float32) * 0.05 for k, s in shapes.items()},
        dtype="BF16",
    )
    return load_config(folder), sum(int(np.prod(s)) * 4 for s in shapes.values())


@pytest.mark.parametrize("kind", ["dense", "int4"])
def test_streamed_build_holds_a_tensor_not_the_model(tmp_path, monkeypatch, kind):
    """Peak Python/numpy memory of a streamed build is a fraction of the model's float32 bytes
    (building in memory needs all of them, plus the graph's copy).  The quantiser's chunk is
    scaled down with the model (at real size it is a small fraction of one tensor)."""
    monkeypatch.setattr(quant, "QUANT_CHUNK", 1 << 15)
    cfg, f32_bytes = _deep_model(tmp_path / "m")
    tracemalloc.start()
    try:
        with open_weights(tmp_path / "m", cfg) as w:
            build_decoder(
                cfg, w, _emitter(kind), max_len=64, external_data=tmp_path / "model.onnx.data"
            )
        _, streamed_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        build_decoder(cfg, load_weights(tmp_path / "m", cfg), _emitter(kind), max_len=64)
        _, memory_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert memory_peak > f32_bytes
    assert streamed_peak < 0.4 * f32_bytes, (streamed_peak, f32_bytes)
