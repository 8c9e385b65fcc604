"""Engine.load(precision=...): explicit quantised precisions, 'auto' (the measured choice), bad values."""

from __future__ import annotations

import pytest

from engine import Engine, GenerationParams
from engine.quant import PRECISIONS


def _greedy(eng, n=16):
    gen = eng.generate("def add(a, b):\n    return", GenerationParams(max_new_tokens=n, ignore_eos=True))
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


def test_auto_resolves_to_a_measured_precision_and_is_stored(tiny_llama, tmp_path):
    eng = Engine.load(tiny_llama, precision="auto", cache_dir=tmp_path)
    assert eng.precision in PRECISIONS
    assert list((tmp_path / "precision").glob("*")), "the decision is cached on disk"
    again = Engine.load(tiny_llama, precision="auto", cache_dir=tmp_path)
    assert again.precision == eng.precision


def test_unknown_precision_is_a_clear_error(tiny_llama, tmp_path):
    with pytest.raises(ValueError, match="precision='fp8'"):
        Engine.load(tiny_llama, precision="fp8", cache_dir=tmp_path)


def test_op_profile_counts_decode_runs_only(tiny_llama, tmp_path):
    """`python -m engine.quant --profile`: per-op time of the decode runs, the prompt's run left out."""
    from engine.quant import op_profile

    prof = op_profile(Engine.load(tiny_llama, precision="int8", cache_dir=tmp_path), steps=5)
    assert prof["runs"] == 5 and prof["tokens_per_run"] == 1
    assert "MatMulNBits" in prof["per_op_us"] and prof["kernel_us"] > 0
    assert abs(sum(prof["per_op_us"].values()) - prof["kernel_us"]) < 0.01 * prof["kernel_us"] + 1
