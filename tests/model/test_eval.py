"""engine.evaluate and `spark-lsp eval`: sampling, metrics, and an end-to-end run on a tiny model."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from engine.lab.evaluate import edit_similarity, gate_table, resolve_files, sample_positions

SRC = "import os\n\n\ndef f(x):\n    if x:\n        return os.path.join(x, 'a')\n    return None\n"


def test_edit_similarity():
    assert edit_similarity("", "") == 1.0
    assert edit_similarity("abc", "abc") == 1.0
    assert edit_similarity("abc", "") == 0.0
    assert edit_similarity("kitten", "sitting") == pytest.approx(1 - 3 / 7)


def test_positions_cut_a_line():
    texts = {Path("a.py"): SRC}
    for pos in sample_positions(texts, 50, seed=0):
        assert pos.target and "\n" not in pos.target
        assert pos.prefix + pos.target + pos.suffix == SRC  # short file: nothing truncated
        assert pos.suffix == "" or pos.suffix.startswith("\n")
        assert pos.prefix.rsplit("\n", 1)[-1].strip() or pos.target.strip()
    assert sample_positions(texts, 5, seed=1) == sample_positions(texts, 5, seed=1)


def test_line_start_positions_are_indented_lines_at_column_0():
    texts = {Path("a.py"): SRC}
    positions = sample_positions(texts, 30, seed=0, line_start=True)
    for pos in positions:
        assert pos.prefix == "" or pos.prefix.endswith("\n")
        assert pos.target[0] in " \t" and pos.target.strip()  # the whole line, indentation included
        assert pos.prefix + pos.target + pos.suffix == SRC
    with pytest.raises(ValueError, match="no indented lines"):
        sample_positions({Path("b.py"): "x = 1\ny = 2\n"}, 3, seed=0, line_start=True)


def test_mid_line_positions_hide_a_span_and_keep_the_rest_of_the_line():
    texts = {Path("a.py"): SRC}
    for pos in sample_positions(texts, 40, seed=0, mid_line=True):
        assert pos.prefix + pos.target + pos.suffix == SRC
        rest = pos.suffix.split("\n", 1)[0]
        assert pos.target.strip() and "\n" not in pos.target and rest.strip()  # text after the span
        assert (
            pos.prefix.rsplit("\n", 1)[-1].strip() or pos.target[0] not in " \t"
        )  # after the indent
    with pytest.raises(ValueError, match="two words"):
        sample_positions({Path("b.py"): "x\n"}, 3, seed=0, mid_line=True)


def test_after_indent_positions_start_after_the_indentation():
    for pos in sample_positions({Path("a.py"): SRC}, 20, seed=0, after_indent=True):
        line = pos.prefix.rsplit("\n", 1)[-1]
        assert line and not line.strip() and pos.target.strip() and pos.target[0] not in " \t"
        assert pos.prefix + pos.target + pos.suffix == SRC


def test_gate_table_counts_what_each_threshold_would_show():
    samples = [
        {"prediction": "a", "confidence": 0.9, "exact": True, "edit_similarity": 1.0},
        {"prediction": "b", "confidence": 0.4, "exact": False, "edit_similarity": 0.5},
        {"prediction": "", "confidence": 0.95, "exact": False, "edit_similarity": 0.0},
    ]
    rows = {r["threshold"]: r for r in gate_table(samples, (0.0, 0.5, 0.99))}
    assert rows[0.0]["coverage"] == pytest.approx(2 / 3) and rows[0.0]["exact_match"] == 0.5
    assert (
        rows[0.5]["shown"] == 1
        and rows[0.5]["exact_match"] == 1.0
        and rows[0.5]["edit_similarity"] == 1.0
    )
    assert rows[0.99] == {
        "threshold": 0.99,
        "coverage": 0.0,
        "shown": 0,
        "exact_match": None,
        "edit_similarity": None,
    }


def test_resolve_files(tmp_path):
    (tmp_path / "a.py").write_text(SRC)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.py").write_text(SRC)
    lst = tmp_path / "list.txt"
    lst.write_text(f"{tmp_path / 'a.py'}\n")
    assert len(resolve_files([str(tmp_path / "**" / "*.py")])) == 2
    assert resolve_files([f"@{lst}"]) == [tmp_path / "a.py"]
    with pytest.raises(ValueError, match="no files matched"):
        resolve_files([str(tmp_path / "*.rs")])
    with pytest.raises(ValueError, match="list file not found"):
        resolve_files(["@/nonexistent/list.txt"])


def test_eval_cli_end_to_end(tiny_llama, tmp_path, capsys):
    from spark_lsp.cli import main

    f = tmp_path / "m.py"
    f.write_text(SRC * 3)
    rc = main(
        [
            "eval",
            "--model",
            str(tiny_llama),
            "--files",
            str(f),
            "--n",
            "4",
            "--max-new-tokens",
            "4",
            "--json",
            "--threads",
            "1",
        ]
    )
    assert rc == 0
    res = json.loads(capsys.readouterr().out)
    assert res["n"] == 4 and len(res["samples"]) == 4
    assert 0.0 <= res["exact_match"] <= 1.0 and 0.0 <= res["edit_similarity"] <= 1.0
    # a random tiny model: close to log2(vocab) bits per token, several bits per byte
    assert math.isfinite(res["bits_per_byte"]) and res["bits_per_byte"] > 0.5
    assert res["bpb_bytes"] == len((SRC * 3).encode())


def test_eval_with_neighbours_context(tiny_qwen2, tmp_path, capsys):
    """--context neighbours: the same cursors completed without and with the other files of the
    folder first in the prompt (protocol check on a random model: longer prompts, both scored)."""
    from spark_lsp.cli import main

    pkg = tmp_path / "pkg"
    pkg.mkdir()
    for name in ("a", "b", "c"):
        (pkg / f"{name}.py").write_text(SRC.replace("def ", f"def {name}_") * 2)
    rc = main(
        [
            "eval",
            "--model",
            str(tiny_qwen2),
            "--files",
            str(pkg / "*.py"),
            "--n",
            "4",
            "--max-new-tokens",
            "4",
            "--json",
            "--threads",
            "1",
            "--context",
            "neighbours",
            "--context-tokens",
            "120",
            "--bpb-max-bytes",
            "2000",
        ]
    )
    assert rc == 0
    res = json.loads(capsys.readouterr().out)
    both = res["context"]
    assert set(both) == {"without", "with"} and both["without"]["exact_match"] == res["exact_match"]
    plain, ctx = res["samples"], res["context_samples"]
    assert [(s["file"], s["line"], s["target"]) for s in plain] == [
        (s["file"], s["line"], s["target"]) for s in ctx
    ]
    assert all(c["prompt_tokens"] > p["prompt_tokens"] for p, c in zip(plain, ctx))
    assert all(c["prompt_tokens"] - p["prompt_tokens"] <= 120 + 16 for p, c in zip(plain, ctx))


def test_eval_cli_errors(tiny_llama, tmp_path, capsys):
    from spark_lsp.cli import main

    assert main(["eval", "--model", str(tiny_llama), "--files", str(tmp_path / "*.py")]) == 2
    assert "no files matched" in capsys.readouterr().err
    assert main(["eval", "--model", str(tmp_path / "nope"), "--files", __file__, "--n", "1"]) == 2
    assert "error" in capsys.readouterr().err
    assert main(["eval", "--files", __file__, "--n", "0"]) == 2
    for flag, value in (("--context-tokens", "-1"), ("--bpb-max-bytes", "-5"), ("--threads", "0")):
        capsys.readouterr()
        assert main(["eval", "--files", __file__, flag, value]) == 2
        assert f"{flag} must be >= " in capsys.readouterr().err


def test_served_scores_the_post_processed_suggestion(tiny_llama, tmp_path, capsys):
    """`--served`: the prediction is what the server would show (its post-processing applied)."""
    from engine.lab.evaluate import Position
    from spark_lsp.cli import main
    from spark_lsp.commands.eval import served

    pos = Position(
        "a.py", 5, "def f(x):\n    if x:\n        return g(", "\n    return None\n", "x)"
    )
    assert served(pos, "x)) + 1") == "x)"  # the unmatched ")" and what follows are cut
    assert served(pos, "x, " + "a, b, " * 5) == "x, a, b"  # a looping phrase is kept once
    f = tmp_path / "m.py"
    f.write_text(SRC * 3)
    rc = main(
        [
            "eval",
            "--model",
            str(tiny_llama),
            "--files",
            str(f),
            "--n",
            "4",
            "--max-new-tokens",
            "6",
            "--json",
            "--threads",
            "1",
            "--served",
        ]
    )
    assert rc == 0
    res = json.loads(capsys.readouterr().out)
    raw = main(
        [
            "eval",
            "--model",
            str(tiny_llama),
            "--files",
            str(f),
            "--n",
            "4",
            "--max-new-tokens",
            "6",
            "--json",
            "--threads",
            "1",
        ]
    )
    assert raw == 0
    raw = json.loads(capsys.readouterr().out)
    for s, r in zip(res["samples"], raw["samples"]):
        assert s["target"] == r["target"]
        assert r["prediction"].startswith(s["prediction"].rstrip()) or not s["prediction"]
