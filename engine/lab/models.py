"""Models for measuring: a named synthetic reference model, a folder, or the bundled default.

``synthetic-8m`` names a reference model: a random-initialised fp32 Llama (d=256, 4 layers,
d_ff=768, vocab 8192, untied: ~7.6M parameters) written with numpy into a cache folder, so a
benchmark can run on a fixed shape without a trained model.  ``synthetic-qwen2.5-coder-0.5b`` /
``-1.5b`` / ``-3b`` are those models' exact configurations with random bf16 weights: the real
scale, where decoding streams the weights from DRAM.
"""

from __future__ import annotations

import json
import os
import shutil
import sysconfig
from pathlib import Path

import numpy as np

from .. import hub
from ..config import load_config
from ..models import default_model_dir
from ..weights import expected_shapes, write_safetensors

#: Synthetic models by name: the architecture of a real model with random weights.  The Qwen2.5-Coder
#: shapes are those models' own config.json (tied 151,936-row embedding, q/k/v biases, bf16).
SYNTHETIC = {
    "synthetic-8m": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_size=256,
        num_hidden_layers=4,
        intermediate_size=768,
        vocab_size=8192,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        torch_dtype="float32",
    ),
    "synthetic-qwen2.5-coder-0.5b": dict(
        _QWEN := dict(
            architectures=["Qwen2ForCausalLM"],
            model_type="qwen2",
            vocab_size=151936,
            max_position_embeddings=32768,
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
            tie_word_embeddings=True,
            torch_dtype="bfloat16",
            sliding_window=32768,
            use_sliding_window=False,
            max_window_layers=24,
        ),
        hidden_size=896,
        num_hidden_layers=24,
        intermediate_size=4864,
        num_attention_heads=14,
        num_key_value_heads=2,
    ),
    "synthetic-qwen2.5-coder-1.5b": dict(
        _QWEN,
        hidden_size=1536,
        num_hidden_layers=28,
        intermediate_size=8960,
        num_attention_heads=12,
        num_key_value_heads=2,
    ),
    "synthetic-qwen2.5-coder-3b": dict(
        _QWEN,
        hidden_size=2048,
        num_hidden_layers=36,
        intermediate_size=11008,
        num_attention_heads=16,
        num_key_value_heads=2,
    ),
}
#: Tokens of the real Qwen2.5 vocabulary (the embedding has padding rows past them).
_QWEN_TOKENS = 151643
#: Qwen2.5-Coder's control tokens after its vocabulary (chat, fill-in-the-middle, repository), so
#: the server builds the prompts a real Qwen2.5-Coder gets (``engine.fim``'s qwen layout).
_QWEN_SPECIALS = (
    "<|im_start|>",
    "<|im_end|>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
)
_SYNTHETIC_VERSION = 1


def bench_root() -> Path:
    """``$SPARK_LSP_CACHE/bench`` or ``~/.cache/spark-lsp/bench`` (synthetic models, peer builds)."""
    env = os.environ.get("SPARK_LSP_CACHE")
    root = Path(env).expanduser() if env else Path.home() / ".cache" / "spark-lsp"
    return root / "bench"


def _synthetic_tokenizer(vocab_size: int, total: int | None = None, specials: tuple = ()):
    """A byte-level BPE trained on Python stdlib source (the model is random; the vocab just has to exist).

    ``total``: pad the vocabulary with never-merged filler tokens up to this size, so per-token work
    that scales with the vocabulary (sampling, stop sets, healing masks) runs at the real size;
    ``specials``: control tokens added after it.
    """
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
    if total is not None and total > tok.get_vocab_size():
        data = json.loads(tok.to_str())
        vocab = data["model"]["vocab"]
        n = len(vocab)
        while len(vocab) < total:
            vocab[f"\u0120filler{n}"] = n
            n += 1
        tok = Tokenizer.from_str(json.dumps(data))
    if specials:
        tok.add_special_tokens(list(specials))
    return tok


def _qwen_tokenizer():
    return _synthetic_tokenizer(8192, _QWEN_TOKENS, _QWEN_SPECIALS)


def _upgrade_tokenizer(folder: Path) -> None:
    """A Qwen-shaped folder written before its tokenizer had Qwen's control tokens gets them; the
    weights and config (and so every cache keyed by their digest) stay as they are."""
    path = folder / "tokenizer.json"
    if _QWEN_SPECIALS[2] in path.read_text(encoding="utf-8"):
        return
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    _qwen_tokenizer().save(str(tmp))
    os.replace(tmp, path)


def _normal_tensor(rng: np.random.Generator, name: str, shape: tuple[int, ...]) -> np.ndarray:
    if name.endswith("norm.weight"):
        return np.ones(shape, np.float32)
    return rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)


def synthetic_model(name: str = "synthetic-8m", root: Path | None = None, seed: int = 0) -> Path:
    """Write (once) a random-initialised model folder of a named shape; returns its path.

    The weights are written one tensor at a time in the shape's storage dtype, so a 3B model is
    written with a few hundred MB of RAM.
    """
    if name not in SYNTHETIC:
        raise ValueError(f"unknown synthetic model {name!r}; known: {', '.join(SYNTHETIC)}")
    out = (root or bench_root()) / f"{name}-v{_SYNTHETIC_VERSION}"
    spec = dict(SYNTHETIC[name])
    qwen = spec["model_type"] == "qwen2"
    if (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file():
        if qwen:
            _upgrade_tokenizer(out)
        return out
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    tok = _qwen_tokenizer() if qwen else _synthetic_tokenizer(spec["vocab_size"])
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
        "hidden_act": "silu",
        "attention_bias": qwen,
        "mlp_bias": False,
        "bos_token_id": None,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "initializer_range": 0.02,
        **spec,
    }
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    cfg = load_config(tmp)
    shapes = expected_shapes(cfg)
    rng = np.random.default_rng(seed)
    dtype = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}[spec["torch_dtype"]]
    write_safetensors(
        tmp / "model.safetensors", shapes, lambda n: _normal_tensor(rng, n, shapes[n]), dtype
    )
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
