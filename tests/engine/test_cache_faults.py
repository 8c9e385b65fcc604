"""The graph cache under faults: an entry truncated, corrupted or with unreadable metadata is
noticed on read, logged once and rebuilt (never handed to ONNX Runtime); a read-only cache folder
means running from a temporary one. The answers stay the same throughout."""

from __future__ import annotations

import json
import logging

import pytest
from engine_helpers import greedy

from engine import Engine, graph_cache

PROMPT = [1, 5, 9, 17, 33, 2, 8]


def _entry(cache):
    (entry,) = [p for p in cache.iterdir() if p.is_dir() and not p.name.startswith(".tmp")]
    return entry


def _load(model, cache):
    return Engine.load(model, wafer=False, cache_dir=cache)


@pytest.mark.parametrize(
    "damage", ["truncate data", "flip graph byte", "garbage meta", "graph missing bytes"]
)
def test_a_damaged_entry_is_rebuilt_with_one_log_line(tiny_llama, tmp_path, caplog, damage):
    cache = tmp_path / "graphs"
    expected = greedy(_load(tiny_llama, cache), PROMPT, 6).tokens
    entry = _entry(cache)
    meta = json.loads((entry / "meta.json").read_text())
    assert meta["files"][graph_cache.DATA_FILE] == (entry / graph_cache.DATA_FILE).stat().st_size
    if damage == "truncate data":
        with open(entry / graph_cache.DATA_FILE, "r+b") as f:
            f.truncate(meta["files"][graph_cache.DATA_FILE] // 2)
    elif damage == "flip graph byte":
        raw = bytearray((entry / graph_cache.MODEL_FILE).read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        (entry / graph_cache.MODEL_FILE).write_bytes(bytes(raw))
    elif damage == "garbage meta":
        (entry / "meta.json").write_text("{not json")
    else:
        raw = (entry / graph_cache.MODEL_FILE).read_bytes()
        (entry / graph_cache.MODEL_FILE).write_bytes(raw[:-10])
    before = graph_cache.builds
    with caplog.at_level(logging.WARNING, logger="engine.graph_cache"):
        eng = _load(tiny_llama, cache)
    assert graph_cache.builds == before + 1
    lines = [r for r in caplog.records if "damaged" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in caplog.records]
    assert greedy(eng, PROMPT, 6).tokens == expected
    # the rebuilt entry is whole again: the next start reads it without building
    _load(tiny_llama, cache)
    assert graph_cache.builds == before + 1


def test_an_unwritable_cache_folder_runs_from_a_temporary_one(tiny_llama, tmp_path):
    """A cache path that cannot be created (here under a file, which fails for root too, unlike a
    read-only folder) is replaced by a temporary folder: the model still loads and answers."""
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    eng = _load(tiny_llama, blocker / "graphs")
    assert len(greedy(eng, PROMPT, 3).tokens) == 3
