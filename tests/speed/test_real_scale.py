"""Real-scale benchmarking: synthetic models of real shapes, weight bytes per token (ours and
llama.cpp's), the llama.cpp peer on the same weights, and the per-precision-class table."""

from __future__ import annotations

import functools
import json

import numpy as np
import onnx
import pytest
from onnx import numpy_helper
from safetensors.numpy import load_file

import engine.engine as engine_mod
from engine.config import load_config
from engine.engine import Engine
from engine.fim import FimFormat
from engine.generate import GenerationParams
from engine.graph import build_decoder
from engine.lab import bandwidth, bench, bench_report, models
from engine.lab.bandwidth import (
    READERS,
    gguf_bytes_per_token,
    graph_bytes_per_token,
    read_bandwidth,
)
from engine.weights import write_safetensors


def test_write_safetensors_one_tensor_at_a_time(tmp_path):
    rng = np.random.default_rng(0)
    want = {
        "a": rng.standard_normal((3, 5)).astype(np.float32),
        "b": rng.standard_normal(7).astype(np.float32),
    }
    made = []

    def make(name):
        made.append(name)
        return want[name]

    write_safetensors(
        tmp_path / "m.safetensors", {k: v.shape for k, v in want.items()}, make, "F32"
    )
    got = load_file(str(tmp_path / "m.safetensors"))
    assert made == ["a", "b"] and all(np.array_equal(got[k], want[k]) for k in want)
    with pytest.raises(ValueError, match="tensor a: shape"):
        write_safetensors(tmp_path / "x.safetensors", {"a": (2, 2)}, lambda n: want["a"], "F32")


