"""config.json parsing: the three architectures, rope variants, and errors naming file and field."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
from tiny_models import require_reference

from engine.config import ModelError, load_config


def write_config(tmp_path, **over):
    base = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 100,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 256,
        "eos_token_id": 2,
        "bos_token_id": 1,
    }
    base.update(over)
    base = {k: v for k, v in base.items() if v is not ...}
    (tmp_path / "config.json").write_text(json.dumps(base))
    return tmp_path


def test_tiny_models_parse(tiny_llama, tiny_qwen2, tiny_mistral):
    llama, qwen, mistral = (
        load_config(tiny_llama),
        load_config(tiny_qwen2),
        load_config(tiny_mistral),
    )
    assert (llama.architecture, qwen.architecture, mistral.architecture) == (
        "llama",
        "qwen2",
        "mistral",
    )
    assert llama.tie_word_embeddings and not qwen.tie_word_embeddings
    assert qwen.attention_bias and not llama.attention_bias and not mistral.attention_bias
    assert (mistral.num_attention_heads, mistral.num_key_value_heads, mistral.head_dim) == (8, 2, 8)
    assert mistral.num_kv_groups == 4
    assert qwen.rope_theta == 1_000_000.0  # transformers 5 writes it under rope_parameters
    assert llama.eos_token_ids == (0,) and llama.torch_dtype == "float32"
    d = llama.to_dict()
    assert json.loads(json.dumps(d)) == d and d["eos_token_ids"] == [0]
    hash(llama)  # usable as a cache key


def test_legacy_fields_and_defaults(tmp_path):
    cfg = load_config(
        write_config(tmp_path, num_key_value_heads=..., torch_dtype="bfloat16", eos_token_id=[2, 3])
    )
    assert cfg.num_key_value_heads == 4 and cfg.head_dim == 8
    assert cfg.torch_dtype == "bfloat16" and cfg.eos_token_ids == (2, 3) and cfg.bos_token_id == 1


def test_generation_config_eos_merged(tmp_path):
    write_config(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert load_config(tmp_path).eos_token_ids == (2, 7)


@pytest.mark.parametrize(
    "over, needle",
    [
        (
            {"architectures": ["GPT2LMHeadModel"]},
            "architectures='GPT2LMHeadModel' is not supported; supported: LlamaForCausalLM",
        ),
        ({"architectures": ...}, "'architectures' is missing"),
        (
            {"num_key_value_heads": 3},
            "config.json: num_key_value_heads=3 must divide num_attention_heads=4",
        ),
        ({"hidden_size": 30}, "num_attention_heads=4 must divide hidden_size=30"),
        ({"vocab_size": 0}, "config.json: vocab_size=0 must be a positive integer"),
        ({"num_hidden_layers": -1}, "num_hidden_layers=-1 must be a positive integer"),
        ({"hidden_size": "big"}, "config.json: hidden_size='big' must be of type int"),
        ({"intermediate_size": ...}, "required field 'intermediate_size' is missing"),
        ({"hidden_act": "relu"}, "config.json: hidden_act='relu' is not supported"),
        ({"rms_norm_eps": 0}, "config.json: rms_norm_eps=0.0 must be positive"),
        ({"rope_theta": -1}, "config.json: rope_theta=-1 must be a positive number"),
        (
            {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
            "rope_scaling type 'yarn' is not supported",
        ),
        (
            {"rope_scaling": {"type": "linear", "factor": 0}},
            "rope_scaling.factor=0 must be a positive number",
        ),
        ({"eos_token_id": 500}, "eos_token_id=500 is outside vocab_size=100"),
        ({"dtype": "int8"}, "config.json: dtype='int8' is not supported"),
        ({"mlp_bias": "yes"}, "config.json: mlp_bias='yes' must be of type bool"),
        ({"head_dim": 7}, "head_dim=7 must be even"),
    ],
)
def test_bad_fields_are_named(tmp_path, over, needle):
    with pytest.raises(ModelError) as e:
        load_config(write_config(tmp_path, **over))
    assert needle in str(e.value)


def test_missing_and_corrupt_files(tmp_path):
    with pytest.raises(ModelError, match="model folder not found"):
        load_config(tmp_path / "nope")
    with pytest.raises(ModelError, match=r"config.json: file not found"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text('{"architectures": [')
    with pytest.raises(ModelError, match=r"config.json: invalid JSON at line 1"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ModelError, match="expected a JSON object"):
        load_config(tmp_path)
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ModelError, match="not a folder"):
        load_config(f)


def test_mistral_sliding_window_limits_context(tmp_path):
    write_config(tmp_path, architectures=["MistralForCausalLM"], sliding_window=128)
    with pytest.warns(UserWarning, match="sliding_window=128 < max_position_embeddings=256"):
        cfg = load_config(tmp_path)
    assert cfg.max_position_embeddings == 128 and cfg.sliding_window == 128
    write_config(tmp_path, architectures=["MistralForCausalLM"], sliding_window=4096)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_config(tmp_path).max_position_embeddings == 256


def test_qwen2_sliding_window_ignored_unless_enabled(tmp_path):
    write_config(
        tmp_path, architectures=["Qwen2ForCausalLM"], sliding_window=64, use_sliding_window=False
    )
    cfg = load_config(tmp_path)
    assert cfg.sliding_window is None and cfg.attention_bias and not cfg.attention_out_bias


def test_llama_attention_bias_includes_o_proj(tmp_path):
    cfg = load_config(write_config(tmp_path, attention_bias=True))
    assert cfg.attention_bias and cfg.attention_out_bias


def test_rope_inv_freq_matches_transformers(tmp_path):
    require_reference()
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cases = [
        None,
        {"rope_type": "linear", "factor": 2.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ]
    for rs in cases:
        cfg = load_config(write_config(tmp_path, head_dim=32, rope_scaling=rs))
        ref_cfg = LlamaConfig(
            vocab_size=100,
            hidden_size=32,
            num_attention_heads=4,
            head_dim=32,
            max_position_embeddings=256,
            rope_theta=10000.0,
            rope_scaling=rs,
        )
        kind = (rs or {}).get("rope_type", "default")
        if kind == "default":
            ours = cfg.rope_inv_freq()
            ref = 1.0 / 10000.0 ** (np.arange(0, 32, 2) / 32)
        else:
            ref = ROPE_INIT_FUNCTIONS[kind](ref_cfg, "cpu")[0].double().numpy()
            ours = cfg.rope_inv_freq()
        np.testing.assert_allclose(ours, ref, rtol=1e-6)


def test_family_fields(tiny_models):
    """What each architecture asks of the graph, read from transformers' own config.json files."""
    got = {a: load_config(p) for a, p in tiny_models.items()}
    assert (got["llama"].norm, got["llama"].mlp_act, got["llama"].mlp_gated) == (
        "rms",
        "silu",
        True,
    )
    assert got["qwen3"].qk_norm and got["qwen3"].head_dim == 24 and not got["qwen3"].attention_bias
    sc = got["starcoder2"]
    assert (sc.norm, sc.mlp_act, sc.mlp_gated, sc.mlp_bias) == ("layer", "gelu_tanh", False, True)
    assert (
        sc.attention_bias
        and sc.attention_out_bias
        and sc.tie_word_embeddings
        and sc.rms_norm_eps == 1e-5
    )
    gm = got["gemma"]
    assert (gm.norm, gm.mlp_act, gm.embed_scale) == ("rms_offset", "gelu_tanh", 8.0)
    assert not any(c.qk_norm for a, c in got.items() if a != "qwen3")


def test_gemma_legacy_gelu_is_the_tanh_approximation(tmp_path):
    """CodeGemma's config.json says hidden_act 'gelu'; transformers reads it as gelu_pytorch_tanh."""
    cfg = load_config(write_config(tmp_path, architectures=["GemmaForCausalLM"], hidden_act="gelu"))
    assert cfg.mlp_act == "gelu_tanh" and cfg.tie_word_embeddings
