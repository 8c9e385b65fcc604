"""Engine.load(precision=...): explicit quantised precisions, 'auto' (a stored decision or the static
rule, never a measurement), the decision store, bad values."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest
from op_forms import needs_op_default

import engine.engine
from engine import Engine, GenerationParams, precision
from engine.config import load_config
from engine.lab.precisions import op_profile


def _greedy(eng, n=16):
    gen = eng.generate(
        "def add(a, b):\n    return", GenerationParams(max_new_tokens=n, ignore_eos=True)
    )
    for _ in gen:
        pass
    return list(gen.tokens)


def test_int8_engine_reports_its_precision_and_generates(tiny_llama, tmp_path):
    eng = Engine.load(tiny_llama, precision="int8", cache_dir=tmp_path)
    assert eng.precision == "int8"
    assert type(eng.linear).__name__ == "QuantLinear"
    assert len(_greedy(eng)) == 16


def test_fp32_is_the_library_default(tiny_llama, tmp_path):
    eng = Engine.load(tiny_llama, cache_dir=tmp_path)
    assert eng.precision == "fp32"
    assert type(eng.linear).__name__ != "QuantLinear"


@pytest.fixture
def count_runtimes(monkeypatch):
    """How many ONNX Runtime decoders (``Runtime``s) the engine opens: one per loaded engine."""
    made = []
    real = engine.engine.Runtime

    def counting(*a, **kw):
        made.append(a[0])
        return real(*a, **kw)

    monkeypatch.setattr(engine.engine, "Runtime", counting)
    return made


def test_auto_without_a_decision_loads_exactly_one_engine(tiny_llama, tmp_path, count_runtimes):
    eng = Engine.load(tiny_llama, precision="auto", cache_dir=tmp_path)
    assert len(count_runtimes) == 1, "auto must read a decision, never measure by loading engines"
    rule = precision.static_rule(load_config(tiny_llama))
    assert eng.precision == rule.precision == "fp32"  # a 2-layer, hidden-64 model stays in cache
    assert "no stored decision" in eng.precision_reason and "static rule" in eng.precision_reason
    assert not (tmp_path / "precision").exists(), "loading never writes a decision"


def test_auto_reads_the_stored_decision(tiny_llama, tmp_path, count_runtimes):
    key = precision.decision_key(tiny_llama, wafer=True, grid=None, threads=None)
    precision.store_decision(
        key, precision.PrecisionChoice("int8", reason="measured: test"), tmp_path
    )
    eng = Engine.load(tiny_llama, precision="auto", cache_dir=tmp_path)
    assert eng.precision == "int8" and type(eng.linear).__name__ == "QuantLinear"
    assert eng.precision_reason == "measured: test" and len(count_runtimes) == 1
    # the decision belongs to this model and machine setting: another thread count has none
    other = Engine.load(tiny_llama, precision="auto", cache_dir=tmp_path, threads=1)
    assert other.precision == "fp32"


@pytest.mark.parametrize(
    "content", ["{not json", "[]", '{"format": 1, "key": "other", "choice": {}}', "WRONG_PRECISION"]
)
def test_a_corrupt_decision_is_no_decision_and_one_log_line(tiny_llama, tmp_path, caplog, content):
    key = precision.decision_key(tiny_llama)
    path = precision.store_decision(key, precision.PrecisionChoice("int8"), tmp_path)
    if content == "WRONG_PRECISION":
        data = json.loads(path.read_text())
        data["choice"]["precision"] = "fp8"
        content = json.dumps(data)
    path.write_text(content)
    with caplog.at_level(logging.WARNING, logger="engine.precision"):
        assert precision.read_decision(key, tmp_path) is None
    assert len([r for r in caplog.records if "corrupt" in r.getMessage()]) == 1
    eng = Engine.load(tiny_llama, precision="auto", cache_dir=tmp_path)
    assert eng.precision == "fp32"  # the static rule, as if nothing were stored


def test_store_is_atomic_and_leaves_no_temporary_files(tiny_llama, tmp_path):
    key = precision.decision_key(tiny_llama)
    for p in ("int4", "int8-rowq"):
        precision.store_decision(key, precision.PrecisionChoice(p), tmp_path)
        assert precision.read_decision(key, tmp_path).precision == p
    assert [f.name for f in (tmp_path / "precision").iterdir()] == [f"{key}.json"]
    with pytest.raises(ValueError, match="fp8"):
        precision.store_decision(key, precision.PrecisionChoice("fp8"), tmp_path)


def test_static_rule(tiny_llama):
    cfg = load_config(tiny_llama)
    big = dataclasses.replace(
        cfg,
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=4,
        head_dim=64,
        num_attention_heads=16,
        num_key_value_heads=16,
    )
    assert precision.linear_params(big) > precision.INT8_MIN_PARAMS > precision.linear_params(cfg)
    assert precision.static_rule(big, frozenset({"avx2", "avx512_vnni"})).precision == "int8"
    assert precision.static_rule(big, frozenset({"asimddp"})).precision == "int8"
    avx2 = frozenset({"avx2", "fma", "f16c"})  # AVX2's 16-bit multiply-adds (MeshLinearQ's loop)
    assert precision.static_rule(big, avx2).precision == "int8"
    assert "avx2" in precision.static_rule(big, avx2).reason
    assert precision.static_rule(big, frozenset({"avx2"})).precision == "fp32"  # no FMA, F16C
    assert precision.static_rule(big, frozenset({"sse4_2", "avx"})).precision == "fp32"
    assert precision.static_rule(cfg, avx2).precision == "fp32"
    assert precision.static_rule(cfg, frozenset({"avx512_vnni"})).precision == "fp32"


def test_unknown_precision_is_a_clear_error(tiny_llama, tmp_path):
    with pytest.raises(ValueError, match="precision='fp8'"):
        Engine.load(tiny_llama, precision="fp8", cache_dir=tmp_path)


@needs_op_default
def test_op_profile_counts_decode_runs_only(tiny_llama, tmp_path):
    """`python -m engine.lab.precisions --profile`: per-op time of the decode runs, not the prompt's."""
    prof = op_profile(Engine.load(tiny_llama, precision="int8", cache_dir=tmp_path), steps=5)
    assert prof["runs"] == 5 and prof["tokens_per_run"] == 1
    assert "MeshLinearQ" in prof["per_op_us"] and prof["kernel_us"] > 0  # int8 on the default grid
    assert abs(sum(prof["per_op_us"].values()) - prof["kernel_us"]) < 0.01 * prof["kernel_us"] + 1
