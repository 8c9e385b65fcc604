"""The server keeps its long-lived heap out of the cycle collector's reach and gives the C heap's free
pages back after a load (model_host.settle_heap)."""

import gc
import weakref

from spark_lsp.model_host import settle_heap


class _Node:
    pass


def test_settle_heap_freezes_what_is_alive_and_frees_what_a_replaced_model_left():
    node = _Node()
    node.me = node  # a reference cycle: only the cycle collector can free it
    ref = weakref.ref(node)
    try:
        settle_heap()
        assert gc.get_freeze_count() > 0
        del node  # garbage now, but frozen: full collections leave it alone
        gc.collect()
        assert ref() is not None
        settle_heap()  # the next load unfreezes first, so what the old model left is freed
        assert ref() is None
    finally:
        gc.unfreeze()


def test_settle_heap_gives_the_c_heaps_free_pages_back(monkeypatch):
    from spark_lsp import model_host

    calls = []
    monkeypatch.setattr(model_host, "trim_heap", lambda: calls.append(gc.get_freeze_count()))
    try:
        settle_heap()
        assert len(calls) == 1 and calls[0] > 0  # after the collection, what it freed included
    finally:
        gc.unfreeze()
