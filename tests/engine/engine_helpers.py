"""Shared helpers for the engine tests: load engines into a per-session graph cache and run the
transformers reference (greedy decoding with its own KV cache)."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
from tiny_models import require_reference

from engine import Engine, GenerationParams


def graph_cache_dir(tmp_path_factory) -> Path:
    """One graph cache for the whole test session, so each tiny model is built once."""
    return tmp_path_factory.getbasetemp() / "graph_cache"


def load_engine(model_dir: Path, tmp_path_factory, **kw) -> Engine:
    kw.setdefault("wafer", False)
    return Engine.load(model_dir, cache_dir=graph_cache_dir(tmp_path_factory), **kw)


@functools.cache
def hf_model(model_dir: Path):
    require_reference()
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def hf_logits(model_dir: Path, ids: list[int]) -> np.ndarray:
    require_reference()
    import torch

    with torch.no_grad():
        return hf_model(model_dir)(torch.tensor([ids])).logits[0].numpy()


def hf_greedy(model_dir: Path, ids: list[int], n: int) -> list[int]:
    """n greedy tokens from transformers (eos ignored), incremental with its KV cache."""
    require_reference()
    import torch

    model = hf_model(model_dir)
    out: list[int] = []
    with torch.no_grad():
        res = model(torch.tensor([ids]), use_cache=True)
        for _ in range(n):
            tok = int(res.logits[0, -1].argmax())
            out.append(tok)
            res = model(torch.tensor([[tok]]), past_key_values=res.past_key_values, use_cache=True)
    return out


def greedy(engine: Engine, ids, n: int, slot=None):
    """Run a greedy generation to the end (eos ignored); returns the Generation."""
    gen = engine.generate(list(ids), GenerationParams(max_new_tokens=n, ignore_eos=True), slot=slot)
    gen.result()
    return gen


def random_ids(engine: Engine, n: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, engine.sample_vocab, n).tolist()


def brute_consistent(token_bytes, pending: bytes) -> list[int]:
    """The ids ``ByteIndex.consistent(pending)`` must give, by scanning every token."""
    return [
        i
        for i, b in enumerate(token_bytes)
        if b and (b.startswith(pending) or pending.startswith(b))
    ]


def runtime_table(model, data: Path):
    """The embedding table a streamed graph leaves to the runtime (``engine.embedding``): its
    metadata and its bytes in the data file ``data``; None where the graph gathers it itself."""
    import json

    meta = {p.key: p.value for p in model.metadata_props}
    if "spark_lsp.embedding" not in meta:
        return None
    e = json.loads(meta["spark_lsp.embedding"])
    with open(data, "rb") as f:
        f.seek(e["offset"])
        return e, f.read(e["length"])


def assert_same_table(streamed, data: Path, reference) -> None:
    """A streamed graph that leaves its table to the runtime holds, in ``data``, the bytes of the
    ``embed_tokens`` initializer of an in-memory build ``reference``, at an aligned offset."""
    e, raw = runtime_table(streamed, data)
    (table,) = [t for t in reference.graph.initializer if t.name == "embed_tokens"]
    assert raw == table.raw_data
    assert (e["rows"], e["cols"], e["type"]) == (*table.dims, table.data_type)
    assert e["offset"] % 4096 == 0
