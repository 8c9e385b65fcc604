"""Placing documents on engine shards (``engine.service.placement``), without Ray: each document
stays where its KV prefix is, documents spread evenly even when they hash alike, also when
several ingress replicas place them at once, and only a failed shard's documents move."""

import asyncio

from engine.service import placement


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def alike(n: int, first: int = 0, prefix: str = "doc") -> list[str]:
    """``n`` slot keys whose rendezvous ranking puts shard ``first`` first (of 2)."""
    keys = (f"{prefix}{i}" for i in range(10_000))
    return [k for k in keys if placement.rank_shards(k, 2)[0] == first][:n]


class Replicas:
    """A board over two replicas' own counts, as the Ray ingress reads them
    (``ray_ingress.ReplicaBoard``): shared by every ingress, each call a hop that lets other
    placements run in between, and a replica that can stop answering."""

    def __init__(self, clock) -> None:
        self.docs = [placement.Documents(clock), placement.Documents(clock)]
        self.silent: set[int] = set()
        self.claims = 0

    async def loads(self, up):
        await asyncio.sleep(0)
        return {i: self.docs[i].load() for i in up if i not in self.silent}

    async def claim(self, i, key, cap):
        await asyncio.sleep(0)
        self.claims += 1
        return i not in self.silent and self.docs[i].claim(key, cap)

    def used(self, i, key):
        pass  # a replica counts a document when its generation starts

    def generate(self, i, key):
        self.docs[i].use(key)


async def test_documents_stay_on_their_shard_and_spread_even_when_they_hash_alike():
    clock = Clock()
    shards = placement.Shards([None, None], clock=clock)
    keys = alike(16)  # sixteen documents whose ranking all puts shard 0 first
    placed = {k: await shards.pick(k) for k in keys}
    counts = [list(placed.values()).count(i) for i in (0, 1)]
    assert counts == [8, 8], counts  # bounded by the mean: every replica gets its share
    clock.t += 5
    assert {k: await shards.pick(k) for k in keys} == placed  # each stays where its prefix is

    # a failed shard: its documents move, and stay on their new shard once it is back
    moved = [k for k in keys if placed[k] == 0]
    shards.mark_down(0)
    assert all([await shards.pick(k) == 1 for k in moved])
    clock.t += placement.DOWN_S + 1
    assert all([await shards.pick(k) == 1 for k in moved])
    # with every document active on shard 1, a new one goes to shard 0 whatever its hash
    assert await shards.pick(alike(1, first=1, prefix="new")[0]) == 0


async def test_idle_documents_weigh_nothing_and_are_forgotten():
    clock = Clock()
    shards = placement.Shards([None, None], clock=clock)
    keys = alike(9)
    for k in keys[:8]:
        await shards.pick(k)
    clock.t += placement.ACTIVE_S + 1  # nobody typed for a while: no load anywhere
    assert await shards.pick(keys[8]) == 0  # its own ranking again
    clock.t += placement.Shards.FORGET_S + 1
    await shards.pick("other")  # placing a document forgets the long-unused ones
    assert set(shards._placed) == {"other"}


async def test_ingress_replicas_balance_on_the_replicas_counts_even_placing_at_once():
    """Two ingresses, each with three documents that all hash to shard 0: each counting its own
    would split them 2/1 and 2/1, i.e. 4 and 2 on the replicas; on the replicas' counts, read
    and claimed under each one's share while the other ingress places too, 3 and 3."""
    clock = Clock()
    board = Replicas(clock)
    a = placement.Shards([None, None], board, clock=clock)
    b = placement.Shards([None, None], board, clock=clock)
    keys = alike(6)
    got = await asyncio.gather(*(s.pick(k) for s, k in zip([a, b] * 3, keys)))
    assert sorted(got) == [0, 0, 0, 1, 1, 1], got
    assert [d.load() for d in board.docs] == [3, 3]
    assert board.claims > 6  # placements that raced had their claim refused, and went on

    # each ingress alone would have piled them up
    local = [placement.Shards([None, None], clock=clock) for _ in range(2)]
    alone = [await s.pick(k) for s, k in zip([local[0]] * 3 + [local[1]] * 3, keys)]
    assert sorted(alone) == [0, 0, 0, 0, 1, 1]


async def test_a_document_placed_twice_at_once_lands_on_one_shard():
    clock = Clock()
    board = Replicas(clock)
    shards = placement.Shards([None, None], board, clock=clock)
    board.generate(0, "other")  # shard 0 busier: where the document goes depends on the read
    got = await asyncio.gather(*(shards.pick("doc") for _ in range(4)))
    assert len(set(got)) == 1 and board.claims == 1


async def test_a_placement_cancelled_with_its_generation_leaves_the_others_a_shard():
    clock = Clock()
    board = Replicas(clock)
    shards = placement.Shards([None, None], board, clock=clock)
    first = asyncio.ensure_future(shards.pick("doc"))
    await asyncio.sleep(0)  # reading the loads
    second = asyncio.ensure_future(shards.pick("doc"))
    await asyncio.sleep(0)
    first.cancel()
    assert await second == placement.rank_shards("doc", 2)[0]
    assert first.cancelled() and not shards._placing


async def test_a_replica_that_does_not_answer_is_left_out_of_placements():
    clock = Clock()
    board = Replicas(clock)
    shards = placement.Shards([None, None], board, clock=clock)
    board.silent.add(0)
    assert all([await shards.pick(k) == 1 for k in alike(4)])  # whatever their hash
    board.silent = {0, 1}  # nobody answers: the document's own ranking, without a claim
    assert await shards.pick(alike(1, prefix="x")[0]) == 0


async def test_with_one_shard_up_nothing_is_asked():
    class Unasked:
        async def loads(self, up):
            raise AssertionError("asked the replicas' loads with one shard up")

        claim = loads

        def used(self, i, key):
            pass

    assert await placement.Shards([None], Unasked()).pick("doc") == 0
    two = placement.Shards([None, None], Unasked())
    two.mark_down(0)
    assert await two.pick("doc") == 1


def test_a_replica_takes_a_document_only_under_the_share_it_is_given():
    clock = Clock()
    docs = placement.Documents(clock)
    assert docs.claim("a", 1) and docs.load() == 1
    assert not docs.claim("b", 1)  # full at that share (another placement came first)
    assert docs.claim("a", 0)  # a document it has already is its own whatever the share
    assert docs.claim("b", 2) and docs.load() == 2
    clock.t += placement.ACTIVE_S + 1
    assert docs.load() == 0


def test_a_replica_that_nobody_asks_forgets_long_unused_documents():
    clock = Clock()
    docs = placement.Documents(clock)
    for i in range(1000):
        docs.use(f"doc{i}")
        clock.t += 1.0
    assert len(docs._used) <= 65  # about the last 30 s of them, pruned each time it passes 64
