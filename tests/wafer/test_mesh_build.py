"""How the op library is compiled (engine/wafer/mesh_op.py): with link-time optimisation first
(``mesh_op.LTO``: its code generation runs on every core, so a machine's first load waits less),
a plain build where the compiler cannot do it, and the same outputs from either build, bit for
bit, for every op (MeshLinear, MeshLinearQ at 8 and 4 bits, DecoderAttention over both caches)."""

from __future__ import annotations

import shlex
from pathlib import Path

import numpy as np
import pytest
from op_forms import op_linear

from engine import Engine
from engine.generate import GenerationParams
from engine.wafer import mesh_op

pytestmark = pytest.mark.slow


def _compiler(tmp_path: Path, refuse_lto: bool) -> tuple[str, Path]:
    """A compiler that logs its arguments and runs the real one; with ``refuse_lto`` it fails on
    ``-flto`` as a compiler without link-time optimisation does."""
    real = mesh_op._compiler()
    if real is None:
        pytest.fail("no C compiler")
    calls = tmp_path / "calls"
    refuse = (
        'case " $* " in *" -flto"*) echo "cc: error: unsupported option -flto" >&2; exit 1;; esac\n'
        if refuse_lto
        else ""
    )
    script = tmp_path / "cc"
    script.write_text(
        f'#!/bin/sh\necho "$*" >> {shlex.quote(str(calls))}\n{refuse}'
        f'exec {shlex.quote(real)} "$@"\n'
    )
    script.chmod(0o755)
    return str(script), calls


def _self_tests(path: Path) -> None:
    mesh_op._self_test(str(path))
    mesh_op._self_test_quantized(str(path))
    mesh_op._self_test_attention(str(path))


def test_the_library_is_compiled_with_link_time_optimisation_first(tmp_path):
    cc, calls = _compiler(tmp_path, refuse_lto=False)
    out = mesh_op.build(tmp_path / "lto.so", ["-march=native"], cc=cc)
    first = calls.read_text().splitlines()[0].split()
    assert all(flag in first for flag in mesh_op.LTO) and str(mesh_op.SOURCE) in first
    _self_tests(out)


def test_a_compiler_without_link_time_optimisation_gets_a_plain_build(tmp_path):
    cc, calls = _compiler(tmp_path, refuse_lto=True)
    out = mesh_op.build(tmp_path / "plain.so", ["-march=native"], cc=cc)
    tried = [line.split() for line in calls.read_text().splitlines()]
    assert len(tried) == 2 and all(flag in tried[0] for flag in mesh_op.LTO)
    assert not any("-flto" in a for a in tried[1])
    assert not list(tmp_path.glob("plain.so.*.tmp"))  # the failed try left nothing behind
    _self_tests(out)


def test_a_compiler_that_fails_says_why_once_plainly(tmp_path):
    """Where both tries fail, the error is the plain build's (the one a user can act on)."""
    script = tmp_path / "cc"
    script.write_text('#!/bin/sh\necho "cc: fatal error: broken compiler ($*)" >&2\nexit 1\n')
    script.chmod(0o755)
    with pytest.raises(RuntimeError, match="broken compiler") as e:
        mesh_op.build(tmp_path / "x.so", ["-march=native"], cc=str(script))
    assert "-flto" not in str(e.value)
    assert not list(tmp_path.glob("x.so*"))


def test_lto_and_plain_builds_give_the_same_logits_bit_for_bit(tmp_path, tiny_models, monkeypatch):
    """A tiny model's wafer engine (every linear a MeshLinear / MeshLinearQ node, its attention
    DecoderAttention) gives the same logits and greedy tokens through either build."""
    cc = mesh_op._compiler()
    builds = {
        "lto": mesh_op.build(tmp_path / "lto.so", ["-march=native"], cc=cc, lto=True),
        "plain": mesh_op.build(tmp_path / "plain.so", ["-march=native"], cc=cc, lto=False),
    }
    native = mesh_op.library()
    assert native is not None and mesh_op.quantized() and mesh_op.attention(), mesh_op.why_not()
    mesh_op._native()  # ctypes' copy stays the native library's (amx(), qloop())
    monkeypatch.setenv("SPARK_LSP_AMX", "0")
    params = GenerationParams(max_new_tokens=16, ignore_eos=True)
    for precision, kv_cache in (("fp32", "float32"), ("int8", "float16"), ("int4", "float16")):
        got = {}
        for name, path in builds.items():
            monkeypatch.setattr(mesh_op, "library", lambda path=path: str(path))
            linear = op_linear(precision, grid=(2, 2))
            assert linear.custom_op_libraries == (str(path),)
            eng = Engine.load(
                tiny_models["llama"],
                linear=linear,
                cache_dir=tmp_path / "graphs",
                threads=2,
                kv_cache=kv_cache,
            )
            prompt = eng.tokenizer.encode("def add(a, b):\n    return")
            gen = eng.generate(prompt, params)
            gen.result()
            got[name] = (gen.tokens, eng.forward_logits(prompt + gen.tokens))
        assert got["lto"][0] == got["plain"][0], precision
        np.testing.assert_array_equal(got["lto"][1], got["plain"][1], err_msg=precision)
