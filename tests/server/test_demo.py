"""`spark-lsp demo` is honest on a first run: it says the bundled model is a small demo and which
command uses a real one, works on the user's own file (retyping one of its functions, interrupting
a suggestion there), keeps measured and projected figures apart, and never prints a bare None,
`[---]` or an error code without words."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys

import pytest

from spark_lsp import preparation
from spark_lsp.commands.demo import REAL_MODEL, pick_function

USER_FILE = """import json


def load_prices(path):
    with open(path) as f:
        data = json.load(f)
    return {name: float(price) for name, price in data.items()}


def cheapest(prices):
    best_name, best_price = None, None
    for name, price in prices.items():
        if best_price is None or price < best_price:
            best_name, best_price = name, price
    return best_name
"""


def test_pick_function_retypes_the_body_of_one_of_the_users_functions():
    text, cursor, typed, line = pick_function(USER_FILE)
    assert text[:cursor] + typed + text[cursor:] == USER_FILE  # typing it gives the file back
    assert text.splitlines()[line] == "def cheapest(prices):" and text[:cursor].endswith(
        "def cheapest(prices):"
    )
    assert typed.startswith("\n    best_name") and typed.endswith("return best_name")
    assert pick_function("x = 1\n") is None and pick_function("def broken(:\n") is None


@pytest.mark.slow
def test_demo_on_the_users_file_is_honest(tmp_path):
    path = tmp_path / "prices.py"
    path.write_text(USER_FILE)
    # an empty cache: the first run's preparation is reported as it happens
    env = dict(os.environ, SPARK_LSP_CACHE=str(tmp_path / "cache"))
    out = subprocess.run(
        [sys.executable, "-m", "spark_lsp.commands.demo", str(path), "--cps", "300"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert re.search(r"\n  +\d+\.\d s  building the decoder graph for ", text), text[:2000]
    assert "is a small demo" in text and f"spark-lsp serve --model {REAL_MODEL}" in text
    assert "Typing the body of cheapest() again" in text and "def cheapest_again(prices):" in text
    assert "summarize" not in text and "inventory" not in text.lower()
    assert "measured on this machine:" in text
    if "wafer decode" in text:
        assert "projected (the performance model's estimate" in text
    assert not re.search(r"\bNone\b", text.split("== Figures", 1)[1])
    assert "[---]" not in text and not re.search(r"answered -?\d+", text)
    assert path.read_text() == USER_FILE  # the user's file is not changed


def test_the_engines_steps_are_reported_while_a_model_loads():
    lines = []
    engine_log = logging.getLogger("engine.graph_cache")
    level = logging.getLogger("engine").level
    with preparation.reporting(lines.append):
        engine_log.info("building the decoder graph for %s", "m")
        logging.getLogger("spark_lsp").info("not the engine's")
    engine_log.info("after the load")
    assert len(lines) == 1 and re.fullmatch(
        r" +\d+\.\d s  building the decoder graph for m", lines[0]
    )
    assert logging.getLogger("engine").level == level


@pytest.mark.parametrize(
    "content,said",
    [
        (b"\xff\xfe\x00def f(x):\n", "not a UTF-8 text file (byte 0xff at offset 0)"),
        (None, "No such file or directory"),
    ],
)
def test_a_file_the_demo_cannot_read_is_refused_in_words(tmp_path, capsys, content, said):
    from spark_lsp.cli import main

    path = tmp_path / "f.py"
    if content is not None:
        path.write_bytes(content)
    assert main(["demo", str(path)]) == 2
    assert capsys.readouterr().err == f"spark-lsp demo: {path}: {said}\n"
