"""Where the Ray Serve ingress sends a document's generations: one engine shard per document
(slot key), so the replica holding its KV prefix gets all of its requests.

Rendezvous hashing ranks the shards for each key (``rank_shards``); ``Shards`` places a
document once on the first shard of its ranking that is up and under its share of the load
(consistent hashing with bounded loads), keeps it there, and moves only the documents of a
shard that failed.  Plain Python (no Ray): the ingress (``engine.service.ray_app``) holds one
``Shards`` over its deployment handles.
"""

from __future__ import annotations

import hashlib
import math
import random
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


class Shards:
    """The engine shards' handles, which of them failed recently, and where each document is.

    A document (slot key) is placed once and then stays on its shard, which holds its KV prefix:
    the first shard of its rendezvous ranking (``rank_shards``) that is up and whose load (the
    documents used in the last ``ACTIVE_S``) is under ``BALANCE`` times the mean, so documents
    that hash alike still spread over the replicas (consistent hashing with bounded loads).  A
    document whose shard fails is placed again, and stays where its prefix is now.
    """

    #: A document counts in its shard's load while used within this many seconds.
    ACTIVE_S = 30.0
    #: A placement is forgotten after this long unused (its KV slot is long recycled).
    FORGET_S = 3600.0
    #: A shard takes a new document while its load is under BALANCE x the mean load (rounded
    #: up).  1.0: the shards' document counts differ by at most one; a looser bound lets hashing
    #: pile up to BALANCE x the mean on one replica, whose queue then sets every editor's p95.
    BALANCE = 1.0

    def __init__(self, handles: list[Any], clock=time.monotonic) -> None:
        self.handles = handles
        self._clock = clock
        self._down_until: dict[int, float] = {}
        self._placed: dict[str, tuple[int, float]] = {}  # slot key -> (shard, last used)

    def mark_down(self, i: int) -> None:
        self._down_until[i] = self._clock() + DOWN_S

    def down(self) -> set[int]:
        now = self._clock()
        return {i for i, t in self._down_until.items() if t > now}

    def pick(self, key: str | None) -> int:
        """The shard for a generation of document ``key`` (None: any shard that is up)."""
        n, down, now = len(self.handles), self.down(), self._clock()
        if not key:
            return rank_shards(None, n, down)[0]
        placed = self._placed.get(key)
        if placed is not None and placed[0] not in down:
            shard = placed[0]
        else:
            shard = self._place(key, n, down, now)
        self._placed[key] = (shard, now)
        return shard

    def _place(self, key: str, n: int, down: set[int], now: float) -> int:
        for k, (_, used) in list(self._placed.items()):
            if now - used > self.FORGET_S:
                del self._placed[k]
        load = [0] * n
        for k, (i, used) in self._placed.items():
            if k != key and now - used <= self.ACTIVE_S:
                load[i] += 1
        up = [i for i in range(n) if i not in down] or list(range(n))
        cap = math.ceil(self.BALANCE * (sum(load[i] for i in up) + 1) / len(up))
        ranking = rank_shards(key, n, down)
        return next((i for i in ranking if i in up and load[i] < cap), ranking[0])
