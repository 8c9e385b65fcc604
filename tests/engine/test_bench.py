"""`spark-lsp bench`: the synthetic reference model, the engine benchmark's figures, the peers, and
the dispatcher. No timing assertions — only that the measurements are made and consistent."""

from __future__ import annotations

import argparse
import json
import sys
import types

import numpy as np
import pytest

from engine.config import load_config
from engine.lab import bench_report
from engine.lab import models as lab_models
from engine.tokenizer import Tokenizer
from engine.weights import expected_shapes, load_weights
from spark_lsp.commands import bench as bench_cmd


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("SPARK_LSP_CACHE", str(tmp_path_factory.getbasetemp() / "bench_cache"))


def cli(argv, capsys):
    parser = argparse.ArgumentParser(prog="spark-lsp")
    bench_cmd.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", *argv])
    rc = args.func(args)
    out, err = capsys.readouterr()
    return rc, out, err


def test_synthetic_model_folder(tmp_path, monkeypatch):
    spec = dict(
        lab_models.SYNTHETIC["synthetic-8m"],
        hidden_size=32,
        intermediate_size=48,
        vocab_size=400,
        num_hidden_layers=2,
        max_position_embeddings=256,
    )
    monkeypatch.setitem(lab_models.SYNTHETIC, "synthetic-test", spec)
    folder = lab_models.synthetic_model("synthetic-test", root=tmp_path)
    assert lab_models.synthetic_model("synthetic-test", root=tmp_path) == folder  # cached
    cfg = load_config(folder)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size, cfg.tie_word_embeddings) == (
        32,
        2,
        400,
        False,
    )
    w = load_weights(folder, cfg)
    assert abs(float(np.std(w["model.layers.0.mlp.up_proj.weight"])) - 0.02) < 0.003
    tok = Tokenizer.load(folder)
    assert tok.vocab_size <= 400 and tok.eos_ids == {tok.token_to_id("<|endoftext|>")}
    assert tok.decode(tok.encode("def f(x): return x")) == "def f(x): return x"
    with pytest.raises(ValueError, match="unknown synthetic model"):
        lab_models.synthetic_model("synthetic-1t", root=tmp_path)


def test_reference_model_size():
    """synthetic-8m is the issue's ~8M-parameter fp32 Llama (d=256, 4 layers, d_ff=768, vocab 8192)."""
    from engine.config import ModelConfig

    s = lab_models.SYNTHETIC["synthetic-8m"]
    cfg = ModelConfig(
        "llama",
        s["vocab_size"],
        s["hidden_size"],
        s["intermediate_size"],
        s["num_hidden_layers"],
        s["num_attention_heads"],
        s["num_key_value_heads"],
        64,
        1e-5,
        1e4,
        2048,
        False,
        False,
        False,
        (0,),
        None,
        "float32",
        None,
    )
    n = sum(int(np.prod(x)) for x in expected_shapes(cfg).values())
    assert 7_000_000 < n < 9_000_000


def test_engine_bench_without_peers(tiny_llama, capsys):
    rc, out, err = cli(
        [
            "engine",
            "--model",
            str(tiny_llama),
            "--json",
            "--no-peers",
            "--prompt-tokens",
            "200",
            "--new-tokens",
            "8",
            "--repeats",
            "2",
            "--cancels",
            "3",
            "--no-wafer",
        ],
        capsys,
    )
    assert rc == 0, err
    res = json.loads(out)
    e = res["engine"]
    assert (
        res["prompt_tokens"] == 200
        and res["new_tokens"] == 8
        and res["peers"] == {}
        and res["ratios"] == {}
    )
    assert e["reused_tokens"] == 199  # one token changed at the end
    for k in ("prefill_tok_s", "decode_tok_s", "ttft_cold_ms", "ttft_reused_ms"):
        assert e[k] > 0
    for phase in ("cancel_decode", "cancel_prefill"):
        c = e[phase]
        assert c["n"] == 3 and c["median_ms"] >= 0 and c["p95_ms"] >= c["median_ms"]
    assert (
        e["cancel_decode"]["cancelled"] == 3
    )  # always mid-stream: the generation cannot end by itself