def test_synthetic_qwen_folder_runs(tmp_path, monkeypatch):
    """A Qwen2-style synthetic model (tied 151,936-row embedding, q/k/v biases, bf16, a tokenizer
    padded to the real vocabulary, with Qwen2.5-Coder's control tokens after it) is written, loads,
    generates, and gets Qwen's fill-in-the-middle prompts."""
    spec = dict(
        models.SYNTHETIC["synthetic-qwen2.5-coder-0.5b"],
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    monkeypatch.setitem(models.SYNTHETIC, "synthetic-test", spec)
    folder = models.synthetic_model("synthetic-test", root=tmp_path)
    assert models.synthetic_model("synthetic-test", root=tmp_path) == folder  # written once
    cfg = load_config(folder)
    assert (
        cfg.architecture,
        cfg.vocab_size,
        cfg.tie_word_embeddings,
        cfg.attention_bias,
        cfg.torch_dtype,
    ) == ("qwen2", 151936, True, True, "bfloat16")
    eng = Engine.load(folder, cache_dir=tmp_path / "graphs", max_context=64, precision="int4")
    assert eng.tokenizer.token_to_id("<|fim_prefix|>") >= 151643
    assert FimFormat.detect(eng.tokenizer).style.name == "qwen"
    gen = eng.generate(list(range(300, 340)), GenerationParams(max_new_tokens=5, ignore_eos=True))
    for _ in gen:
        pass
    assert len(gen.tokens) == 5
    # a folder written before the control tokens existed gets them; its weights stay untouched
    before = (folder / "model.safetensors").stat().st_mtime_ns
    (folder / "tokenizer.json").write_text(
        models._synthetic_tokenizer(300).to_str(), encoding="utf-8"
    )
    assert models.synthetic_model("synthetic-test", root=tmp_path) == folder
    assert "<|fim_prefix|>" in (folder / "tokenizer.json").read_text(encoding="utf-8")
    assert (folder / "model.safetensors").stat().st_mtime_ns == before


@pytest.mark.parametrize("table", ["runtime", "gather"])
def test_graph_bytes_per_token_counts_what_a_step_reads(tiny_llama, tmp_path, monkeypatch, table):
    """Neither the rows the runtime reads (engine.embedding) nor a Gather's table count."""
    if table == "gather":
        monkeypatch.setattr(
            engine_mod, "build_decoder", functools.partial(build_decoder, runtime_embedding=False)
        )
    eng = Engine.load(tiny_llama, cache_dir=tmp_path, wafer=False, precision="int8")
    model = onnx.load(str(eng.graph_path))
    sizes = {t.name: numpy_helper.to_array(t).nbytes for t in model.graph.initializer}
    assert sizes.pop("rope.cos") + sizes.pop("rope.sin") > 0
    assert (sizes.pop("embed_tokens", 0) > 0) == (table == "gather")
    assert graph_bytes_per_token(eng.graph_path) == sum(sizes.values())


def test_graph_bytes_per_token_counts_a_tied_head_reading_the_embedding(tiny_llama, tmp_path):
    """fp32 on a grid: the tied LM head reads the embedding table in place, so the table counts."""
    eng = Engine.load(tiny_llama, cache_dir=tmp_path, precision="fp32")
    model = onnx.load(str(eng.graph_path))
    assert any(n.op_type == "MeshLinear" and "embed_tokens" in n.input for n in model.graph.node)
    sizes = {t.name: numpy_helper.to_array(t).nbytes for t in model.graph.initializer}
    rope = sizes.pop("rope.cos") + sizes.pop("rope.sin")
    assert rope > 0 and sizes["embed_tokens"] > 0
    assert graph_bytes_per_token(eng.graph_path) == sum(sizes.values())


def test_bandwidth_readers_read_every_element():
    """Each reader sees the whole part it is given (a bound from a reader that skipped data
    would be too high), and the bound is a finite rate from every reader's best."""
    part = np.ones(100_003, np.float32)
    part[77_777] = 3.0
    by_name = {r.__name__: r for r in READERS}
    assert by_name["_max"](part) == 3.0
    assert by_name["_dot"](part) == pytest.approx(100_002 + 9.0)
    rate = read_bandwidth(threads=2, repeats=1, nbytes=4 << 20)
    assert 0 < rate < float("inf")


@pytest.mark.parametrize("tied", [True, False])
def test_gguf_bytes_per_token(tmp_path, tied):
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("token_embd.weight", np.zeros((100, 16), np.float32))
    w.add_tensor("blk.0.attn_q.weight", np.zeros((16, 16), np.float32))
    if not tied:
        w.add_tensor("output.weight", np.zeros((100, 16), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert gguf_bytes_per_token(path) == (100 * 16 + 16 * 16) * 4


def test_peer_and_gguf_lists():
    assert bench.parse_list("llama.cpp, transformers", bench.PEERS, "--peers") == (
        "llama.cpp",
        "transformers",
    )
    assert bench.parse_list("q8_0,F32", ("F32", "Q8_0"), "--gguf") == ("Q8_0", "F32")
    with pytest.raises(ValueError, match="--gguf: unknown 'Q3'"):
        bench.parse_list("Q3", ("F32",), "--gguf")


def test_memory_bound_is_the_reader_or_a_faster_runner():
    assert bandwidth.memory_bound([30e9, 35e9], {"a": 20e9, "b": 34e9}) == (35e9, "reader")
    assert bandwidth.memory_bound([30e9, 35e9], {"a": 48e9, "b": 40e9}) == (48e9, "a")


def test_class_table_groups_runners_by_bits():
    res = {
        "bandwidth_gb_s": 20.0,
        "ours": {
            "int8": {
                "prefill_tok_s": 300,
                "decode_tok_s": 40.0,
                "ttft_ms": 1700,
                "rss_mb": 600,
                "kv_mb": 6.3,
                "bits": 8,
                "weight_mb_per_token": 500,
                "bandwidth_pct": 100.0,
            }
        },
        "peers": {
            "llama.cpp Q8_0": {
                "prefill_tok_s": 280,
                "decode_tok_s": 32.0,
                "ttft_ms": 1800,
                "rss_mb": 550,
                "bits": 8,
                "weight_mb_per_token": 525,
                "bandwidth_pct": 84.0,
            },
            "transformers": {"skipped": "not installed"},
        },
    }
    lines = bench_report.format_classes(res)
    row = next(ln for ln in lines if ln.startswith("8") and "spark-lsp int8" in ln)
    assert row.rstrip().endswith("1.25x") and "100%" in row and " 6.3 " in row
    peer = next(ln for ln in lines if "llama.cpp Q8_0" in ln)
    assert " - " in peer  # no KV figure for a peer
    assert not any("transformers" in ln for ln in lines)
    assert "the larger of two samples" in lines[1]
    res |= {"bandwidth_bound_by": "spark-lsp int8", "bandwidth_samples_gb_s": [17.5, 18.25]}
    head = bench_report.format_classes(res)[1]
    assert "what spark-lsp int8's decode streamed" in head and "(17.5, 18.2)" in head


@pytest.mark.slow
def test_llama_cpp_peer_same_weights(tiny_llama, tmp_path, monkeypatch, capsys):
    """llama.cpp runs the folder converted by its own converter, F32: the greedy tokens of our fp32
    engine; in the benchmark it gets a row in its precision class."""
    pytest.importorskip("llama_cpp")
    monkeypatch.setenv("SPARK_LSP_CACHE", str(tmp_path))
    prompt = list(range(40, 72))
    ours = Engine.load(tiny_llama, cache_dir=tmp_path / "g", wafer=False)
    want = ours.generate(prompt, GenerationParams(max_new_tokens=8, ignore_eos=True))
    for _ in want:
        pass
    from engine.lab.llama_cpp import LlamaCppPeer
    from engine.weights import weights_digest

    peer = LlamaCppPeer(
        tiny_llama,
        1,
        weights_digest(tiny_llama),
        models.bench_root(),
        "F32",
        load_config(tiny_llama).architecture,
        128,
        log=lambda m: None,
    )
    toks, dt, span = peer.timed(prompt, 8)
    assert toks == list(want.tokens) and dt > 0 and span is not None
    rc = bench.main(
        [
            "--model",
            str(tiny_llama),
            "--json",
            "--prompt-tokens",
            "32",
            "--new-tokens",
            "6",
            "--repeats",
            "1",
            "--cancels",
            "0",
            "--peers",
            "llama.cpp",
            "--gguf",
            "F32",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    res = json.loads(out)
    p = res["peers"]["llama.cpp F32"]
    assert p["bits"] == 32 and p["greedy_agreement"] == "6/6" and p["weight_mb_per_token"] > 0
    # the build's vector features are named with its figures (a build without them is weak)
    from engine.lab.llama_cpp import build_features

    built, _ = build_features()
    assert p["version"].endswith(f"({', '.join(built) or 'no SIMD features'})")
    assert res["ours"]["fp32"]["bandwidth_pct"] > 0 and res["bandwidth_gb_s"] > 0
    # the bound is the larger of the samples taken before and after the runners, or the stream
    # rate of a runner that read faster (this model's weights stay in the caches): every share
    # is then at most 100 %, and the runner that set the bound is at 100 %
    samples = res["bandwidth_samples_gb_s"]
    assert len(samples) == 2 and res["bandwidth_gb_s"] >= max(samples) - 0.01
    rows = {f"spark-lsp {x}": r for x, r in res["ours"].items()} | res["peers"]
    shares = {n: r["bandwidth_pct"] for n, r in rows.items() if "bandwidth_pct" in r}
    assert shares and max(shares.values()) <= 100.0 + 1e-6
    by = res["bandwidth_bound_by"]
    if by == "reader":
        assert res["bandwidth_gb_s"] == pytest.approx(max(samples), abs=0.01)
    else:
        assert shares[by] == pytest.approx(100.0)
    assert any("llama.cpp F32" in ln for ln in bench_report.format_classes(res))


def test_bench_lsp_precision_and_first_suggestion(tiny_llama, capsys):
    """`bench lsp --precision` reaches the server's precision setting; the first suggestion (the whole
    prompt prefilled) and the start (`--cold`: with an empty cache, so the graph is built) are
    reported beside the keystroke latencies."""
    from spark_lsp.bench import lsp as bench_lsp

    rc = bench_lsp.main(
        [
            "--model",
            str(tiny_llama),
            "--precision",
            "int8",
            "--speed",
            "20",
            "--max-chars",
            "12",
            "--cancels",
            "1",
            "--cold",
            "--json",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    res = json.loads(out)
    assert res["precision"] == "int8" and res["first_suggestion_ms"] > 0 and res["load_s"] > 0
    assert res["cold"] and res["start_to_first_suggestion_s"] > res["load_s"]
    assert res["answered"] + res["cancelled_or_superseded"] == res["keystrokes"]
    assert res["answered_early"] <= res["model_calls"]
