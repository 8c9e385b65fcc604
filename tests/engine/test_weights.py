"""safetensors loading with numpy: dtypes, shards, tied embeddings, and corrupt/mismatched files."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from tiny_models import copy_model, require_reference, write_variant

from engine.config import ModelError, load_config
from engine.weights import (
    expected_shapes,
    load_weights,
    read_header,
    save_safetensors,
    weight_files,
    weights_digest,
)


@pytest.fixture(scope="module")
def variants(tiny_llama, tiny_qwen2, tmp_path_factory):
    root = tmp_path_factory.mktemp("variants")
    return {
        "fp16": write_variant(tiny_qwen2, root / "fp16", dtype="float16"),
        "bf16_sharded": write_variant(
            tiny_qwen2, root / "bf16_sharded", dtype="bfloat16", max_shard_size="60KB"
        ),
        "llama_sharded": write_variant(tiny_llama, root / "llama_sharded", max_shard_size="60KB"),
    }


def reference(folder):
    return load_file(str(folder / "model.safetensors"))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_fp32_matches_file_exactly(tiny_models, arch):
    folder = tiny_models[arch]
    cfg = load_config(folder)
    w = load_weights(folder, cfg)
    ref = reference(folder)
    for name in expected_shapes(cfg):
        assert w[name].dtype == np.float32
        np.testing.assert_array_equal(w[name], ref[name])
    if cfg.tie_word_embeddings:
        assert "lm_head.weight" not in ref and w["lm_head.weight"] is w["model.embed_tokens.weight"]
    else:
        assert w["lm_head.weight"] is not w["model.embed_tokens.weight"]


def test_fp16_and_bf16_sharded(tiny_qwen2, variants):
    require_reference()
    import torch

    cfg = load_config(tiny_qwen2)
    ref = reference(tiny_qwen2)
    fp16_cfg = load_config(variants["fp16"])
    assert fp16_cfg.torch_dtype == "float16"
    w16 = load_weights(variants["fp16"], fp16_cfg)
    bf_dir = variants["bf16_sharded"]
    assert (bf_dir / "model.safetensors.index.json").is_file() and len(weight_files(bf_dir)) > 1
    wbf = load_weights(bf_dir, load_config(bf_dir))
    for name in expected_shapes(cfg):
        np.testing.assert_array_equal(w16[name], ref[name].astype(np.float16).astype(np.float32))
        want = torch.from_numpy(ref[name]).to(torch.bfloat16).float().numpy()
        np.testing.assert_array_equal(wbf[name], want)


def test_sharded_tied(tiny_llama, variants):
    folder = variants["llama_sharded"]
    w = load_weights(folder, load_config(folder))
    ref = load_weights(tiny_llama, load_config(tiny_llama))
    assert w.keys() == ref.keys()
    for k in ref:
        np.testing.assert_array_equal(w[k], ref[k])


def test_writer_roundtrip(tmp_path):
    require_reference()
    import torch
    from safetensors.torch import load_file as torch_load

    rng = np.random.default_rng(0)
    t = {
        "a": rng.standard_normal((3, 5)).astype(np.float32),
        "b": rng.standard_normal(7).astype(np.float32),
    }
    save_safetensors(tmp_path / "f32.safetensors", t)
    got = load_file(str(tmp_path / "f32.safetensors"))
    assert all(np.array_equal(got[k], t[k]) for k in t)
    save_safetensors(tmp_path / "bf16.safetensors", t, dtype="BF16")
    got = torch_load(str(tmp_path / "bf16.safetensors"))
    for k in t:
        assert got[k].dtype == torch.bfloat16
        assert torch.equal(
            got[k], torch.from_numpy(t[k]).to(torch.bfloat16)
        )  # same rounding as torch


def _rewrite(folder, mutate):
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    mutate(tensors)
    save_file(tensors, str(path))


def test_missing_tensor_named(tiny_qwen2, tmp_path):
    folder = copy_model(tiny_qwen2, tmp_path / "m")
    _rewrite(folder, lambda t: t.pop("model.layers.1.self_attn.k_proj.bias"))
    with pytest.raises(
        ModelError,
        match=r"model.safetensors: tensor model.layers.1.self_attn.k_proj.bias is missing",
    ):
        load_weights(folder, load_config(folder))


def test_untied_model_without_lm_head(tiny_qwen2, tmp_path):
    folder = copy_model(tiny_qwen2, tmp_path / "m")
    _rewrite(folder, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(ModelError, match="tensor lm_head.weight is missing"):
        load_weights(folder, load_config(folder))


def test_wrong_shape_named(tiny_llama, tmp_path):
    folder = copy_model(tiny_llama, tmp_path / "m")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["intermediate_size"] = 128
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        ModelError,
        match=r"model.safetensors: tensor model.layers.0.mlp.gate_proj.weight has "
        r"shape \[160, 64\], expected \[128, 64\]",
    ):
        load_weights(folder, load_config(folder))


def test_truncated_and_corrupt_files(tiny_llama, tmp_path):
    folder = copy_model(tiny_llama, tmp_path / "m")
    path = folder / "model.safetensors"
    data = path.read_bytes()
    cfg = load_config(folder)
    path.write_bytes(data[: len(data) - 1000])
    with pytest.raises(ModelError, match=r"model.safetensors: tensor .* \(truncated file\?\)"):
        load_weights(folder, cfg)
    path.write_bytes(data[:4])
    with pytest.raises(ModelError, match="truncated safetensors file"):
        load_weights(folder, cfg)
    path.write_bytes(struct.pack("<Q", 10**12) + data[8:])
    with pytest.raises(ModelError, match="corrupt safetensors header"):
        load_weights(folder, cfg)
    n = struct.unpack("<Q", data[:8])[0]
    path.write_bytes(data[:8] + b"\xff" * n + data[8 + n :])
    with pytest.raises(ModelError, match="corrupt safetensors header"):
        load_weights(folder, cfg)
    path.unlink()
    with pytest.raises(ModelError, match="no model.safetensors or model.safetensors.index.json"):
        load_weights(folder, cfg)


def test_unsupported_dtype_and_nan(tiny_llama, tmp_path):
    folder = copy_model(tiny_llama, tmp_path / "m")
    cfg = load_config(folder)
    _rewrite(
        folder, lambda t: t.update({"model.norm.weight": t["model.norm.weight"].astype(np.int8)})
    )
    with pytest.raises(ModelError, match="tensor model.norm.weight: dtype I8 is not supported"):
        load_weights(folder, cfg)

    def poison(t):
        t["model.norm.weight"] = t["model.norm.weight"].astype(np.float32)
        t["model.norm.weight"][3] = np.nan

    _rewrite(folder, poison)
    with pytest.raises(ModelError, match="model.norm.weight contains NaN"):
        load_weights(folder, cfg)


def test_missing_shard(variants, tmp_path):
    folder = copy_model(variants["llama_sharded"], tmp_path / "m")
    shard = weight_files(folder)[-1]
    shard.unlink()
    with pytest.raises(ModelError, match=rf"shard {shard.name} listed in weight_map is missing"):
        load_weights(folder, load_config(folder))


def test_header_parser(tiny_llama):
    header, start = read_header(tiny_llama / "model.safetensors")
    assert start % 8 == 0 and header["model.norm.weight"]["shape"] == [64]


def test_digest(tiny_llama, tmp_path):
    d1 = weights_digest(tiny_llama)
    assert d1 == weights_digest(tiny_llama) and len(d1) == 32
    folder = copy_model(tiny_llama, tmp_path / "m")
    assert weights_digest(folder) == d1  # content, not path
    path = folder / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    assert weights_digest(folder) != d1
    cfg = folder / "config.json"
    cfg.write_text(cfg.read_text() + " ")
    d3 = weights_digest(folder)
    assert d3 != d1 and d3 == weights_digest(folder)
