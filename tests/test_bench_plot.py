"""`spark-lsp bench all --json/--plot`: results collected from every benchmark, drawn into one PNG."""

from __future__ import annotations

import json
import types

import pytest

from spark_lsp import bench_plot
from spark_lsp.commands import bench
from spark_lsp.cli import build_parser

RESULTS = {
    "model": None,
    "engine": {"engine": {"decode_tok_s": 1979.0},
               "peers": {"transformers": {"decode_tok_s": 253.0}, "onnxruntime-genai": {"decode_tok_s": 1780.0}}},
    "edits": {"summary": {"edit": {"median_ratio": 1.18, "min_ratio": 0.88},
                          "fresh": {"median_ratio": 1.43, "min_ratio": 1.42}}},
    "lsp": {"latency_ms_median": 7.9, "latency_ms_p95": 18.4},
    "wafer": {"grid": "2x2", "dense_decode_tok_s": 1691.0, "partitioned_decode_tok_s": 1262.0},
}


def test_panels_follow_the_results():
    ps = {name: (labels, values) for name, labels, values, _, _ in bench_plot.panels(RESULTS)}
    assert list(ps) == ["engine", "edits", "lsp", "wafer"]
    assert ps["engine"] == (["spark-lsp", "transformers", "ort-genai"], [1979.0, 253.0, 1780.0])
    assert ps["lsp"][1] == [7.9, 18.4]
    only_lsp = {"lsp": RESULTS["lsp"], "engine": None}
    assert [p[0] for p in bench_plot.panels(only_lsp)] == ["lsp"]


def test_draw_writes_a_png(tmp_path):
    out = bench_plot.draw(RESULTS, tmp_path / "bench.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_nothing_to_draw_is_a_clear_error(tmp_path):
    with pytest.raises(RuntimeError, match="no benchmark produced results"):
        bench_plot.draw({"model": None}, tmp_path / "x.png")


def test_bench_all_collects_json_and_plots(monkeypatch, tmp_path, capsys):
    seen = {}

    def fake(name):
        def main(argv):
            seen[name] = argv
            if name == "wafer":
                print("not json")
                return 1
            print(json.dumps(RESULTS[name]))
            return 0
        return types.SimpleNamespace(main=main)

    monkeypatch.setattr(bench, "_load", fake)
    png = tmp_path / "all.png"
    args = build_parser().parse_args(["bench", "all", "--json", "--plot", str(png)])
    rc = args.func(args)
    out = json.loads(capsys.readouterr().out)
    assert rc == 1  # the failing benchmark's exit code is kept
    assert all(argv[-1] == "--json" for argv in seen.values()) and set(seen) == set(bench.MODULES)
    assert out["engine"] == RESULTS["engine"] and out["lsp"] == RESULTS["lsp"]
    assert "printed no JSON" in out["wafer"]["error"]
    assert png.read_bytes()[:4] == b"\x89PNG"
