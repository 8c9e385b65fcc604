"""Models for measuring: a named synthetic reference model, a folder, or the bundled default.

``synthetic-8m`` names a reference model: a random-initialised fp32 Llama (d=256, 4 layers,
d_ff=768, vocab 8192, untied: ~7.6M parameters) written with numpy into a cache folder, so a
benchmark can run on a fixed shape without a trained model.
"""

from __future__ import annotations

import json
import os
import shutil
import sysconfig
from pathlib import Path

import numpy as np

from .. import hub
from ..models import default_model_dir
from ..weights import save_safetensors

SYNTHETIC = {
    "synthetic-8m": dict(
        hidden_size=256,
        num_hidden_layers=4,
        intermediate_size=768,
        vocab_size=8192,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=2048,
    )
}
_SYNTHETIC_VERSION = 1


def bench_root() -> Path:
    """``$SPARK_LSP_CACHE/bench`` or ``~/.cache/spark-lsp/bench`` (synthetic models, peer builds)."""
    env = os.environ.get("SPARK_LSP_CACHE")
    root = Path(env).expanduser() if env else Path.home() / ".cache" / "spark-lsp"
    return root / "bench"


def _synthetic_tokenizer(vocab_size: int):
    """A byte-level BPE trained on Python stdlib source (the model is random; the vocab just has to exist)."""
    from tokenizers import (  # (build time only)
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        trainers,
    )

    lib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(lib.glob("*.py"))[:120]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(
        (f.read_text(encoding="utf-8", errors="replace") for f in files), trainer=trainer
    )
    return tok


def synthetic_model(name: str = "synthetic-8m", root: Path | None = None, seed: int = 0) -> Path:
    """Write (once) a random-initialised fp32 Llama model folder; returns its path."""
    if name not in SYNTHETIC:
        raise ValueError(f"unknown synthetic model {name!r}; known: {', '.join(SYNTHETIC)}")
    out = (root or bench_root()) / f"{name}-v{_SYNTHETIC_VERSION}"
    if (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file():
        return out
    spec = SYNTHETIC[name]
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    tok = _synthetic_tokenizer(spec["vocab_size"])
    eos, pad = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<pad>")
    tok.save(str(tmp / "tokenizer.json"))
    (tmp / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<|endoftext|>",
                "pad_token": "<pad>",
                "model_max_length": spec["max_position_embeddings"],
            },
            indent=2,
        )
    )
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
        "bos_token_id": None,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "initializer_range": 0.02,
        **spec,
    }
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    rng = np.random.default_rng(seed)
    h, i, v = spec["hidden_size"], spec["intermediate_size"], spec["vocab_size"]

    def normal(*shape):
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float32)

    t: dict[str, np.ndarray] = {"model.embed_tokens.weight": normal(v, h)}
    for n in range(spec["num_hidden_layers"]):
        p = f"model.layers.{n}."
        t.update(
            {
                p + "input_layernorm.weight": np.ones(h, np.float32),
                p + "self_attn.q_proj.weight": normal(h, h),
                p + "self_attn.k_proj.weight": normal(h, h),
                p + "self_attn.v_proj.weight": normal(h, h),
                p + "self_attn.o_proj.weight": normal(h, h),
                p + "post_attention_layernorm.weight": np.ones(h, np.float32),
                p + "mlp.gate_proj.weight": normal(i, h),
                p + "mlp.up_proj.weight": normal(i, h),
                p + "mlp.down_proj.weight": normal(h, i),
            }
        )
    t["model.norm.weight"] = np.ones(h, np.float32)
    t["lm_head.weight"] = normal(v, h)
    save_safetensors(tmp / "model.safetensors", t)
    if out.exists():  # another process won the race
        shutil.rmtree(tmp, ignore_errors=True)
        return out
    os.replace(tmp, out)
    return out


def resolve_model(spec: str | None) -> Path:
    """A model argument: a synthetic model name, None for the bundled model, or anything
    ``engine.hub.resolve_model`` takes (a folder, a catalogue name, ``hf:ORG/REPO``)."""
    if spec in SYNTHETIC:
        return synthetic_model(spec)
    if spec is None:
        return default_model_dir()
    return hub.resolve_model(spec)
