"""GGUF files for the real llama.cpp servers in the backend tests, written with the `gguf` package.

llama.cpp's own converter refuses the tiny models' tokenizer (a byte-level BPE whose pre-tokenizer
hash it does not know), so the file is written directly: the same tensors the converter writes for
a ``llama`` model (Q and K rows permuted for llama.cpp's rotary layout), the tokenizer as ``gpt2``
BPE with the GPT-2 pre-tokenizer (what the tiny tokenizer's ByteLevel split is).

- `from_folder(tiny_llama_dir, out)`: the exact weights of an HF tiny Llama folder (so the engine
  and llama.cpp run the same model, e.g. for `spark-lsp bench lsp` side by side);
- `random_llama(tokenizer_dir, out, ...)`: a larger random Llama that generates for seconds, to
  watch a server stop after a cancel; its end-of-text logit is pinned at 0 so a greedy run never
  stops early by chance.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's rotary layout for Q/K rows (what convert_hf_to_gguf.py does for Llama)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _tokenizer(writer, tokenizer_dir: Path, eos_id: int) -> None:
    tj = json.loads((Path(tokenizer_dir) / "tokenizer.json").read_text(encoding="utf-8"))
    vocab: dict[str, int] = dict(tj["model"]["vocab"])
    specials = {t["content"]: t["id"] for t in tj.get("added_tokens", [])}
    vocab.update(specials)
    size = max(vocab.values()) + 1
    tokens = [f"[PAD{i}]" for i in range(size)]
    for t, i in vocab.items():
        tokens[i] = t
    types = [3 if t in specials else 1 for t in tokens]  # 3: control, 1: normal
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"].get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_eos_token_id(eos_id)
    writer.add_add_bos_token(False)
    for name, key in (
        ("<fim_prefix>", "fim_pre"),
        ("<fim_suffix>", "fim_suf"),
        ("<fim_middle>", "fim_mid"),
        ("<pad>", "pad"),
        ("<file_sep>", "fim_sep"),
    ):
        if name in specials:
            getattr(writer, f"add_{key}_token_id", lambda i: None)(specials[name])


def _write(
    out: Path,
    tokenizer_dir: Path,
    *,
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    ffn: int,
    context: int,
    eps: float,
    rope_theta: float,
    eos_id: int,
    tensors: dict,
) -> Path:
    import gguf

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_name(out.stem)
    w.add_block_count(layers)
    w.add_context_length(context)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(eps)
    w.add_rope_freq_base(rope_theta)
    w.add_rope_dimension_count(hidden // heads)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    _tokenizer(w, tokenizer_dir, eos_id)
    for name, arr in tensors.items():
        w.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def from_folder(folder: Path, out: Path) -> Path:
    """The GGUF of a tiny HF Llama folder (`tests/tiny_models.py`), same weights."""
    from safetensors.numpy import load_file

    folder = Path(folder)
    cfg = json.loads((folder / "config.json").read_text())
    if cfg.get("model_type") != "llama":
        raise ValueError("from_folder writes Llama folders only")
    sd = load_file(str(folder / "model.safetensors"))
    h, nh, nkv = (
        cfg["hidden_size"],
        cfg["num_attention_heads"],
        cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
    )
    t = {
        "token_embd.weight": sd["model.embed_tokens.weight"],
        "output_norm.weight": sd["model.norm.weight"],
    }
    if "lm_head.weight" in sd and not cfg.get("tie_word_embeddings", False):
        t["output.weight"] = sd["lm_head.weight"]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t[f"blk.{i}.attn_norm.weight"] = sd[p + "input_layernorm.weight"]
        t[f"blk.{i}.attn_q.weight"] = _permute(sd[p + "self_attn.q_proj.weight"], nh)
        t[f"blk.{i}.attn_k.weight"] = _permute(sd[p + "self_attn.k_proj.weight"], nkv)
        t[f"blk.{i}.attn_v.weight"] = sd[p + "self_attn.v_proj.weight"]
        t[f"blk.{i}.attn_output.weight"] = sd[p + "self_attn.o_proj.weight"]
        t[f"blk.{i}.ffn_norm.weight"] = sd[p + "post_attention_layernorm.weight"]
        t[f"blk.{i}.ffn_gate.weight"] = sd[p + "mlp.gate_proj.weight"]
        t[f"blk.{i}.ffn_up.weight"] = sd[p + "mlp.up_proj.weight"]
        t[f"blk.{i}.ffn_down.weight"] = sd[p + "mlp.down_proj.weight"]
    eos = cfg["eos_token_id"]
    return _write(
        out,
        folder,
        hidden=h,
        layers=cfg["num_hidden_layers"],
        heads=nh,
        kv_heads=nkv,
        ffn=cfg["intermediate_size"],
        context=cfg["max_position_embeddings"],
        eps=cfg["rms_norm_eps"],
        rope_theta=cfg.get("rope_theta", 10000.0),
        eos_id=eos[0] if isinstance(eos, list) else eos,
        tensors=t,
    )


def _plain_tokens(tokenizer_dir: Path, vocab: int) -> list[bool]:
    """Per token id: does it decode to printable ASCII (or a line break) on its own?"""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    special = set(tok.get_added_tokens_decoder())
    out = []
    for i in range(vocab):
        text = "" if i in special else tok.decode([i])
        out.append(bool(text) and all(c == "\n" or " " <= c <= "~" for c in text))
    return out


def random_llama(
    tokenizer_dir: Path,
    out: Path,
    *,
    hidden: int = 384,
    layers: int = 6,
    heads: int = 6,
    ffn: int = 1024,
    context: int = 4096,
    seed: int = 0,
) -> Path:
    """A random Llama that generates long greedy runs of ASCII text: the logits of end-of-text, the
    other special tokens and bytes that are not printable ASCII are always 0, so a greedy run never
    stops early by chance, and every token is text a server streams at once (llama.cpp servers hold
    back a partial UTF-8 character, and only notice a closed connection when they send)."""
    tj = json.loads((Path(tokenizer_dir) / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = (
        max([*tj["model"]["vocab"].values(), *(t["id"] for t in tj.get("added_tokens", []))]) + 1
    )
    eos = next(t["id"] for t in tj["added_tokens"] if t["content"] == "<|endoftext|>")
    rng = np.random.default_rng(seed)

    def r(*shape: int, scale: float = 0.08) -> np.ndarray:
        return rng.normal(0, scale, shape).astype(np.float32)

    t = {
        "token_embd.weight": r(vocab, hidden, scale=1.0),
        "output_norm.weight": np.ones(hidden, np.float32),
    }
    out_w = r(vocab, hidden, scale=0.5)
    out_w[[i for i, ok in enumerate(_plain_tokens(tokenizer_dir, vocab)) if not ok]] = (
        0.0  # eos, specials, partial UTF-8
    )
    t["output.weight"] = out_w
    for i in range(layers):
        t[f"blk.{i}.attn_norm.weight"] = np.ones(hidden, np.float32)
        for n in ("attn_q", "attn_k", "attn_v", "attn_output"):
            t[f"blk.{i}.{n}.weight"] = r(hidden, hidden)
        t[f"blk.{i}.ffn_norm.weight"] = np.ones(hidden, np.float32)
        t[f"blk.{i}.ffn_gate.weight"] = r(ffn, hidden)
        t[f"blk.{i}.ffn_up.weight"] = r(ffn, hidden)
        t[f"blk.{i}.ffn_down.weight"] = r(hidden, ffn)
    return _write(
        out,
        tokenizer_dir,
        hidden=hidden,
        layers=layers,
        heads=heads,
        kv_heads=heads,
        ffn=ffn,
        context=context,
        eps=1e-5,
        rope_theta=10000.0,
        eos_id=eos,
        tensors=t,
    )
