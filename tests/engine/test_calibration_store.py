"""The speculative decoder's calibration (engine.speculative.verify_margin) is measured once per
graph and machine and kept next to the cached graph: a later engine on the same graph reads it,
one under other conditions measures again."""

from __future__ import annotations

import json

import pytest

from engine import Engine, speculative

PROMPT = list(range(3, 60))


def _load(model, cache):
    return Engine.load(model, wafer=False, cache_dir=cache)


def test_a_later_engine_reads_the_stored_calibration(tiny_llama, tmp_path, monkeypatch):
    cache = tmp_path / "graphs"
    first = _load(tiny_llama, cache)
    measured = speculative._calibration(first, PROMPT)
    stored = first.graph_path.parent / speculative.CALIBRATION_FILE
    rec = json.loads(stored.read_text())
    assert rec["calibration"][0] == pytest.approx(measured[0])
    second = _load(tiny_llama, cache)  # a new engine, as in the next process

    def no_runs(*a, **kw):
        raise AssertionError("calibrated again")

    monkeypatch.setattr(second.runtime, "decode", no_runs)
    assert speculative._calibration(second, PROMPT) == pytest.approx(measured)
    assert speculative.verify_margin(second, PROMPT) == pytest.approx(measured[0])


def test_other_conditions_or_a_damaged_file_measure_again(tiny_llama, tmp_path, monkeypatch):
    cache = tmp_path / "graphs"
    speculative._calibration(_load(tiny_llama, cache), PROMPT)
    calls = []
    eng = _load(tiny_llama, cache)
    real = eng.runtime.decode
    monkeypatch.setattr(eng.runtime, "decode", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.setenv("SPARK_LSP_AMX", "0")  # a pass may round differently on the VNNI path
    speculative._calibration(eng, PROMPT)
    assert calls
    stored = eng.graph_path.parent / speculative.CALIBRATION_FILE
    assert json.loads(stored.read_text())["under"]["amx"][0] == "0"
    stored.write_text("{damaged")
    calls.clear()
    eng2 = _load(tiny_llama, cache)
    real2 = eng2.runtime.decode
    monkeypatch.setattr(eng2.runtime, "decode", lambda *a, **kw: calls.append(1) or real2(*a, **kw))
    speculative._calibration(eng2, PROMPT)
    assert calls
