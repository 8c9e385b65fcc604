"""Cancellation tokens (engine.cancel) and a generation stopped by its caller's token."""

from __future__ import annotations

import pytest
from engine_helpers import load_engine, random_ids

from engine import Cancelled, CancelToken, GenerationParams
from engine.speculative import generate as speculative_generate


@pytest.fixture(scope="module")
def eng(tiny_llama, tmp_path_factory):
    return load_engine(tiny_llama, tmp_path_factory)


def test_token_cancels_once_with_its_reason_and_runs_callbacks():
    token, seen = CancelToken(), []
    token.on_cancel(seen.append)
    token.check()  # not cancelled: no error
    assert token.cancel("superseded") and not token.cancel("again")
    assert token.cancelled and token.reason == "superseded" and seen == ["superseded"]
    late = []
    token.on_cancel(late.append)  # registered after the cancel: runs at once
    assert late == ["superseded"]
    with pytest.raises(Cancelled, match="superseded"):
        token.check()


def test_a_child_stops_with_its_parent_never_the_other_way():
    parent = CancelToken()
    early = parent.child()
    assert early.cancel("done early") and not parent.cancelled
    child = parent.child()
    parent.cancel("user typed")
    assert child.cancelled and child.reason == "user typed"
    assert early.reason == "done early"  # already cancelled: keeps its own reason
    assert parent.child().reason == "user typed"  # a child of a cancelled token starts cancelled


@pytest.mark.parametrize("speculative", [False, True])
def test_the_callers_token_stops_a_generation_and_its_own_cancel_leaves_the_caller(
    eng, speculative
):
    ids = random_ids(eng, 16, seed=31)
    params = GenerationParams(max_new_tokens=200, ignore_eos=True)

    def start(token):
        if speculative:
            return speculative_generate(eng, ids, params, slot="t", cancel=token)
        return eng.generate(ids, params, slot="t", cancel=token)

    job = CancelToken()
    gen = start(job)
    for i, _ in enumerate(gen):
        if i == 3:
            job.cancel("request cancelled")
    assert gen.finish_reason == "cancelled" and 3 <= len(gen.tokens) < 200
    assert gen.cancelled and gen.cancel_token.reason == "request cancelled"

    job = CancelToken()
    gen = start(job)
    next(iter(gen))
    gen.cancel()  # the generation stops on its own (e.g. its output is complete)
    assert list(gen) == [] or gen.finish_reason == "cancelled"
    assert gen.finish_reason == "cancelled" and not job.cancelled

    job = CancelToken()
    job.cancel("superseded")  # cancelled before the generation began: no step runs
    gen = start(job)
    assert list(gen) == [] and gen.finish_reason == "cancelled" and gen.tokens == []
