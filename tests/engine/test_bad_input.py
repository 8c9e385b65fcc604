"""Bad model folders and bad requests give a clear error naming the file/field, and the process
(and an already-loaded engine) stays usable afterwards."""

from __future__ import annotations

import json

import numpy as np
import pytest
from engine_helpers import graph_cache_dir, greedy, load_engine
from safetensors.numpy import load_file, save_file
from tiny_models import copy_model

from engine import Engine, GenerationParams, ModelError


@pytest.fixture(scope="module")
def eng(tiny_mistral, tmp_path_factory):
    return load_engine(tiny_mistral, tmp_path_factory)


def _edit_config(folder, **changes):
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    for k, v in changes.items():
        if v is ...:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    path.write_text(json.dumps(cfg))


def _drop_tensor(folder, name):
    t = load_file(str(folder / "model.safetensors"))
    del t[name]
    save_file(t, str(folder / "model.safetensors"))


CASES = {
    "unknown architecture": (
        lambda f: _edit_config(f, architectures=["BertModel"]),
        "config.json: architectures='BertModel' is not supported; supported: LlamaForCausalLM",
    ),
    "field out of range": (
        lambda f: _edit_config(f, num_hidden_layers=0),
        "config.json: num_hidden_layers=0 must be a positive integer",
    ),
    "field missing": (
        lambda f: _edit_config(f, hidden_size=...),
        "config.json: required field 'hidden_size' is missing",
    ),
    "corrupt config": (
        lambda f: (f / "config.json").write_text("{not json"),
        "config.json: invalid JSON at line 1",
    ),
    "missing config": (lambda f: (f / "config.json").unlink(), "config.json: file not found"),
    "missing weights": (
        lambda f: (f / "model.safetensors").unlink(),
        "no model.safetensors or model.safetensors.index.json",
    ),
    "truncated weights": (
        lambda f: (f / "model.safetensors").write_bytes(
            (f / "model.safetensors").read_bytes()[:-64]
        ),
        "(truncated file?)",
    ),
    "missing tensor": (
        lambda f: _drop_tensor(f, "model.layers.0.mlp.up_proj.weight"),
        "model.safetensors: tensor model.layers.0.mlp.up_proj.weight is missing",
    ),
    "shape mismatch": (
        lambda f: _edit_config(f, vocab_size=700),
        "tensor model.embed_tokens.weight has shape [640, 64], expected [700, 64]",
    ),
    "missing tokenizer": (
        lambda f: (f / "tokenizer.json").unlink(),
        "tokenizer.json: file not found",
    ),
    "corrupt tokenizer": (
        lambda f: (f / "tokenizer.json").write_text("{]"),
        "tokenizer.json: cannot load",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_folder_named_error(case, tiny_mistral, tmp_path, tmp_path_factory, eng):
    mutate, needle = CASES[case]
    folder = copy_model(tiny_mistral, tmp_path / "m")
    mutate(folder)
    with pytest.raises(ModelError) as e:
        Engine.load(folder, wafer=False, cache_dir=tmp_path / "cache")
    assert needle in str(e.value)
    # the engine loaded before is unaffected
    assert len(greedy(eng, [5, 6, 7], 4).tokens) == 4


def test_missing_folder():
    with pytest.raises(ModelError, match="model folder not found"):
        Engine.load("/nonexistent/model/dir")


def test_prompt_longer_than_context_then_usable(eng):
    ref = greedy(eng, [10, 11, 12, 13], 8, slot="doc").tokens
    with pytest.raises(ModelError, match=r"prompt has 600 tokens but the context is 512 tokens"):
        eng.generate([10] * 600, GenerationParams(max_new_tokens=4), slot="doc")
    with pytest.raises(ModelError, match="context is 512 tokens"):
        eng.generate("x = 1\n" * 400)
    assert greedy(eng, [10, 11, 12, 13], 8, slot="doc").tokens == ref


@pytest.mark.parametrize(
    "kw, needle",
    [
        ({"max_new_tokens": 0}, "max_new_tokens=0"),
        ({"max_new_tokens": True}, "max_new_tokens=True"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"stop": ("",)}, "stop="),
        ({"max_time_s": 0}, "max_time_s=0"),
        ({"seed": -5, "temperature": 1.0}, "seed=-5"),  # was numpy's error at the first sample
        ({"seed": 1.5}, "seed=1.5"),
    ],
)
def test_bad_generation_params(kw, needle):
    with pytest.raises(ValueError, match=needle):
        GenerationParams(**kw)


def test_bad_prompt_ids(eng):
    with pytest.raises(ValueError, match="token id 100000 is outside the vocabulary"):
        eng.generate([1, 100000])
    with pytest.raises(ValueError, match="token id -1 is outside the vocabulary"):
        eng.generate([1, -1, 2])
    # ids that do not pack into 32 bits take the plain path, with the same check
    with pytest.raises(ValueError, match=f"token id {1 << 40} is outside the vocabulary"):
        eng.generate([1, 1 << 40])
    assert eng.encode_prompt(np.array([3, 1, 2])) == [3, 1, 2]
    assert len(greedy(eng, [1, 2], 3).tokens) == 3


def test_tied_model_with_cache_survives_bad_load(tiny_llama, tmp_path_factory, tmp_path):
    """A failed load of a corrupt copy must not poison the graph cache for the good model."""
    bad = copy_model(tiny_llama, tmp_path / "bad")
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[:8] + b"\x00" * 16 + data[24:])
    with pytest.raises(ModelError, match="model.safetensors"):
        Engine.load(bad, wafer=False, cache_dir=graph_cache_dir(tmp_path_factory))
    good = load_engine(tiny_llama, tmp_path_factory)
    assert len(greedy(good, [3, 4, 5], 4).tokens) == 4
