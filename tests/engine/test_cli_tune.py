"""`spark-lsp tune`: measures once, stores the decision where Engine.load(precision="auto") reads it."""

from __future__ import annotations

import json

import pytest

from engine import Engine
from spark_lsp import cli


@pytest.fixture(autouse=True)
def _calm_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARK_LSP_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr("engine.runtime.cpu_contended", lambda *a, **k: False)


def test_tune_stores_the_decision_auto_loads(tiny_llama, tmp_path, capsys):
    assert cli.main(["tune", "--model", str(tiny_llama), "--threads", "1", "--json"]) == 0
    out, err = capsys.readouterr()
    choice = json.loads(out)
    assert choice["precision"] in ("fp32", "int8", "int8-rowq", "int4") and not choice["cached"]
    assert set(choice["decode_tok_s"]) == {"fp32", "int8", "int8-rowq", "int4"}
    assert "precision for" in err  # the measurement's log line goes to stderr with --json
    assert len(list((tmp_path / "cache" / "precision").glob("*.json"))) == 1

    eng = Engine.load(tiny_llama, precision="auto", threads=1)
    assert eng.precision == choice["precision"] and eng.precision_reason == choice["reason"]

    assert cli.main(["tune", "--model", str(tiny_llama), "--threads", "1"]) == 0
    assert "(stored decision)" in capsys.readouterr().out  # measured once per model and machine


def test_tune_errors_are_one_line(tmp_path, capsys):
    assert cli.main(["tune", "--model", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("spark-lsp tune: error:") and err.count("\n") == 1
    assert cli.main(["tune", "--threads", "0"]) == 2
