"""`spark-lsp bench edits` end to end on a tiny model (no timing assertions: speed is for the bench)."""

from __future__ import annotations

import json

from engine.lab.bench_edits import TASKS, main


def test_bench_edits_json(tiny_llama, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("SPARK_LSP_CACHE", str(tmp_path))
    rc = main(
        [
            "--model",
            str(tiny_llama),
            "--repeats",
            "1",
            "--threads",
            "1",
            "--json",
            "--tasks",
            "rename-arg,fresh-fim",
        ]
    )
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert [r["task"] for r in out["tasks"]] == ["rename-arg", "fresh-fim"]
    for r in out["tasks"]:
        assert r["identical"] and r["new_tokens"] > 0
        assert r["plain_tok_s"] > 0 and r["spec_tok_s"] > 0 and 0 <= r["acceptance"] <= 1
    assert set(out["summary"]) == {"edit", "fresh"}


def test_bench_edits_table_and_errors(tiny_llama, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("SPARK_LSP_CACHE", str(tmp_path))
    assert (
        main(
            [
                "--model",
                str(tiny_llama),
                "--repeats",
                "1",
                "--threads",
                "1",
                "--tasks",
                "type-hints",
                "--precision",
                "int8",
            ]
        )
        == 0
    )
    assert "type-hints" in capsys.readouterr().out
    assert main(["--model", str(tiny_llama), "--tasks", "nope"]) == 2
    assert "unknown task" in capsys.readouterr().err
    assert main(["--model", str(tmp_path / "missing")]) == 2
    assert main(["--repeats", "0"]) == 2
    assert len({t.name for t in TASKS}) == len(TASKS)
