"""`spark-lsp wafer` and `spark-lsp bench wafer` end to end (parser built from the wafer command only,
so these tests do not depend on the other subcommands)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from spark_lsp.commands import wafer

DATA = Path(__file__).parent / "data"


def cli(capsys, *argv):
    p = argparse.ArgumentParser(prog="spark-lsp")
    wafer.register(p.add_subparsers())
    args = p.parse_args(["wafer", *argv])
    rc = args.func(args)
    out, err = capsys.readouterr()
    return rc, out, err


def test_json_has_the_promised_fields(capsys):
    rc, out, _ = cli(
        capsys,
        "--config",
        str(DATA / "llama-3-8b.json"),
        "--chip",
        "wse2",
        "--grid",
        "420x420",
        "--json",
    )
    assert rc == 0
    o = json.loads(out)
    for k in (
        "chip",
        "grid",
        "wafers",
        "pes_used",
        "sram_utilization",
        "decode_tok_s",
        "ttft_ms",
        "per_layer",
    ):
        assert k in o
    assert o["chip"] == "wse2" and o["grid"] == "420x420" and len(o["per_layer"]) == 32
    assert abs(o["decode_tok_s"] / 2700 - 1) < 0.15
    layer = o["per_layer"][5]
    assert layer["region"]["rows"] == 420 and layer["cycles"] > 0


def test_auto_grid_and_png(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "w.png"
    rc, out, _ = cli(
        capsys, "--config", str(DATA / "llama-3-70b.json"), "--png", str(png), "--json"
    )
    assert rc == 0
    o = json.loads(out)
    assert o["wafers"] >= 4 and png.stat().st_size > 10_000
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_model_folder_and_text_output(capsys, tiny_llama):
    rc, out, _ = cli(capsys, "--model", str(tiny_llama), "--chip", "wse3")
    assert rc == 0 and "projected decode" in out and "tok/s" in out


def test_custom_chip_file(capsys, tmp_path):
    spec = tmp_path / "half.toml"
    spec.write_text('base = "wse3"\nmesh_rows = 381\nmesh_cols = 586\n')
    rc, out, _ = cli(
        capsys, "--config", str(DATA / "llama-3-8b.json"), "--chip", str(spec), "--json"
    )
    assert rc == 0 and json.loads(out)["chip"] == "wse3"  # base name kept, smaller mesh
    assert json.loads(out)["chip_spec"]["mesh_rows"] == 381


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--config", "nope.json"], "not found"),
        (["--config", "DATA/llama-3-70b.json", "--grid", "64x64"], "missing .* KB per PE"),
        (["--config", "DATA/llama-3-70b.json", "--max-wafers", "2"], "missing .* wafer"),
        (["--config", "DATA/llama-3-8b.json", "--chip", "wse9"], "not a built-in chip"),
    ],
)
def test_errors_are_one_line_exit_2(capsys, argv, match):
    argv = [a.replace("DATA", str(DATA)) for a in argv]
    rc, out, err = cli(capsys, *argv)
    assert rc == 2 and out == ""
    assert err.startswith("spark-lsp wafer: error:") and err.count("\n") == 1
    import re

    assert re.search(match, err)


def test_bad_config_field_names_the_file(capsys, tmp_path):
    bad = json.loads((DATA / "llama-3-8b.json").read_text())
    bad["num_key_value_heads"] = 7
    f = tmp_path / "cfg.json"
    f.write_text(json.dumps(bad))
    rc, _, err = cli(capsys, "--config", str(f))
    assert rc == 2 and "num_key_value_heads" in err and "cfg.json" in err


@pytest.mark.parametrize("text", ["root:x:0:0:root:/root:/bin/bash\n", "[1, 2]"])
def test_a_file_that_is_not_a_config_is_named_in_the_error(capsys, tmp_path, text):
    f = tmp_path / "passwd"
    f.write_text(text)
    rc, _, err = cli(capsys, "--config", str(f))
    assert rc == 2 and err.startswith(f"spark-lsp wafer: error: {f}: ")


def test_bad_grid_rejected_by_parser(capsys):
    with pytest.raises(SystemExit):
        cli(capsys, "--config", str(DATA / "llama-3-8b.json"), "--grid", "12")
    assert "RxC" in capsys.readouterr().err


def test_bench_wafer_reports_both_speeds(tiny_qwen2, capsys):
    from engine.lab import bench_wafer as bench

    rc = bench.main(
        [
            "--model",
            str(tiny_qwen2),
            "--tokens",
            "4",
            "--rounds",
            "1",
            "--prompt-tokens",
            "8",
            "--grid",
            "3x5",
            "--threads",
            "1",
            "--json",
        ]
    )
    assert rc == 0
    o = json.loads(capsys.readouterr().out)
    assert o["greedy_tokens_identical"] is True and o["grid"] == "3x5" and o["form"] == "op"
    assert (
        o["dense_decode_tok_s"] > 0
        and o["partitioned_decode_tok_s"] > 0
        and o["ratio_of_medians"] > 0
    )
    assert o["projection"]["decode_tok_s"] > 0


def test_bench_wafer_pins_thread_spinning(tiny_qwen2, capsys, monkeypatch):
    """--no-spinning / --spinning reach both engines (auto mode can flip between rounds)."""
    from engine import Engine
    from engine.lab import bench_wafer as bench

    seen = []
    real = Engine.load.__func__

    def spy(cls, *a, **kw):
        seen.append(kw.get("spinning"))
        return real(cls, *a, **kw)

    monkeypatch.setattr(Engine, "load", classmethod(spy))
    for flag, want in (("--no-spinning", False), ("--spinning", True)):
        seen.clear()
        assert (
            bench.main(
                [
                    "--model",
                    str(tiny_qwen2),
                    "--tokens",
                    "2",
                    "--rounds",
                    "1",
                    "--prompt-tokens",
                    "8",
                    "--threads",
                    "1",
                    "--json",
                    flag,
                ]
            )
            == 0
        )
        capsys.readouterr()
        assert seen == [want, want]


def test_bench_wafer_settles_before_every_timed_run(tiny_qwen2, capsys, monkeypatch):
    """Each timed decode starts SETTLE_S after the last: threads the other engine left spinning
    must not be counted against it (the default mode swung 0.73-1.00x between runs without it)."""
    import engine.lab.bench
    from engine.lab import bench_wafer as bench

    monkeypatch.setattr(engine.lab.bench, "SETTLE_S", 0.001)
    slept = []
    monkeypatch.setattr(bench.time, "sleep", lambda s: slept.append(s))
    assert (
        bench.main(
            [
                "--model",
                str(tiny_qwen2),
                "--tokens",
                "2",
                "--rounds",
                "3",
                "--prompt-tokens",
                "8",
                "--threads",
                "1",
                "--json",
            ]
        )
        == 0
    )
    capsys.readouterr()
    assert slept.count(0.001) == 2 + 2 * 3  # the two warm-up runs, then both engines every round


def test_bench_wafer_bad_args(capsys):
    from engine.lab import bench_wafer as bench

    assert bench.main(["--rounds", "0"]) == 2
    assert "--rounds" in capsys.readouterr().err
    assert bench.main(["--tile", "attention", "--rounds", "1", "--tokens", "1"]) == 2
    assert "roles" in capsys.readouterr().err


def test_bench_wafer_standard_op_form(tiny_qwen2, capsys):
    """--form graph measures the standard-op form (Split + chained Gemm) against dense."""
    from engine.lab import bench_wafer as bench

    assert (
        bench.main(
            [
                "--model",
                str(tiny_qwen2),
                "--tokens",
                "2",
                "--rounds",
                "1",
                "--prompt-tokens",
                "8",
                "--threads",
                "1",
                "--form",
                "graph",
                "--json",
            ]
        )
        == 0
    )
    o = json.loads(capsys.readouterr().out)
    assert o["form"] == "graph" and o["greedy_tokens_identical"] is True


@pytest.mark.parametrize(
    "precision,form,want", [("int8", None, "op"), ("int4", None, "op"), ("int8", "graph", "mesh")]
)
def test_bench_wafer_quantised(tiny_qwen2, capsys, precision, form, want):
    """--precision int8/int4: the partitioned quantised linears against the fused MatMulNBits form."""
    from engine.lab import bench_wafer as bench

    argv = [
        "--model",
        str(tiny_qwen2),
        "--tokens",
        "3",
        "--rounds",
        "2",
        "--prompt-tokens",
        "8",
        "--threads",
        "1",
        "--precision",
        precision,
    ] + (["--form", form] if form else [])
    assert bench.main(argv) == 0
    out = capsys.readouterr().out
    assert (
        f"{precision}) vs fused" in out and "fused   partitioned" in out and "load average" in out
    )
    assert bench.main(argv + ["--json"]) == 0
    o = json.loads(capsys.readouterr().out)
    assert o["precision"] == precision and o["baseline"] == "fused" and o["form"] == want
    assert o["dense_decode_tok_s"] > 0 and o["partitioned_decode_tok_s"] > 0
    assert isinstance(o["greedy_tokens_identical"], bool)
    assert bench.main(argv + ["--tile", "qkv"]) == 2
    assert "--tile is for --precision fp32" in capsys.readouterr().err


def test_bench_wafer_tiles_only_what_it_is_told(tiny_qwen2, capsys):
    from engine.lab import bench_wafer as bench

    assert (
        bench.main(
            [
                "--model",
                str(tiny_qwen2),
                "--tokens",
                "2",
                "--rounds",
                "1",
                "--prompt-tokens",
                "8",
                "--threads",
                "1",
                "--tile",
                "qkv,lm_head",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "tiled: qkv,lm_head" in out and "greedy tokens identical: True" in out


def test_png_without_matplotlib_is_a_clear_error(capsys, tmp_path, monkeypatch):
    import builtins

    real = builtins.__import__

    def no_mpl(name, *a, **kw):
        if name.startswith("matplotlib"):
            raise ImportError("No module named 'matplotlib'")
        return real(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_mpl)
    rc, out, err = cli(
        capsys, "--config", str(DATA / "llama-3-8b.json"), "--png", str(tmp_path / "w.png")
    )
    assert (
        rc == 2
        and "matplotlib" in err
        and "pip install" in err
        and not (tmp_path / "w.png").exists()
    )
