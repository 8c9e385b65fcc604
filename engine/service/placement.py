"""Where the Ray Serve ingress sends a document's generations: one engine shard per document
(slot key), so the replica holding its KV prefix gets all of its requests.

Rendezvous hashing ranks the shards for each key (``rank_shards``); ``Shards`` places a
document once on the first shard of its ranking that is up and under its share of the load
(consistent hashing with bounded loads), keeps it there, and moves only the documents of a
shard that failed.

The loads are the replicas' own (``Documents``: the documents each served recently), read and
claimed through a ``board``, so that every ingress replica balances on the same counts: with
each ingress counting only the documents it placed itself, two ingresses that each split an odd
number of documents could both put their extra one on the same shard (seen on 16 cores: 9 and 7
documents on 2 replicas, and the busier replica's queue set every editor's p95).  A placement
reads every shard's load, computes each shard's share (of the documents placed and those being
placed), and claims the document on the first shard of its ranking under that share; a shard
takes it only while it is still under the share (other placements may have filled it since the
read), else the next one is tried, then the loads are read again: concurrent placements from
several ingresses cannot pile onto one shard.  Plain Python (no Ray): the ingress
(``engine.service.ray_ingress``) gives ``Shards`` a board over its deployment handles; without
one, a ``LocalBoard`` counts this process's own placements.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import random
import threading
import time
from typing import Any

#: Seconds a shard that failed is tried last.
DOWN_S = 5.0


def rank_shards(key: str | None, n: int, down: set[int] = frozenset()) -> list[int]:
    """Shard indices in the order a slot key tries them: rendezvous hashing (the highest
    hash of key and shard first), shards known to be down last.  No key: a random order."""
    if not key:
        order = random.sample(range(n), n)
    else:
        order = sorted(
            range(n),
            key=lambda i: hashlib.blake2b(f"{key}\0{i}".encode(), digest_size=8).digest(),
            reverse=True,
        )
    return [i for i in order if i not in down] + [i for i in order if i in down]


#: A document counts in its shard's load while used within this many seconds.
ACTIVE_S = 30.0
#: Times a placement reads the loads and tries to claim before it settles for the least loaded.
CLAIM_TRIES = 8


class Documents:
    """The documents one shard serves, each with when it was last used: the shard's load is how
    many were used within ``ACTIVE_S``.  An engine replica holds one (``use`` on each
    generation) and answers the ingresses' ``load`` and ``claim`` from it.  Thread-safe: a
    replica counts its socket's generations from their threads and answers on its event loop."""

    def __init__(self, clock=time.monotonic) -> None:
        self._clock = clock
        self._used: dict[str, float] = {}
        self._prune_at = 64  # documents held before the long-unused ones are dropped
        self._lock = threading.RLock()  # claim = load + use, as one step

    def use(self, key: str) -> None:
        with self._lock:
            self._used[key] = self._clock()
            if len(self._used) > self._prune_at:  # also where no placement reads the load
                self._prune()
                self._prune_at = max(64, 2 * len(self._used))

    def load(self) -> int:
        with self._lock:
            self._prune()
            return len(self._used)

    def _prune(self) -> None:
        """Drop the documents not used within ``ACTIVE_S``."""
        now = self._clock()
        for k, t in list(self._used.items()):
            if now - t > ACTIVE_S:
                del self._used[k]

    def claim(self, key: str, cap: int) -> bool:
        """Take document ``key`` if this shard has fewer than ``cap`` documents (the share the
        caller computed from the loads it read) or has it already; False: other placements
        filled the shard since."""
        with self._lock:
            if key not in self._used and self.load() >= cap:
                return False
            self.use(key)
            return True


