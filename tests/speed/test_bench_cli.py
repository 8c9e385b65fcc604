"""`spark-lsp bench engine --precision LIST` and `--plot FILE` on every benchmark, end to end on the
tiny model with the smallest settings (no timing assertions: speed is for the bench itself)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from op_forms import needs_op_default

from engine.lab import bench, bench_report
from spark_lsp.cli import build_parser

PNG = b"\x89PNG\r\n\x1a\n"
SMALL = [
    "--no-peers",
    "--prompt-tokens",
    "32",
    "--new-tokens",
    "6",
    "--repeats",
    "2",
    "--cancels",
    "0",
    "--threads",
    "1",
]


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("SPARK_LSP_CACHE", str(tmp_path_factory.getbasetemp() / "bench_cache"))


def cli(argv, capsys):
    args = build_parser().parse_args(["bench", *argv])
    rc = args.func(args)
    out, err = capsys.readouterr()
    return rc, out, err


def _count(s: str) -> tuple[int, int]:
    a, b = s.split("/")
    return int(a), int(b)


def test_precision_rows_json(tiny_llama, capsys):
    rc, out, err = cli(
        ["engine", "--model", str(tiny_llama), "--json", "--precision", "fp32,int8", *SMALL], capsys
    )
    assert rc == 0, err
    res = json.loads(out)
    rows = res["precisions"]
    assert list(rows) == ["fp32", "int8"]
    # the fp32 row is the engine's own figures, and the existing keys are untouched
    assert rows["fp32"]["decode_tok_s"] == res["engine"]["decode_tok_s"]
    assert rows["fp32"]["prefill_tok_s"] == res["engine"]["prefill_tok_s"]
    assert res["peers"] == {} and res["ratios"] == {}
    assert rows["fp32"]["ratios"] == {"decode_tok_s_vs_fp32": 1.0, "prefill_tok_s_vs_fp32": 1.0}
    assert rows["int8"]["ratios"]["decode_tok_s_vs_fp32"] == pytest.approx(
        rows["int8"]["decode_tok_s"] / rows["fp32"]["decode_tok_s"]
    )
    assert rows["fp32"]["emitter"] != rows["int8"]["emitter"]
    for row in rows.values():
        agree, total = _count(row["greedy_agreement"])
        assert total == 2 * 6  # every token of every prompt of the run
        assert row["greedy_agreement_rate"] == pytest.approx(agree / total)
        assert 0 <= _count(row["identical_prefix"])[0] <= total
    assert rows["fp32"]["identical_prefix"] == "12/12"  # fp32 against its own tokens
    assert "precision_auto" not in res


@needs_op_default
def test_kv_cache_runners(tiny_llama, capsys):
    """`--kv-cache float16,float32`: each precision after fp32 runs once per cache type, named
    for it, and says which cache it ran over; an unknown type is a clear error."""
    argv = ["engine", "--model", str(tiny_llama), "--json", "--precision", "int8", *SMALL]
    rc, out, err = cli([*argv, "--kv-cache", "float16,float32"], capsys)
    assert rc == 0, err
    res = json.loads(out)
    assert list(res["precisions"]) == ["fp32", "int8 kv16", "int8 kv32"]
    kv = {name: row["kv_cache"] for name, row in res["ours"].items()}
    assert kv == {"fp32": "float32", "int8 kv16": "float16", "int8 kv32": "float32"}
    assert res["ours"]["int8 kv16"]["bits"] == res["ours"]["int8 kv32"]["bits"] == 8
    # the cache one generation of the run fills (not in the RSS column): half the bytes in float16
    kv_mb = {name: row["kv_mb"] for name, row in res["ours"].items()}
    assert kv_mb["int8 kv16"] > 0 and kv_mb["int8 kv32"] == pytest.approx(2 * kv_mb["int8 kv16"])
    assert kv_mb["fp32"] == pytest.approx(kv_mb["int8 kv32"])
    rc, out, err = cli([*argv, "--kv-cache", "bf16"], capsys)
    assert rc == 2 and "--kv-cache: unknown 'bf16'" in err
    assert bench.variant_names(("int4",), ("auto", "float32")) == ["int4", "int4 kv32"]
    assert bench.parse_variant("int4 kv32") == ("int4", "float32")
    assert bench.parse_variant("int8-rowq") == ("int8-rowq", "auto")


def test_default_is_fp32_only_and_keys_stay(tiny_llama, capsys):
    rc, out, err = cli(["engine", "--model", str(tiny_llama), "--json", *SMALL], capsys)
    assert rc == 0, err
    res = json.loads(out)
    assert "precisions" not in res and "precision_auto" not in res
    assert {"engine", "peers", "ratios", "emitter", "new_tokens"} <= set(res)


def test_precision_table_with_a_peer(tiny_llama, capsys, monkeypatch):
    """Ratios to each measured peer appear per precision (a second engine stands in for a peer)."""
    from engine.engine import Engine
    from engine.lab import peers

    def fake_transformers(folder, threads):
        return bench._Ours(Engine.load(folder, threads=threads, wafer=False), "transformers")

    def no_genai(*a, **k):
        raise peers.PeerUnavailable("not installed (test)")

    monkeypatch.setattr(peers, "TransformersPeer", fake_transformers)
    monkeypatch.setattr(peers, "GenaiPeer", no_genai)
    argv = [a for a in SMALL if a != "--no-peers"] + ["--peers", "transformers,onnxruntime-genai"]
    rc, out, err = cli(
        ["engine", "--model", str(tiny_llama), "--json", "--precision", "int4", *argv], capsys
    )
    assert rc == 0, err
    res = json.loads(out)
    assert list(res["precisions"]) == ["fp32", "int4"]  # fp32 always runs: the reference
    r = res["precisions"]["int4"]["ratios"]
    assert set(r) == {
        f"{k}_vs_{p}" for k in ("decode_tok_s", "prefill_tok_s") for p in ("fp32", "transformers")
    }
    assert r["decode_tok_s_vs_transformers"] == pytest.approx(
        res["precisions"]["int4"]["decode_tok_s"] / res["peers"]["transformers"]["decode_tok_s"]
    )
    table = bench_report.format_table(res)
    assert (
        "our engine per precision" in table
        and "vs transformers" in table
        and "vs ort-genai" not in table
    )
    assert [ln.split()[0] for ln in table.splitlines()[-2:]] == ["fp32", "int4"]


def test_precision_errors(tiny_llama, capsys):
    rc, out, err = cli(
        ["engine", "--model", str(tiny_llama), "--precision", "int3", *SMALL], capsys
    )
    assert rc == 2 and "unknown precision 'int3'" in err and err.count("\n") == 1
    rc, out, err = cli(["engine", "--model", str(tiny_llama), "--precision", ",", *SMALL], capsys)
    assert rc == 2 and "comma-separated" in err
    assert bench.parse_precisions("int8, FP32,int8,int4") == ("fp32", "int8", "int4")
    assert bench.parse_precisions("auto") == ("fp32", "auto")


def test_teacher_forced_counts_the_continuation():
    """The variant reads prompt + reference[:-1]; position len(prompt)-1 predicts reference[0]."""

    class Fake:
        sample_vocab = 10

        def __init__(self, picks):
            self.picks = picks

        def forward_logits(self, ids):
            logits = np.zeros((len(ids), 12), np.float32)
            for i, t in enumerate(self.picks(ids)):
                logits[i, t] = 1.0
            return logits

    prompts, refs = [[1, 2, 3], [4, 5]], [[6, 7, 8], [9, 1]]
    # predict the next token of the full sequence: every reference token agrees
    full = [p + r for p, r in zip(prompts, refs)]
    exact = Fake(lambda ids: next(f[1 : len(ids) + 1] for f in full if f[: len(ids)] == ids))
    assert bench._teacher_forced(exact, prompts, refs) == (5, 5)
    # always token 1: only the second continuation's last token agrees
    assert bench._teacher_forced(Fake(lambda ids: [1] * len(ids)), prompts, refs) == (1, 5)
    # tokens beyond sample_vocab are never picked (the padded rows of the LM head)
    assert bench._teacher_forced(Fake(lambda ids: [11] * len(ids)), prompts, refs) == (0, 5)


@pytest.mark.parametrize(
    "name,argv",
    [
        (
            "engine",
            [
                "--no-peers",
                "--prompt-tokens",
                "32",
                "--new-tokens",
                "4",
                "--repeats",
                "1",
                "--cancels",
                "1",
                "--threads",
                "1",
                "--precision",
                "fp32,int8",
            ],
        ),
        ("edits", ["--repeats", "1", "--threads", "1", "--tasks", "rename-arg,fresh-fim"]),
        ("wafer", ["--tokens", "4", "--rounds", "1", "--prompt-tokens", "8", "--threads", "1"]),
        ("lsp", ["--speed", "20", "--max-chars", "12", "--cancels", "1"]),
    ],
)
def test_plot_on_every_benchmark(name, argv, tiny_llama, tmp_path, capsys):
    png = tmp_path / f"{name}.png"
    rc, out, err = cli([name, "--model", str(tiny_llama), *argv, "--plot", str(png)], capsys)
    assert rc == 0, err
    assert f"plot: {png}" in err
    data = png.read_bytes()
    assert data[:8] == PNG and len(data) > 5000


def test_verify_cost(tiny_llama, capsys):
    """`bench engine --verify-cost`: a pass of 1 + 8 drafted tokens timed against a single step,
    per precision as listed (no forced fp32), with the speed-up each acceptance rate implies."""
    from engine.lab import verify_cost

    rc, out, err = cli(
        [
            "engine",
            "--model",
            str(tiny_llama),
            "--verify-cost",
            "--precision",
            "int8",
            "--prompt-tokens",
            "40",
            "--acceptance",
            "0.85",
            "--json",
        ],
        capsys,
    )
    assert rc == 0, err
    res = json.loads(out)
    (name, row), *others = res["verify_cost"].items()
    assert name == "int8" and not others
    rc, out, err = cli(
        ["engine", "--model", str(tiny_llama), "--verify-cost", "--precision", "int8"]
        + ["--prompt-tokens", "40", "--kv-cache", "float32,float16", "--json"],
        capsys,
    )
    assert rc == 0, err
    assert list(json.loads(out)["verify_cost"]) == ["int8 kv32", "int8 kv16"]
    assert row["prompt_tokens"] == 40 and row["drafted"] == 8
    assert row["step_ms"] > 0 and row["pass_ms"] > 0 and row["pass_one_row_ms"] > 0
    assert row["pass_in_steps"] == pytest.approx(row["pass_ms"] / row["step_ms"])
    assert list(row["implied_speedup"]) == ["0.85", "0.5", "0.7", "0.8", "0.9"]
    want = verify_cost.expected_tokens(0.85, 8) / row["pass_in_steps"]
    assert row["implied_speedup"]["0.85"] == pytest.approx(want)
    # a pass of 9 at acceptance a yields 1 + a + ... + a^8 tokens
    assert verify_cost.expected_tokens(0.5, 8) == pytest.approx(sum(0.5**i for i in range(9)))
    assert verify_cost.expected_tokens(1.0, 8) == 9.0
    rc, out, err = cli(["engine", "--verify-cost", "--acceptance", "2", "--model", "x"], capsys)
    assert rc == 2 and "between 0 and 1" in err


def test_prepare_builds_what_a_run_needs(tiny_llama, capsys):
    """`bench engine --prepare`: our graph per precision and the peers' files are built (or
    reported skipped), nothing is measured; the same command's run then finds them cached."""
    argv = ["engine", "--model", str(tiny_llama), "--precision", "int8", "--threads", "1"]
    argv += ["--peers", "llama.cpp", "--gguf", "F32"]
    rc, out, err = cli([*argv, "--prepare"], capsys)
    assert rc == 0, err
    lines = out.splitlines()
    graphs = [ln for ln in lines if ln.startswith("spark-lsp ")]
    assert [ln.split(":")[0] for ln in graphs] == ["spark-lsp fp32", "spark-lsp int8"]
    gguf = next(ln for ln in lines if ln.startswith("llama.cpp F32:"))
    assert "skipped" in gguf or gguf.endswith("model-F32.gguf")
    assert "decode tok/s" not in out  # nothing measured
    rc, again, err = cli([*argv, "--prepare"], capsys)
    assert rc == 0 and [ln for ln in again.splitlines() if ln.startswith("llama.cpp")] == [gguf]
    assert "converting" not in again
