"""Export a training checkpoint to a Hugging Face model folder (the shipped layout).

Writes fp16 ``model.safetensors`` (tied embeddings stored once), ``config.json``
(``torch_dtype: float16``), ``generation_config.json``, ``tokenizer.json`` and
``tokenizer_config.json``, plus the loss curve, so the folder loads both in transformers
and in our engine.

    python -m engine.train.export --run-dir runs/spark-code-mini --out engine/models/spark-code-mini
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from .tokenizer import EOS, FILE_SEP, PAD, tokenizer_config


def export(run_dir: Path, out: Path, ckpt_name: str = "ckpt.pt") -> dict:
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer
    from transformers import LlamaConfig

    ckpt_path = run_dir / ckpt_name
    if not ckpt_path.is_file():
        raise FileNotFoundError(f"{ckpt_path}: no checkpoint (train first)")
    ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=False)
    cfg = LlamaConfig.from_dict(ckpt["config"])
    tok = Tokenizer.from_file(str(run_dir / "tokenizer.json"))
    eos, pad, sep = tok.token_to_id(EOS), tok.token_to_id(PAD), tok.token_to_id(FILE_SEP)

    state = {}
    for name, t in ckpt["model"].items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # tied to model.embed_tokens.weight: stored once
        if "rotary_emb" in name:
            continue  # buffers recomputed from the config
        state[name] = t.detach().to(torch.float16).contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)

    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.hidden_size // cfg.num_attention_heads,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": cfg.initializer_range,
        "tie_word_embeddings": True,
        "bos_token_id": eos,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "torch_dtype": "float16",
        "use_cache": True,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    gen = {
        "bos_token_id": eos,
        "eos_token_id": [eos, sep],
        "pad_token_id": pad,
        "do_sample": False,
        "max_new_tokens": 64,
    }
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    shutil.copyfile(run_dir / "tokenizer.json", out / "tokenizer.json")
    (out / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(cfg.max_position_embeddings), indent=2) + "\n"
    )
    if (run_dir / "loss_curve.png").is_file():
        shutil.copyfile(run_dir / "loss_curve.png", out / "loss_curve.png")
    phase_tokens = ckpt["seqs"] * ckpt["args"]["seq_len"]
    return {
        "step": ckpt["step"],
        "tokens": phase_tokens + (ckpt["args"].get("tokens_before") or 0),
        "phase_tokens": phase_tokens,
        "elapsed_min": round(ckpt["elapsed"] / 60, 1),
        "params": sum(t.numel() for t in state.values()),
        "bytes": (out / "model.safetensors").stat().st_size,
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(
        description="Export a training checkpoint to a Hugging Face model folder."
    )
    ap.add_argument("--run-dir", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--ckpt", default="ckpt.pt", help="checkpoint file name inside --run-dir")
    args = ap.parse_args(argv)
    try:
        info = export(args.run_dir, args.out, args.ckpt)
    except FileNotFoundError as e:
        sys.exit(f"error: {e}")
    print(json.dumps(info))


if __name__ == "__main__":
    main()
