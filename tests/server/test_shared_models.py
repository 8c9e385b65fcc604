"""`model_host.SharedModels`: the session host's one engine per model (spark_lsp.session_host)."""

from __future__ import annotations

import threading

from engine import GenerationParams
from engine.cancel import CancelToken
from spark_lsp import model_host


def _text(model, ids, slot) -> str:
    stream = model.generate(ids, GenerationParams(max_new_tokens=6), slot, cancel=CancelToken())
    return "".join(c.text for c in stream)


def test_sessions_share_one_engine_per_model_and_precision(tiny_llama):
    shared = model_host.SharedModels(slots=4)
    started = []
    real_load = model_host.LocalModel.load

    def counting_load(*args, **kwargs):
        started.append(args)
        return real_load(*args, **kwargs)

    model_host.LocalModel.load = counting_load
    try:
        got: list = []
        threads = [
            threading.Thread(target=lambda: got.append(shared.acquire(str(tiny_llama), "fp32")))
            for _ in range(2)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        a, b = got
        other = shared.acquire(str(tiny_llama), "int8")
    finally:
        model_host.LocalModel.load = real_load
    assert len(started) == 2  # fp32 once for the two sessions that asked at once, int8 once
    assert a.engine is b.engine and other.engine is not a.engine
    assert a.tokenizer is b.tokenizer
    assert [a.needs_tuning, b.needs_tuning].count(True) <= 1  # measured once per model at most
    assert sorted((m["precision"], m["sessions"]) for m in shared.describe()) == [
        ("fp32", 2),
        ("int8", 1),
    ]
    # the same document in two sessions: two slots, the same output
    ids = a.tokenizer.encode("def add(a, b):\n    return")
    assert _text(a, ids, "file:///x.py") == _text(b, ids, "file:///x.py")
    slots = set(a.engine.cached_slots())
    assert {a.prefix + "file:///x.py", b.prefix + "file:///x.py"} <= slots
    assert a.status()["sharedBy"] == 2
    # a session's close frees its slots, not the model; the last close drops the model
    a.close()
    a.close()  # once only
    assert a.prefix + "file:///x.py" not in b.engine.cached_slots()
    assert b.prefix + "file:///x.py" in b.engine.cached_slots()
    assert b.status()["sharedBy"] == 1
    b.close()
    other.close()
    assert shared.describe() == []
    # a model asked for again after that is loaded again
    c = shared.acquire(str(tiny_llama), "fp32")
    assert c.engine is not b.engine
    c.close()


def test_a_failed_load_is_reported_to_every_waiter(tmp_path):
    shared = model_host.SharedModels()
    missing = tmp_path / "no-model"
    missing.mkdir()
    for _ in range(2):
        try:
            shared.acquire(str(missing), "auto")
        except Exception as exc:  # noqa: BLE001 - the engine's own error for a missing model
            assert "config" in str(exc).lower() or str(missing) in str(exc)
        else:
            raise AssertionError("loading an empty folder succeeded")
    assert shared.describe() == []
