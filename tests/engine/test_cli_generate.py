"""`spark-lsp generate`: streaming output, --json fields, options, and one-line errors (exit 2)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest
from engine_helpers import hf_greedy
from tiny_models import copy_model

from spark_lsp.commands import generate as generate_cmd


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("SPARK_LSP_CACHE", str(tmp_path_factory.getbasetemp() / "cli_cache"))


def cli(argv, capsys):
    """Run the generate command through its own parser; returns (rc, stdout, stderr)."""
    parser = argparse.ArgumentParser(prog="spark-lsp")
    generate_cmd.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["generate", *argv])
    rc = args.func(args)
    out, err = capsys.readouterr()
    return rc, out, err


PROMPT = "def add(a, b):\n    return"


def test_json_fields_and_transformers_tokens(tiny_qwen2, capsys):
    from engine.tokenizer import Tokenizer

    rc, out, err = cli(
        ["--model", str(tiny_qwen2), "--prompt", PROMPT, "--max-new-tokens", "12", "--json"], capsys
    )
    assert rc == 0, err
    res = json.loads(out)
    tok = Tokenizer.load(tiny_qwen2)
    ids = tok.encode(PROMPT)
    assert res["prompt_tokens"] == len(ids) and res["reused_tokens"] == 0
    assert {
        "tokens",
        "text",
        "ttft_ms",
        "decode_tok_s",
        "finish_reason",
        "new_tokens",
        "total_ms",
    } <= res.keys()
    ref = hf_greedy(tiny_qwen2, ids, 12)
    n = len(res["tokens"])
    assert res["tokens"] == ref[:n]
    if res["finish_reason"] == "length":
        assert n == 12
    else:
        assert res["finish_reason"] == "eos" and ref[n] in tok.eos_ids
    assert res["text"] == tok.decode(res["tokens"])


def test_stream_equals_json_text_and_no_wafer(tiny_llama, capsys):
    base = ["--model", str(tiny_llama), "--prompt", PROMPT, "--max-new-tokens", "16"]
    rc, out_json, _ = cli(base + ["--json"], capsys)
    rc2, streamed, _ = cli(base + ["--no-wafer"], capsys)
    rc3, gridded, _ = cli(base + ["--grid", "2x4"], capsys)
    assert rc == rc2 == rc3 == 0
    assert streamed == gridded == json.loads(out_json)["text"]


def test_prompt_file_stop_and_sampling(tiny_llama, tmp_path, capsys, monkeypatch):
    f = tmp_path / "prompt.py"
    f.write_text(PROMPT, encoding="utf-8")
    rc, out, _ = cli(
        ["--model", str(tiny_llama), "--prompt-file", str(f), "--max-new-tokens", "24", "--json"],
        capsys,
    )
    full = json.loads(out)
    assert rc == 0 and full["prompt_tokens"] > 3
    monkeypatch.setattr(sys, "stdin", open(f, encoding="utf-8"))
    rc, out, _ = cli(
        ["--model", str(tiny_llama), "--prompt-file", "-", "--max-new-tokens", "24", "--json"],
        capsys,
    )
    assert json.loads(out)["tokens"] == full["tokens"]

    text = full["text"]
    stop = text[4:7]
    rc, out, _ = cli(
        [
            "--model",
            str(tiny_llama),
            "--prompt",
            PROMPT,
            "--max-new-tokens",
            "24",
            "--stop",
            stop,
            "--stop",
            "\x01never",
            "--json",
        ],
        capsys,
    )
    res = json.loads(out)
    assert res["finish_reason"] == "stop" and res["text"] == text[: text.find(stop)]

    sample = [
        "--model",
        str(tiny_llama),
        "--prompt",
        PROMPT,
        "--max-new-tokens",
        "20",
        "--temperature",
        "1.5",
        "--top-k",
        "50",
        "--top-p",
        "0.95",
        "--json",
    ]
    a = json.loads(cli(sample + ["--seed", "7"], capsys)[1])["tokens"]
    b = json.loads(cli(sample + ["--seed", "7"], capsys)[1])["tokens"]
    c = json.loads(cli(sample + ["--seed", "8"], capsys)[1])["tokens"]
    assert a == b and a != c


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--max-new-tokens", "0"], "max_new_tokens=0"),
        (["--temperature", "-1"], "temperature=-1.0"),
        (["--top-p", "1.5"], "top_p"),
        (["--top-k", "-2"], "top_k"),
        (["--threads", "0"], "--threads=0"),
        (
            ["--prompt-file", "/nonexistent/prompt.txt"],
            "--prompt-file /nonexistent/prompt.txt: file not found",
        ),
    ],
)
def test_bad_parameters(tiny_llama, capsys, extra, needle):
    argv = ["--model", str(tiny_llama), *extra]
    if "--prompt-file" not in extra:
        argv += ["--prompt", "x"]
    rc, out, err = cli(argv, capsys)
    assert rc == 2 and out == ""
    assert err.startswith("spark-lsp generate: error: ") and needle in err and err.count("\n") == 1


def test_bad_model_and_long_prompt(tiny_llama, tmp_path, capsys):
    rc, _, err = cli(["--model", str(tmp_path / "missing"), "--prompt", "x"], capsys)
    assert rc == 2 and "missing: model folder not found" in err
    bad = copy_model(tiny_llama, tmp_path / "bad")
    cfg = json.loads((bad / "config.json").read_text())
    cfg["num_key_value_heads"] = 3
    (bad / "config.json").write_text(json.dumps(cfg))
    rc, _, err = cli(["--model", str(bad), "--prompt", "x"], capsys)
    assert rc == 2 and "config.json: num_key_value_heads=3 must divide num_attention_heads=4" in err
    rc, _, err = cli(["--model", str(tiny_llama), "--prompt", "x = 1\n" * 400], capsys)
    errors = [
        line for line in err.splitlines() if ": error: " in line
    ]  # progress lines may precede
    assert rc == 2 and len(errors) == 1 and "context is 512 tokens" in errors[0]
    assert err.splitlines()[-1] == errors[0]


def test_grid_parse_errors():
    with pytest.raises(argparse.ArgumentTypeError, match="expected RxC"):
        generate_cmd.parse_grid("4by4")
    with pytest.raises(argparse.ArgumentTypeError, match="must be positive"):
        generate_cmd.parse_grid("0x4")
    assert generate_cmd.parse_grid("2X8") == (2, 8)


@pytest.mark.slow
def test_console_script_end_to_end(tiny_llama, tmp_path):
    """The real entry point in a fresh process: streams text, no torch import, one-line errors."""
    env = dict(os.environ, SPARK_LSP_CACHE=str(tmp_path / "cache"))
    code = (
        "import sys; from spark_lsp.cli import main; rc = main(sys.argv[1:]); "
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'torch imported'; sys.exit(rc)"
    )
    ok = subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            "generate",
            "--model",
            str(tiny_llama),
            "--prompt",
            PROMPT,
            "--max-new-tokens",
            "8",
            "--json",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert ok.returncode == 0, ok.stderr
    assert len(json.loads(ok.stdout)["tokens"]) >= 1
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "spark_lsp.cli",
            "generate",
            "--model",
            str(tmp_path / "nope"),
            "--prompt",
            "x",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert (
        bad.stderr.strip().endswith("nope: model folder not found") and bad.stderr.count("\n") == 1
    )
