"""Adaptive Replacement Cache (Megiddo and Modha, FAST'03).

Resident keys live in T1 (seen once) or T2 (seen at least twice); B1 and B2 remember
keys recently evicted from each (ghosts, no data), each bounded by the capacity. The
target size ``p`` of T1 adapts on ghost hits as in the paper: a hit in B1 grows it by
``max(1, |B2|/|B1|)``, a hit in B2 shrinks it by ``max(1, |B1|/|B2|)``.

Mapping onto the tier protocol: a ghost hit is seen by ``touch`` (the request names the
key before storing it), which adapts ``p``; when such a key is stored again it enters T2,
as the paper's "move x to the MRU of T2". A key touched while its store is in flight is
not a second access: it stays in T1. Eviction takes the LRU end of T1 while ``|T1| > p``,
else of T2; when the preferred list has nothing evictable it takes from the other.

The four lists are ``kvoffload.policies.blocks.Order`` lists (a ghost keeps its old
status, never read); ``touch``, ``insert_many`` and ``evict`` are one call each into them
(C loops where ``kvoffload.policies._blocks`` was built).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from kvoffload.keys import OffloadKey
from kvoffload.policies.base import BlockStatus, CachePolicy
from kvoffload.policies.blocks import Order


class ARCPolicy(CachePolicy):
    name = "arc"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.target_t1 = 0.0
        self._t1 = Order()  # least recent first (C lists where built)
        self._t2 = Order()
        self._t1_resident = self._t1.table  # key -> BlockStatus, for readers
        self._t2_resident = self._t2.table
        self._b1 = Order()  # ghosts: keys only (their statuses are not read again)
        self._b2 = Order()

    def insert(self, key: OffloadKey, status: BlockStatus) -> None:
        self.insert_many((key,), (status,))

    def insert_many(self, keys: Sequence[OffloadKey], statuses: Sequence[BlockStatus]) -> None:
        self._t1.arc_insert(self._t2, self._b1, self._b2, keys, statuses)  # a ghost's key to T2

    def remove(self, key: OffloadKey) -> None:
        if not self._t1.remove(key):
            self._t2.remove(key)

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        # walking the keys backwards: T1's idle ones to T2's recent end, T1's in-flight ones
        # and T2's to their list's recent end; ghost hits adapt the target, in that order
        self.target_t1 = self._t1.arc_touch(
            self._t2, self._b1, self._b2, keys, self.target_t1, float(self.capacity)
        )

    def evict(self, n: int, protected: Collection[OffloadKey]) -> list[OffloadKey] | None:
        if n <= 0:
            return []
        if n > len(self._t1) + len(self._t2):
            return None
        return self._t1.arc_evict(self._t2, self._b1, self._b2, n, protected, self.target_t1, self.capacity)

    def clear(self) -> None:
        self.target_t1 = 0.0
        for lst in (self._t1, self._t2, self._b1, self._b2):
            lst.clear()