def test_engine_bench_table_and_errors(tiny_llama, capsys):
    rc, out, err = cli(
        [
            "engine",
            "--model",
            str(tiny_llama),
            "--no-peers",
            "--prompt-tokens",
            "64",
            "--new-tokens",
            "4",
            "--repeats",
            "1",
            "--cancels",
            "1",
        ],
        capsys,
    )
    assert rc == 0, err
    assert "spark-lsp" in out and "TTFT cold" in out and "cancel latency during decode" in out
    rc, out, err = cli(
        ["engine", "--model", str(tiny_llama), "--no-peers", "--prompt-tokens", "600"], capsys
    )
    assert rc == 2 and "exceed the model context (512)" in err and err.count("\n") == 1
    rc, out, err = cli(["engine", "--model", "/nonexistent", "--no-peers"], capsys)
    assert rc == 2 and "model folder not found" in err
    rc, out, err = cli(["engine", "--model", str(tiny_llama), "--grid", "bad"], capsys)
    assert rc == 2 and "--grid 'bad'" in err


def test_engine_bench_says_which_runs_decoded_without_spinning_threads(tiny_llama, capsys):
    """Each of our runs records whether it decoded on the spinning session; the table says when
    some did not (auto mode under a contended CPU would otherwise pass for a slow engine)."""
    args = ["engine", "--model", str(tiny_llama), "--no-peers", "--prompt-tokens", "32"]
    args += ["--new-tokens", "4", "--repeats", "2", "--cancels", "0", "--no-wafer"]
    rc, out, err = cli([*args, "--no-spinning"], capsys)
    assert rc == 0, err
    assert "spark-lsp fp32 decoded 2 of 2 runs without spinning threads (--no-spinning)" in out
    rc, out, err = cli([*args, "--spinning", "--json"], capsys)
    assert rc == 0, err
    assert json.loads(out)["ours"]["fp32"]["spinning_runs"] == [2, 2]
    rc, out, err = cli([*args, "--spinning"], capsys)
    assert rc == 0, err
    assert "without spinning threads" not in out


@pytest.mark.slow
def test_engine_bench_with_peers(tiny_llama, capsys):
    """Both peers run on the same weights and agree with our greedy tokens."""
    rc, out, err = cli(
        [
            "engine",
            "--model",
            str(tiny_llama),
            "--json",
            "--prompt-tokens",
            "100",
            "--new-tokens",
            "16",
            "--repeats",
            "1",
            "--cancels",
            "0",
            "--no-wafer",
            "--peers",
            "transformers,onnxruntime-genai",
        ],
        capsys,
    )
    assert rc == 0, err
    res = json.loads(out)
    for name in ("transformers", "onnxruntime-genai"):
        p = res["peers"][name]
        assert "skipped" not in p, p
        assert p["decode_tok_s"] > 0 and p["greedy_agreement"] == "16/16"
        assert res["ratios"][f"decode_tok_s_vs_{name}"] > 0
    # onnxruntime-genai also at its builder's int4 (MatMulNBits), a 4-bit runner
    q = res["peers"]["onnxruntime-genai int4"]
    assert "skipped" not in q, q
    assert q["bits"] == 4 and q["decode_tok_s"] > 0
    # ours at our fastest precision against the fastest peer at any precision
    best = res["best"]
    fastest = max((p for p in res["peers"].values()), key=lambda p: p["decode_tok_s"])
    assert best["peer_decode_tok_s"] == fastest["decode_tok_s"]
    assert best["ratio"] == pytest.approx(best["ours_decode_tok_s"] / best["peer_decode_tok_s"])
    assert "best decode at any precision" in bench_report.format_table(res)


