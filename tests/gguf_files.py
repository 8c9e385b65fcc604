"""Write GGUF files from the tiny Hugging Face model folders, as llama.cpp's converter lays them out.

``write_gguf(folder, path, qtype="F32")`` uses ``gguf.GGUFWriter``: the metadata keys, tensor
names, the Q/K row permutation of ``llama`` files and the +1 on Gemma's norm weights are the ones
``convert_hf_to_gguf.py`` writes, and the tokenizer goes in as ``tokenizer.ggml.*`` (byte-level
BPE, pre-tokenizer ``gpt-2`` for the tiny models' GPT-2-style split).  2-D weights are stored in
``qtype`` (F32, F16, BF16, Q8_0 or Q4_0, quantised by ``gguf.quants``); norms, biases and, for the
block types, the token embeddings stay F32 (as llama.cpp's ``--token-embedding-type f32``).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from engine.gguf import permute_rotary
from engine.weights import read_tensors, weight_files

GGUF_ARCH = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Starcoder2ForCausalLM": "starcoder2",
    "GemmaForCausalLM": "gemma",
}
_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.c_fc": "ffn_up",
    "mlp.c_proj": "ffn_down",
}
_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def gguf_name(hf: str) -> str:
    base, _, kind = hf.rpartition(".")
    if base.startswith("model.layers."):
        _, _, layer, rest = base.split(".", 3)
        return f"blk.{layer}.{_LAYER[rest]}.{kind}"
    return f"{_GLOBAL[base]}.{kind}"


def tokenizer_metadata(folder: Path) -> dict:
    """tokens, token types (3 = control for special added tokens), merges of a byte-level BPE."""
    tj = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = dict(tj["model"]["vocab"])
    special = set()
    for t in tj.get("added_tokens", []):
        vocab[t["content"]] = t["id"]
        if t.get("special"):
            special.add(t["content"])
    tokens = [None] * (max(vocab.values()) + 1)
    for t, i in vocab.items():
        tokens[i] = t
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    types = [3 if t in special else 1 for t in tokens]
    return {"tokens": tokens, "types": types, "merges": merges}


def write_gguf(folder: Path, path: Path, qtype: str = "F32", pre: str = "gpt-2") -> Path:
    import gguf

    folder, path = Path(folder), Path(path)
    cfg = json.loads((folder / "config.json").read_text())
    hf_arch = cfg["architectures"][0]
    arch = GGUF_ARCH[hf_arch]
    tensors: dict[str, np.ndarray] = {}
    for f in weight_files(folder):
        tensors.update(read_tensors(f))
    heads, kv_heads = (
        cfg["num_attention_heads"],
        cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
    )
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    rope = cfg.get("rope_parameters") or {}

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(folder.name)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))))
    if arch == "starcoder2":
        w.add_layer_norm_eps(cfg["norm_epsilon"])
    else:
        w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    tok = tokenizer_metadata(folder)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tok["tokens"])
    w.add_token_types(tok["types"])
    w.add_token_merges(tok["merges"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_pad_token_id(cfg.get("pad_token_id") or 0)
    tcfg_path = folder / "tokenizer_config.json"
    tcfg = json.loads(tcfg_path.read_text()) if tcfg_path.is_file() else {}
    if isinstance(tcfg.get("chat_template"), str):  # as convert_hf_to_gguf.py copies it
        w.add_chat_template(tcfg["chat_template"])

    tied = cfg.get("tie_word_embeddings", False)
    kind = gguf.GGMLQuantizationType[qtype]
    for hf, arr in tensors.items():
        if tied and hf == "lm_head.weight":
            continue
        arr = np.asarray(arr, np.float32)
        if arch == "llama" and (".q_proj." in hf or ".k_proj." in hf):
            arr = permute_rotary(arr, heads if ".q_proj." in hf else kv_heads)
        if arch == "gemma" and hf.endswith("norm.weight"):
            arr = arr + np.float32(1.0)
        name = gguf_name(hf)
        if (
            arr.ndim == 2
            and qtype != "F32"
            and (hf != "model.embed_tokens.weight" or qtype in ("F16", "BF16"))
        ):
            if qtype == "F16":
                w.add_tensor(name, arr.astype(np.float16))
            else:
                data = gguf.quants.quantize(arr, kind)
                w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=kind)
        else:
            w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
