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
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Collection, Sequence
from itertools import repeat

from kvoffload.keys import OffloadKey
from kvoffload.policies.base import BlockStatus, CachePolicy, evictable_keys


class ARCPolicy(CachePolicy):
    name = "arc"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.target_t1 = 0.0
        self._t1: OrderedDict[OffloadKey, BlockStatus] = OrderedDict()
        self._t2: OrderedDict[OffloadKey, BlockStatus] = OrderedDict()
        self._b1: OrderedDict[OffloadKey, None] = OrderedDict()
        self._b2: OrderedDict[OffloadKey, None] = OrderedDict()

    def insert(self, key: OffloadKey, status: BlockStatus) -> None:
        self.insert_many((key,), (status,))

    def insert_many(self, keys: Sequence[OffloadKey], statuses: Sequence[BlockStatus]) -> None:
        b1, b2, t1, t2 = self._b1, self._b2, self._t1, self._t2
        if not any(map(b1.__contains__, keys)) and not any(map(b2.__contains__, keys)):
            t1.update(zip(keys, statuses))  # no ghost among them (C loops)
            return
        for key, status in zip(keys, statuses):
            if key in b1:
                del b1[key]
                t2[key] = status
            elif key in b2:
                del b2[key]
                t2[key] = status
            else:
                t1[key] = status

    def remove(self, key: OffloadKey) -> None:
        if self._t1.pop(key, None) is None:
            self._t2.pop(key, None)

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        t1, t2, b1, b2 = self._t1, self._t2, self._b1, self._b2
        t1_get, t2_move = t1.get, t2.move_to_end
        for key in reversed(keys):
            status = t1_get(key)
            if status is not None:
                if status.ref >= 0:
                    del t1[key]
                    t2[key] = status
                else:
                    t1.move_to_end(key)
            elif key in t2:
                t2_move(key)
            elif key in b1:
                delta = max(1.0, len(b2) / len(b1))
                self.target_t1 = min(self.target_t1 + delta, float(self.capacity))
            elif key in b2:
                delta = max(1.0, len(b1) / len(b2))
                self.target_t1 = max(self.target_t1 - delta, 0.0)

    def evict(self, n: int, protected: Collection[OffloadKey]) -> list[OffloadKey] | None:
        if n <= 0:
            return []
        t1, t2 = self._t1, self._t2
        if n > len(t1) + len(t2):
            return None
        # The paper takes from T1 while |T1| > p; each victim shrinks |T1| by one.
        excess = len(t1) - self.target_t1
        from_t1 = evictable_keys(t1, min(n, math.ceil(excess)) if excess > 0 else 0, protected)
        from_t2 = evictable_keys(t2, n - len(from_t1), protected)
        if len(from_t1) + len(from_t2) < n:
            from_t1 = evictable_keys(t1, n - len(from_t2), protected)
            if len(from_t1) + len(from_t2) < n:
                return None
        b1, b2 = self._b1, self._b2
        deque(map(t1.__delitem__, from_t1), maxlen=0)  # C loops
        b1.update(dict.fromkeys(from_t1))
        deque(map(t2.__delitem__, from_t2), maxlen=0)
        b2.update(dict.fromkeys(from_t2))
        _trim(b1, self.capacity)
        _trim(b2, self.capacity)
        return from_t1 + from_t2

    def clear(self) -> None:
        self.target_t1 = 0.0
        for lst in (self._t1, self._t2, self._b1, self._b2):
            lst.clear()


def _trim(ghosts: OrderedDict[OffloadKey, None], bound: int) -> None:
    excess = len(ghosts) - bound
    if excess > 0:  # the oldest ``excess`` ghosts, in a C loop
        deque(map(ghosts.popitem, repeat(False, excess)), maxlen=0)
