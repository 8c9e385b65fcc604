"""KV slots for recent sequences, so a new prompt only prefills what changed.

A slot is one preallocated KV cache plus the tokens whose KV is actually written in it (positions
0..len-1).  A request names a slot by key (e.g. a document URI); the least recently used slot is
recycled when more keys than ``capacity`` are live.  Because the KV buffer is shared between past
and present, rewinding to a common prefix is just truncating ``tokens``: later positions are
overwritten by the next run and never attended to before that.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

from .runtime import KVBuffers, Runtime


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]: bisect on slice equality (C-speed compares)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class Slot:
    """One sequence's KV cache; ``owner`` is the generation allowed to write it right now."""

    def __init__(self, key: Hashable, kv: KVBuffers) -> None:
        self.key = key
        self.kv = kv
        self.tokens: list[int] = []
        self.owner: object | None = None

    def rewind(self, prompt: list[int]) -> int:
        """Keep the longest common prefix with ``prompt`` (at least one prompt token left to run)."""
        keep = min(common_prefix(self.tokens, prompt), len(prompt) - 1)
        del self.tokens[keep:]
        return keep


class PrefixCache:
    """An LRU of :class:`Slot` objects keyed by caller-given keys (``None`` is a valid key).

    A recycled slot keeps its tokens and KV under the new key, so a request for a new key still
    reuses whatever prefix it shares with the evicted sequence.
    """

    def __init__(self, runtime: Runtime, capacity: int = 1) -> None:
        if capacity < 1:
            raise ValueError(f"slots={capacity!r} must be >= 1")
        self.runtime = runtime
        self.capacity = int(capacity)
        self._slots: OrderedDict[Hashable, Slot] = OrderedDict()

    def acquire(self, key: Hashable) -> Slot:
        """The slot for ``key`` (most recently used now); recycles the LRU slot's buffers if full."""
        slot = self._slots.get(key)
        if slot is not None:
            self._slots.move_to_end(key)
            return slot
        if len(self._slots) >= self.capacity:
            _, old = self._slots.popitem(last=False)
            old.owner = None  # a generation still iterating on it will notice and stop
            # The buffers keep their contents: the new key may well share a prefix with the old one.
            slot = Slot(key, old.kv)
            slot.tokens, old.tokens = old.tokens, []
            old.kv = None
        else:
            slot = Slot(key, self.runtime.new_kv())
        self._slots[key] = slot
        return slot

    def keys(self) -> list[Hashable]:
        return list(self._slots)

    def peek(self, key: Hashable) -> Slot | None:
        """The slot of ``key`` if it is cached, without changing the recycling order."""
        return self._slots.get(key)

    def drop(self, key: Hashable) -> bool:
        """Forget ``key``'s sequence and free its KV buffers (a generation still iterating on it
        notices and stops); False if it was not cached."""
        slot = self._slots.pop(key, None)
        if slot is None:
            return False
        slot.owner = None
        slot.tokens = []
        slot.kv = None
        return True

    def clear(self) -> None:
        for slot in self._slots.values():
            slot.owner = None
            slot.tokens.clear()
        self._slots.clear()
