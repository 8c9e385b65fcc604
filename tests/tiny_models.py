"""Tiny random-initialised Hugging Face model folders, built locally with transformers (no download).

Each folder is a real HF layout (``config.json``, ``model.safetensors``, ``generation_config.json``,
``tokenizer.json``, ``tokenizer_config.json``) so the engine is tested on exactly what users point it
at, and transformers can load the same folder as the reference implementation.

Models (all fp32, 2 layers, hidden 64, context 512, shared tokenizer):

- ``llama``:   4 heads / 4 kv heads, tied embeddings
- ``qwen2``:   4 heads / 2 kv heads, q/k/v biases, untied embeddings
- ``mistral``: 8 heads / 2 kv heads (GQA, head_dim 8), untied, sliding_window 4096 (> context)
- ``qwen3``:   4 heads / 2 kv heads, head_dim 24 (padded to 32 in the graph: exercises the
  rescaled per-head q/k norm), untied
- ``starcoder2``: 4 heads / 2 kv heads, LayerNorm with bias, GELU-tanh MLP, biases, tied,
  sliding_window 4096 (> context)
- ``gemma``:   4 heads / 1 kv head, head_dim 32 (heads x head_dim != hidden), GeGLU, tied

Initialisation is scaled up from transformers' default (std 0.02) and norm weights / biases are
randomised too, so logits are spread out (greedy decoding is not a tie-break lottery) and a graph
that ignores a norm weight or a bias gives visibly different logits.

The tokenizer is a byte-level BPE (vocab 640) trained on a few stdlib Python files, with the special
tokens ``<|endoftext|>`` (eos, id 0), ``<fim_prefix>``, ``<fim_middle>``, ``<fim_suffix>``, ``<pad>``,
``<file_sep>`` (StarCoder FIM style).
"""

from __future__ import annotations

import shutil
import sysconfig
from pathlib import Path

import pytest

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<fim_prefix>",
    "<fim_middle>",
    "<fim_suffix>",
    "<pad>",
    "<file_sep>",
]
TOKENIZER_VOCAB = 640
CONTEXT = 512
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
_STDLIB_SOURCES = (
    "textwrap.py",
    "shlex.py",
    "fnmatch.py",
    "bisect.py",
    "heapq.py",
    "string.py",
    "json/encoder.py",
)

REFERENCE = (
    "needs the reference extra (transformers on torch, which also builds the tiny test models): "
    "pip install torch --index-url https://download.pytorch.org/whl/cpu && pip install -e '.[ref]'"
)


def require_reference() -> None:
    """Skip the calling test, saying how to install them, when torch or transformers is missing."""
    pytest.importorskip("torch", reason=REFERENCE)
    pytest.importorskip("transformers", reason=REFERENCE)


ARCHS = ("llama", "qwen2", "mistral", "qwen3", "starcoder2", "gemma")


def training_text() -> str:
    """Python source to train the tokenizer on (stdlib files; deterministic for one Python)."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    return "\n".join(
        (lib / f).read_text(encoding="utf-8") for f in _STDLIB_SOURCES if (lib / f).is_file()
    )


def build_tokenizer(vocab_size: int = TOKENIZER_VOCAB):
    """Train a byte-level BPE ``tokenizers.Tokenizer`` on stdlib source (a second or so)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_text().splitlines(keepends=True), trainer=trainer)
    return tok


def save_tokenizer(tok, out_dir: Path) -> None:
    """Save as transformers would (tokenizer.json + tokenizer_config.json with eos/pad)."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<pad>",
        additional_special_tokens=SPECIAL_TOKENS[1:4] + SPECIAL_TOKENS[5:],
    )
    fast.save_pretrained(str(out_dir))


def model_config(arch: str, vocab_size: int, eos_id: int, pad_id: int):
    """The transformers config of one tiny architecture."""
    from transformers import (
        GemmaConfig,
        LlamaConfig,
        MistralConfig,
        Qwen2Config,
        Qwen3Config,
        Starcoder2Config,
    )

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        max_position_embeddings=CONTEXT,
        rms_norm_eps=1e-5,
        initializer_range=0.2,
        eos_token_id=eos_id,
        bos_token_id=None,
        pad_token_id=pad_id,
    )
    if arch == "llama":
        return LlamaConfig(
            num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True, **common
        )
    if arch == "qwen2":
        return Qwen2Config(
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            rope_theta=1_000_000.0,
            **common,
        )
    if arch == "mistral":
        return MistralConfig(
            num_attention_heads=8,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            sliding_window=4096,
            **common,
        )
    if arch == "qwen3":
        return Qwen3Config(
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=24,
            tie_word_embeddings=False,
            rope_theta=1_000_000.0,
            **common,
        )
    if arch == "starcoder2":
        common = {k: v for k, v in common.items() if k != "rms_norm_eps"}
        return Starcoder2Config(
            num_attention_heads=4,
            num_key_value_heads=2,
            norm_epsilon=1e-5,
            use_bias=True,
            tie_word_embeddings=True,
            sliding_window=4096,
            rope_theta=100_000.0,
            **common,
        )
    if arch == "gemma":
        return GemmaConfig(
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=32,
            tie_word_embeddings=True,
            **common,
        )
    raise ValueError(f"unknown tiny architecture {arch!r}; expected one of {ARCHS}")


def build_model(arch: str, out_dir: Path, tokenizer=None, seed: int = 0) -> Path:
    """Build, randomise and save one tiny model folder; returns ``out_dir``."""
    import torch
    from transformers import AutoModelForCausalLM

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = tokenizer or build_tokenizer()
    cfg = model_config(
        arch, tok.get_vocab_size(), tok.token_to_id("<|endoftext|>"), tok.token_to_id("<pad>")
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and arch == "gemma" and name.endswith(".weight"):
                p.uniform_(
                    -0.5, 0.5
                )  # Gemma scales by 1 + weight: the same 0.5..1.5 gains as the others
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.2)
    model.eval()
    model.save_pretrained(str(out_dir))
    save_tokenizer(tok, out_dir)
    return out_dir


def build_all(root: Path, seed: int = 0) -> dict[str, Path]:
    """All the tiny models under ``root`` (one tokenizer training for all)."""
    tok = build_tokenizer()
    return {
        arch: build_model(arch, Path(root) / f"tiny_{arch}", tok, seed=seed + i)
        for i, arch in enumerate(ARCHS)
    }


def write_variant(
    src: Path, dst: Path, *, dtype: str = "float32", max_shard_size: str | None = None
) -> Path:
    """Re-save a model folder in another dtype ('float16' / 'bfloat16') and/or sharded, with transformers.

    E.g. ``write_variant(tiny_llama, tmp/"bf16_sharded", dtype="bfloat16", max_shard_size="50KB")``
    gives ``model-0000k-of-0000n.safetensors`` + ``model.safetensors.index.json``.
    """
    import torch
    from transformers import AutoModelForCausalLM

    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=getattr(torch, dtype))
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(dst), **kw)
    for f in _TOKENIZER_FILES:
        if (Path(src) / f).is_file():
            shutil.copy(Path(src) / f, dst / f)
    return dst


def copy_model(src: Path, dst: Path) -> Path:
    """A private copy of a model folder that a test may corrupt."""
    shutil.copytree(src, dst)
    return Path(dst)
