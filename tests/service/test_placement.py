"""Placing documents on engine shards (``engine.service.placement``), without Ray: each document
stays where its KV prefix is, documents spread evenly even when they hash alike, and only a failed
shard's documents move."""

from engine.service import placement


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_documents_stay_on_their_shard_and_spread_even_when_they_hash_alike():
    clock = Clock()
    shards = placement.Shards([None, None], clock=clock)
    # sixteen documents whose rendezvous ranking all puts shard 0 first
    keys = [k for k in (f"doc{i}" for i in range(400)) if placement.rank_shards(k, 2)[0] == 0][:16]
    placed = {k: shards.pick(k) for k in keys}
    counts = [list(placed.values()).count(i) for i in (0, 1)]
    assert counts == [8, 8], counts  # bounded by the mean: every replica gets its share
    clock.t += 5
    assert {k: shards.pick(k) for k in keys} == placed  # each stays where its prefix is

    # a failed shard: its documents move, and stay on their new shard once it is back
    moved = [k for k in keys if placed[k] == 0]
    shards.mark_down(0)
    assert all(shards.pick(k) == 1 for k in moved)
    clock.t += placement.DOWN_S + 1
    assert all(shards.pick(k) == 1 for k in moved)
    # with every document active on shard 1, a new one goes to shard 0 whatever its hash
    new = next(k for k in (f"new{i}" for i in range(400)) if placement.rank_shards(k, 2)[0] == 1)
    assert shards.pick(new) == 0


def test_idle_documents_weigh_nothing_and_are_forgotten():
    clock = Clock()
    shards = placement.Shards([None, None], clock=clock)
    keys = [k for k in (f"doc{i}" for i in range(400)) if placement.rank_shards(k, 2)[0] == 0]
    for k in keys[:8]:
        shards.pick(k)
    clock.t += placement.Shards.ACTIVE_S + 1  # nobody typed for a while: no load anywhere
    assert shards.pick(keys[8]) == 0  # its own ranking again
    clock.t += placement.Shards.FORGET_S + 1
    shards.pick("other")  # placing a document forgets the long-unused ones
    assert set(shards._placed) == {"other"}