def test_peer_unavailable_is_reported(tiny_llama, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime_genai", None)  # import fails as if not installed
    monkeypatch.setitem(sys.modules, "torch", None)
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    rc, out, err = cli(
        [
            "engine",
            "--model",
            str(tiny_llama),
            "--json",
            "--prompt-tokens",
            "32",
            "--new-tokens",
            "4",
            "--repeats",
            "1",
            "--cancels",
            "0",
        ],
        capsys,
    )
    assert rc == 0, err
    res = json.loads(out)
    assert "not installed" in res["peers"]["transformers"]["skipped"]
    assert "not installed" in res["peers"]["onnxruntime-genai"]["skipped"]
    assert all(
        "not installed" in res["peers"][f"llama.cpp {t}"]["skipped"]
        for t in ("F32", "Q8_0", "Q4_0")
    )
    assert "skipped" in err


def test_dispatcher_passes_arguments_through(capsys, monkeypatch):
    seen = {}
    fake = types.ModuleType("fake_bench")
    fake.main = lambda argv: seen.setdefault("argv", argv) and 0
    monkeypatch.setitem(sys.modules, "fake_bench", fake)
    monkeypatch.setitem(bench_cmd.MODULES, "wafer", "fake_bench")
    rc, _, _ = cli(["wafer", "--json", "--grid", "4x4", "--help"], capsys)
    assert rc == 0 and seen["argv"] == ["--json", "--grid", "4x4", "--help"]

    monkeypatch.setitem(bench_cmd.MODULES, "lsp", "no_such_module_for_bench")
    rc, out, err = cli(["lsp"], capsys)
    assert rc == 2 and "not available" in err

    # `all` runs what exists and says what is missing
    calls = []
    for name in ("engine", "edits", "wafer"):
        m = types.ModuleType(f"fake_{name}")
        m.main = (lambda n: lambda argv: calls.append((n, argv)) or 0)(name)
        monkeypatch.setitem(sys.modules, f"fake_{name}", m)
        monkeypatch.setitem(bench_cmd.MODULES, name, f"fake_{name}")
    rc, out, _ = cli(["all", "--model", "synthetic-8m"], capsys)
    assert rc == 0
    assert calls == [("engine", ["--model", "synthetic-8m"]), ("edits", []), ("wafer", [])]
    assert "=== bench lsp ===" in out and "no_such_module_for_bench is not available" in out
    calls.clear()
    rc, out, _ = cli(["all", "--model", "/models/m"], capsys)
    assert calls == [
        ("engine", ["--model", "/models/m"]),
        ("edits", ["--model", "/models/m"]),
        ("wafer", ["--model", "/models/m"]),
    ]


@pytest.mark.slow
def test_profile_splits_decode_steps_per_operator(tiny_llama, capsys):
    """`bench profile`: every decode step is profiled (prefill runs left out), per operator; the
    partitioned graph shows its mesh op (MeshLinear, one per linear) and the peer its own graph."""
    rc, out, err = cli(
        ["profile", "--model", str(tiny_llama), "--json", "--tokens", "6", "--rounds", "2"], capsys
    )
    assert rc == 0, err
    res = json.loads(out)
    dense, tiled = res["runners"]["ours, dense"], res["runners"]["ours, partitioned"]
    for r in (dense, tiled):
        assert r["steps"] == 2 * 5  # 6 tokens: 1 from the prefill, 5 decode steps, per round
        assert r["step_us"] >= r["kernel_us"] > 0
        assert (
            abs(sum(o["us_per_step"] for o in r["ops"].values()) - r["kernel_us"])
            < 0.01 * r["kernel_us"] + 1
        )
    assert (
        "MeshLinear" in tiled["ops"]
        and "MatMul" not in tiled["ops"]
        and "MeshLinear" not in dense["ops"]
    )
    assert tiled["ops"]["MeshLinear"]["nodes"] == dense["ops"]["MatMul"]["nodes"]
    # per node role: one row per role in every layer, and the linears' weight bytes and rate
    for r, op in ((dense, "MatMul"), (tiled, "MeshLinear")):
        linear = {g: row for g, row in r["groups"].items() if row["op"] == op}
        assert linear and all("#" in g or "head" in g for g in linear)
        assert all(row["mb_per_step"] > 0 and row["gb_s"] > 0 for row in linear.values())
        assert sum(row["nodes"] for row in linear.values()) == r["ops"][op]["nodes"]
        assert abs(sum(g["us_per_step"] for g in r["groups"].values()) - r["kernel_us"]) < (
            0.01 * r["kernel_us"] + 1
        )
    # the same weights, dense or partitioned (the partition pads nothing at these shapes)
    mb = [sum(g.get("mb_per_step", 0) for g in r["groups"].values()) for r in (dense, tiled)]
    assert mb[0] > 0 and mb[1] > 0
    assert res["dram_read_gb_s"] > 0
    genai = res["runners"]["onnxruntime-genai"]
    assert "skipped" not in genai, genai
    assert genai["steps"] == 2 * 5 and "MatMul" in genai["ops"]
    rc, out, err = cli(
        ["profile", "--model", str(tiny_llama), "--tokens", "3", "--rounds", "1", "--no-peers"],
        capsys,
    )
    assert rc == 0 and "executor overhead" in out and "onnxruntime-genai" not in out
    assert "per node role" in out and "share" in out
    rc, out, err = cli(["profile", "--model", str(tiny_llama), "--tokens", "1"], capsys)
    assert rc == 2 and "--tokens" in err


def test_profile_groups_roles_and_counts_weight_bytes():
    """A node's role drops its layer numbers; a weight-reading node's input bytes are its
    elements times their size, per ORT profile type name."""
    from engine.lab import bench_profile as bp

    assert bp._group("layers.12.gate_up/mesh_linear_q_glu") == "layers.#.gate_up/mesh_linear_q_glu"
    assert bp._group("lm_head/mesh_linear_q") == "lm_head/mesh_linear_q"
    shapes = [
        {"float": [1, 1, 896]},
        {"uint8": [8, 16, 256]},
        {"float16": [8, 4, 64]},
        {"int64": [3]},
    ]
    assert bp._input_bytes(shapes) == 896 * 4 + 8 * 16 * 256 + 8 * 4 * 64 * 2 + 3 * 8


def test_profile_matches_nodes_to_runs_within_each_sessions_file(tmp_path):
    """Each ONNX Runtime session writes its own profile, timed from when that session began; the
    engine's sessions begin at different moments, and which one runs a step follows the machine's
    load. A run's nodes are those of its own file: a prefill in one file whose times overlap
    another file's decode steps neither takes their nodes nor is counted as a step."""
    import json

    from engine.lab import bench_profile as bp

    def run(ts, dur):
        return {"cat": "Session", "name": "model_run", "ts": ts, "dur": dur}

    def node(ts, dur, op, name, tokens):
        shapes = [{"float": [1, tokens, 8]}]
        args = {"op_name": op, "input_type_shape": shapes}
        return {"cat": "Node", "name": f"{name}_kernel_time", "ts": ts, "dur": dur, "args": args}

    calm = [run(100, 50), node(110, 20, "MatMul", "layers.0.o/matmul", 1)]
    calm += [run(200, 50), node(205, 30, "MatMul", "layers.0.o/matmul", 1)]
    # the prefill session's clock: its run spans the decode steps' times in the other file
    wide = [run(90, 200), node(95, 150, "MatMul", "layers.0.o/matmul", bp.PROMPT_TOKENS)]
    files = []
    for name, events in (("calm", calm), ("wide", wide)):
        (tmp_path / name).write_text(json.dumps(events))
        files.append(str(tmp_path / name))
    res = bp.step_profile(files)
    assert res["steps"] == 2 and res["kernel_us"] == 25 and res["step_us"] == 50
    assert res["ops"]["MatMul"] == {"us_per_step": 25, "nodes": 1}
