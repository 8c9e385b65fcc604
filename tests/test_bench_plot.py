"""`spark-lsp bench all --json/--plot`: results collected from every benchmark, drawn into one PNG;
`bench NAME --plot`: one benchmark's own panels, matplotlib checked before the run."""

from __future__ import annotations

import json
import sys
import types

import pytest

from spark_lsp.bench import plot as bench_plot
from spark_lsp.cli import build_parser
from spark_lsp.commands import bench

RESULTS = {
    "model": None,
    "engine": {
        "engine": {"decode_tok_s": 1979.0},
        "peers": {
            "transformers": {"decode_tok_s": 253.0},
            "onnxruntime-genai": {"decode_tok_s": 1780.0},
        },
    },
    "edits": {
        "summary": {
            "edit": {"median_ratio": 1.18, "min_ratio": 0.88},
            "fresh": {"median_ratio": 1.43, "min_ratio": 1.42},
        }
    },
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


ENGINE_PRECISIONS = {
    "model": "/models/spark-code-mini",
    "engine": {
        "decode_tok_s": 1000.0,
        "prefill_tok_s": 9000.0,
        "ttft_cold_ms": 110.0,
        "ttft_reused_ms": 1.5,
    },
    "peers": {
        "transformers": {"decode_tok_s": 250.0, "prefill_tok_s": 4000.0},
        "onnxruntime-genai": {"skipped": "not installed"},
    },
    "precisions": {
        "fp32": {"decode_tok_s": 1000.0, "greedy_agreement_rate": 1.0},
        "int8": {"decode_tok_s": 2100.0, "greedy_agreement_rate": 0.97},
        "int4": {"decode_tok_s": 2600.0, "greedy_agreement_rate": 0.81},
    },
}


def test_single_benchmark_panels():
    ps = {
        name: (labels, values)
        for name, labels, values, _, _ in bench_plot.panels(
            {"engine": ENGINE_PRECISIONS}, detail=True
        )
    }
    assert list(ps) == [
        "engine",
        "engine-prefill",
        "engine-ttft",
        "engine-precision",
        "engine-agreement",
    ]
    assert ps["engine-prefill"] == (
        ["spark-lsp", "transformers"],
        [9000.0, 4000.0],
    )  # skipped peer left out
    assert ps["engine-precision"] == (["fp32", "int8", "int4"], [1000.0, 2100.0, 2600.0])
    assert ps["engine-agreement"][1] == pytest.approx([100.0, 97.0, 81.0])
    # `bench all` keeps one headline panel per benchmark
    assert [p[0] for p in bench_plot.panels(RESULTS)] == ["engine", "edits", "lsp", "wafer"]
    edits = dict(
        RESULTS["edits"],
        tasks=[{"task": "rename-arg", "ratio": 1.2}, {"task": "fresh-fim", "ratio": 1.4}],
    )
    wafer = dict(RESULTS["wafer"], ratio_of_medians=0.75, median_round_ratio=0.76, cpu_ratio=1.01)
    lsp = dict(RESULTS["lsp"], cancel_latency_ms_median=0.4, cancel_latency_ms_p95=1.1)
    detail = [
        p[0] for p in bench_plot.panels({"edits": edits, "wafer": wafer, "lsp": lsp}, detail=True)
    ]
    assert detail == ["edits", "edits-tasks", "lsp", "lsp-cancel", "wafer", "wafer-ratios"]


def test_service_panels():
    def timing(p50, p95):
        return {"p50": p50, "p95": p95}

    transport = {"suggestion_ms": timing(15.0, 21.0), "overhead_ms": timing(0.3, 0.4)}
    service = {
        "transports": {"inproc": transport, "ws": dict(transport, overhead_ms=timing(1.4, 2.1))},
        "ray": {
            "runs": {
                "replicas=1,editors=8": {"suggestion_ms": timing(200.0, 290.0)},
                "replicas=2,editors=16,proxy": {"suggestion_ms": timing(520.0, 750.0)},
                "replicas=1,threads=1,editors=8": {"suggestion_ms": timing(210.0, 280.0)},
            }
        },
        "memory": {
            "synthetic-qwen2.5-coder-0.5b@int4": {
                "ratio_rss": 2.06,
                "host": {"ratio_rss": 1.07},
                "host_daemon": {"ratio_rss": 1.24},
            },
            "default": {"host": {"ratio_rss": 1.12}},  # a mode not run: no bar
        },
    }
    ps = {
        n: (labels, values)
        for n, labels, values, _, _ in bench_plot.panels({"service": service}, True)
    }
    assert list(ps) == ["service", "service-overhead", "service-ray", "service-memory"]
    assert ps["service"] == (["inproc", "ws"], [15.0, 15.0])
    assert ps["service-overhead"] == (["inproc", "ws"], [0.3, 1.4])
    assert ps["service-ray"] == (["1r\n8e", "2r\n16e\nproxy", "1r 1t\n8e"], [290.0, 750.0, 280.0])
    assert ps["service-memory"] == (
        ["0.5b\ndaemon", "0.5b\nhost", "0.5b\nhost+d", "default\nhost"],
        [2.06, 1.07, 1.24, 1.12],
    )
    assert [p[0] for p in bench_plot.panels({"service": service})] == ["service"]


def test_plotter_draws_one_benchmark(tmp_path):
    out = bench_plot.plotter("engine")(ENGINE_PRECISIONS, tmp_path / "engine.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_missing_matplotlib_fails_before_the_run(monkeypatch, tmp_path, capsys):
    ran = []
    monkeypatch.setattr(
        bench, "_load", lambda name: types.SimpleNamespace(main=lambda *a, **k: ran.append(a))
    )
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    for argv in (
        ["wafer", "--plot", str(tmp_path / "w.png")],
        ["lsp", "--plot=" + str(tmp_path / "l.png")],
        ["service", "--plot", str(tmp_path / "s.png")],
        ["engine", "--model", "/nonexistent", "--plot", str(tmp_path / "e.png")],
    ):
        args = build_parser().parse_args(["bench", *argv])
        assert args.func(args) == 2
        assert "--plot needs matplotlib: pip install matplotlib" in capsys.readouterr().err
    assert ran == [] and not list(tmp_path.iterdir())
    with pytest.raises(RuntimeError, match="needs matplotlib"):
        bench_plot.draw(RESULTS, tmp_path / "x.png")


def test_dispatcher_hands_a_plotter_to_the_module(monkeypatch, tmp_path, capsys):
    seen = {}

    def main(argv, plot=None):
        seen["argv"] = argv
        return 0 if plot is None else (plot(RESULTS["wafer"], tmp_path / "w.png") and 0)

    monkeypatch.setattr(bench, "_load", lambda name: types.SimpleNamespace(main=main))
    args = build_parser().parse_args(
        ["bench", "wafer", "--rounds", "1", "--plot", str(tmp_path / "w.png")]
    )
    assert args.func(args) == 0
    assert seen["argv"] == ["--rounds", "1", "--plot", str(tmp_path / "w.png")]
    assert (tmp_path / "w.png").read_bytes()[:4] == b"\x89PNG"


def test_engine_modules_need_the_plotter_from_spark_lsp(tmp_path, capsys):
    """Run directly (python -m), the engine-side benchmarks cannot draw: a clear error, no run."""
    from engine.lab import bench as engine_bench
    from engine.lab import bench_edits
    from engine.lab import bench_wafer as wafer_bench

    for name, mod in (("engine", engine_bench), ("edits", bench_edits), ("wafer", wafer_bench)):
        assert (
            mod.main(["--model", str(tmp_path / "missing"), "--plot", str(tmp_path / "x.png")]) == 2
        )
        err = capsys.readouterr().err
        assert f"run `spark-lsp bench {name} --plot FILE`" in err and "not found" not in err
