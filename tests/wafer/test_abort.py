"""A cancel inside a wafer op's node: the flag of a generation's ``runtime.Interrupt``, bound on
the thread that runs the graph, makes MeshLinear, MeshLinearQ and DecoderAttention skip the work
they have not started, so a cancel need not wait for a long node (ONNX Runtime itself stops only
between nodes); and nothing a cancelled run leaves behind is used."""

from __future__ import annotations

import ctypes
import threading

import numpy as np
import pytest
from op_forms import op_linear

from engine import Engine, GenerationParams
from engine.cancel import CancelToken
from engine.runtime import Interrupt
from engine.wafer import mesh_op

CODE = (
    "def fibonacci(n):\n    a, b = 0, 1\n    for i in range(n):\n        a, b = b, a + b\n"
    "    return a\n\n\ndef add(a, b):\n    return a + b\n"
)
PARAMS = GenerationParams(max_new_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module", params=["fp32", "int8", "int4"])
def engine(request, tiny_models, tmp_path_factory):
    if mesh_op.library() is None:
        pytest.skip(f"no wafer op library: {mesh_op.why_not()}")
    eng = Engine.load(
        tiny_models["llama"],
        cache_dir=tmp_path_factory.getbasetemp() / "graph_cache_abort",
        threads=2,
        linear=op_linear(request.param),
    )
    assert eng.runtime.custom_ops == (mesh_op.library(),)
    assert eng.runtime._bind_abort is not None
    return eng


@pytest.mark.parametrize("which", ["flag", "watch"])
def test_a_set_word_skips_the_ops_work(engine, which):
    """The generation's flag, or the word another process sets (a client's shared cancel flag),
    set alone: terminate unset, so the run goes to its end, unfinished."""
    rt = engine.runtime
    ids = engine.tokenizer.encode(CODE)
    want = rt.forward(rt.new_kv(), ids, 0)
    np.testing.assert_allclose(
        rt.forward(rt.new_kv(), ids, 0, interrupt=Interrupt()), want, rtol=1e-5, atol=1e-5
    )
    word = ctypes.c_int32(0)
    stop = Interrupt(word)
    np.testing.assert_allclose(
        rt.forward(rt.new_kv(), ids, 0, interrupt=stop), want, rtol=1e-5, atol=1e-5
    )
    if which == "flag":
        stop.flag.value = 1
    else:
        word.value = 1
        assert stop.watched and not stop.flag.value
    got = rt.forward(rt.new_kv(), ids, 0, interrupt=stop)
    assert not np.allclose(got, want, rtol=1e-3, atol=1e-3)


def test_the_flag_binds_to_its_own_thread(engine):
    """A set flag bound on another thread (and left bound there) stops nothing on this one."""
    rt = engine.runtime
    ids = engine.tokenizer.encode(CODE)
    want = rt.forward(rt.new_kv(), ids, 0)
    other = Interrupt()
    other.set()
    t = threading.Thread(target=rt._bind_abort, args=(other.address, None))
    t.start()
    t.join()
    np.testing.assert_allclose(rt.forward(rt.new_kv(), ids, 0), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        rt.forward(rt.new_kv(), ids, 0, interrupt=Interrupt()), want, rtol=1e-5, atol=1e-5
    )


def test_a_run_that_ends_after_its_cancel_is_not_used(engine, monkeypatch):
    """The cancel lands in a run's last node: the run ends, but its logits are not used and its
    KV is not counted (the token it would give is not emitted)."""
    prompt = engine.tokenizer.encode(CODE)
    token = CancelToken()
    real = engine.runtime._run
    runs = []

    def run_then_cancel(target, binding, interrupt):
        real(target, binding, interrupt)
        runs.append(1)
        if len(runs) == 3:  # prefill, one decode step, then the cancelled one
            token.cancel("typed")

    monkeypatch.setattr(engine.runtime, "_run", run_then_cancel)
    gen = engine.generate(prompt, PARAMS, slot="cut", cancel=token)
    gen.result()
    assert gen.finish_reason == "cancelled"
    assert len(gen.tokens) == 2
    assert engine.slot_tokens("cut") == len(prompt) + 1


def test_cancels_at_any_moment_leave_the_cache_usable(engine):
    """Whatever node a cancel cuts short, the next generation on the same slot gives the tokens
    a fresh slot gives."""
    prompt = engine.tokenizer.encode(CODE * 3)
    fresh = engine.generate(prompt, PARAMS, slot="fresh")
    fresh.result()
    for delay in (0.0, 0.0002, 0.0005, 0.001, 0.002, 0.004, 0.008):
        token = CancelToken()
        gen = engine.generate(prompt[: len(prompt) - 7], PARAMS, slot="kept", cancel=token)
        timer = threading.Timer(delay, token.cancel)
        timer.start()
        gen.result()
        timer.join()
        again = engine.generate(prompt, PARAMS, slot="kept")
        again.result()
        assert again.tokens == fresh.tokens, delay