class LocalBoard:
    """A board of this process's own counts, one ``Documents`` per shard: for a single ingress
    and for tests (the Ray ingress reads the replicas' counts instead)."""

    def __init__(self, n: int, clock=time.monotonic) -> None:
        self.shards = [Documents(clock) for _ in range(n)]

    async def loads(self, up: list[int]) -> dict[int, int]:
        return {i: self.shards[i].load() for i in up}

    async def claim(self, i: int, key: str, cap: int) -> bool:
        return self.shards[i].claim(key, cap)

    def used(self, i: int, key: str) -> None:
        self.shards[i].use(key)


class Shards:
    """The engine shards' handles, which of them failed recently, and where each document is.

    A document (slot key) is placed once and then stays on its shard, which holds its KV prefix:
    the first shard of its rendezvous ranking (``rank_shards``) that is up and whose load (on the
    ``board``: the documents used in the last ``ACTIVE_S``) is under ``BALANCE`` times the mean,
    so documents that hash alike still spread over the replicas (consistent hashing with bounded
    loads).  A document whose shard fails is placed again, and stays where its prefix is now.
    """

    #: A placement is forgotten after this long unused (its KV slot is long recycled).
    FORGET_S = 3600.0
    #: A shard takes a new document while its load is under BALANCE x the mean load (rounded
    #: up).  1.0: the shards' document counts differ by at most one; a looser bound lets hashing
    #: pile up to BALANCE x the mean on one replica, whose queue then sets every editor's p95.
    BALANCE = 1.0

    def __init__(self, handles: list[Any], board: Any = None, clock=time.monotonic) -> None:
        self.handles = handles
        self.board = board if board is not None else LocalBoard(len(handles), clock)
        self._clock = clock
        self._down_until: dict[int, float] = {}
        self._placed: dict[str, tuple[int, float]] = {}  # slot key -> (shard, last used)
        self._placing: dict[str, asyncio.Future] = {}  # slot key -> its placement under way

    def mark_down(self, i: int) -> None:
        self._down_until[i] = self._clock() + DOWN_S

    def down(self) -> set[int]:
        now = self._clock()
        return {i for i, t in self._down_until.items() if t > now}

    async def pick(self, key: str | None) -> int:
        """The shard for a generation of document ``key`` (None: any shard that is up)."""
        n, down = len(self.handles), self.down()
        if not key:
            return rank_shards(None, n, down)[0]
        placed = self._placed.get(key)
        if placed is not None and placed[0] not in down:
            shard = placed[0]
        elif key in self._placing:  # the same document's placement under way: the same shard
            shard = await asyncio.shield(self._placing[key])
        else:
            self._placing[key] = future = asyncio.get_running_loop().create_future()
            placed_at: int | None = None
            try:
                shard = placed_at = await self._place(key, n, down)
            finally:
                # a placement cancelled with its generation leaves whoever waits for it the
                # document's own first shard rather than the cancellation
                del self._placing[key]
                future.set_result(rank_shards(key, n, down)[0] if placed_at is None else placed_at)
        self._placed[key] = (shard, self._clock())
        self.board.used(shard, key)
        return shard

    async def _place(self, key: str, n: int, down: set[int]) -> int:
        now = self._clock()
        for k, (_, used) in list(self._placed.items()):
            if now - used > self.FORGET_S:
                del self._placed[k]
        up = [i for i in range(n) if i not in down] or list(range(n))
        ranking = [i for i in rank_shards(key, n, down) if i in up]
        if len(ranking) == 1:  # one shard up: nothing to balance, no round trips to ask
            return ranking[0]
        load: dict[int, int] = {}
        for _ in range(CLAIM_TRIES):
            load = await self.board.loads(up)  # shards that did not answer are left out
            if not load:
                return ranking[0]
            # the documents placed by now and those this ingress is placing (this one too),
            # shared out: no shard goes over its share of them all
            share = sum(load.values()) + len(self._placing)
            cap = math.ceil(self.BALANCE * share / len(load))
            for i in ranking:
                if load.get(i, cap) < cap and await self.board.claim(i, key, cap):
                    return i
            # other placements filled every shard with room since the read: read again
        return min(ranking, key=lambda i: load.get(i, math.inf))  # the least loaded, unclaimed
