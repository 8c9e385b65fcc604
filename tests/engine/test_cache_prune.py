"""The graph cache removes what will not be read again (engine.graph_cache.prune, after a build):
entries of another graph version once unused for a day, any entry unused for 30 days, and builds a
crashed process left behind; a load marks its entry used. Everything else stays."""

from __future__ import annotations

import json
import logging
import os
import time

import onnx
from onnx import TensorProto, helper

from engine import graph_cache
from engine.graph import GRAPH_VERSION

DAY = 86400.0


def _entry(root, name, version=GRAPH_VERSION, idle_days=0.0, size=1000):
    entry = root / name
    entry.mkdir(parents=True)
    (entry / "meta.json").write_text(json.dumps({"name": name, "graph_version": version}))
    (entry / "model.onnx.data").write_bytes(b"\0" * size)
    t = time.time() - idle_days * DAY
    os.utime(entry, (t, t))
    return entry


def _graph(_data_file):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])
    return helper.make_model(
        helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g", [x], [y])
    )


def test_prune_removes_only_what_is_not_read_again(tmp_path, caplog):
    root = tmp_path / "graphs"
    keep = {
        _entry(root, "current-recent", idle_days=0.1),
        _entry(root, "current-10-days", idle_days=10),
        _entry(root, "old-version-used-today", version=GRAPH_VERSION - 1, idle_days=0.5),
    }
    gone = {
        _entry(root, "old-version-2-days", version=GRAPH_VERSION - 1, idle_days=2, size=5000),
        _entry(root, "current-40-days", idle_days=40),
        _entry(root, "meta-garbage-2-days", idle_days=2),
    }
    # unreadable metadata: its graph version is unknown, so it is treated as another version
    (root / "meta-garbage-2-days" / "meta.json").write_text("{not json")
    t = time.time() - 2 * DAY
    os.utime(root / "meta-garbage-2-days", (t, t))
    tmp_old = root / ".tmp-abc-1"
    tmp_old.mkdir()
    (tmp_old / "model.onnx.data").write_bytes(b"\0" * 700)
    os.utime(tmp_old, (t, t))
    tmp_new = root / ".tmp-abc-2"  # a build in progress
    tmp_new.mkdir()
    other = root / "not-a-graph"  # something else in the folder: never touched
    other.mkdir()
    os.utime(other, (0, 0))
    with caplog.at_level(logging.INFO, logger="engine.graph_cache"):
        removed, freed = graph_cache.prune(root)
    assert removed == 4 and freed >= 5000 + 1000 + 1000 + 700
    assert all(e.exists() for e in keep) and tmp_new.exists() and other.exists()
    assert not any(e.exists() for e in gone) and not tmp_old.exists()
    assert "removed 4 entries" in caplog.text
    assert graph_cache.prune(root) == (0, 0)  # nothing more


def test_a_build_prunes_and_a_load_marks_its_entry_used(tmp_path):
    root = tmp_path / "graphs"
    stale = _entry(root, "m-old", version=GRAPH_VERSION - 1, idle_days=3)
    path, built = graph_cache.get_or_build("m", "k1", _graph, cache_dir=root)
    assert built and not stale.exists()
    onnx.checker.check_model(onnx.load(str(path)))
    entry = path.parent
    t = time.time() - 20 * DAY
    os.utime(entry, (t, t))
    _, built = graph_cache.get_or_build("m", "k1", _graph, cache_dir=root)
    assert not built
    assert time.time() - entry.stat().st_mtime < 60  # its use recorded: not pruned at 30 days
    _, built = graph_cache.get_or_build("m", "k2", _graph, cache_dir=root)  # another build
    assert built and entry.exists()
