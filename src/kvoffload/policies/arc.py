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

from collections import OrderedDict
from collections.abc import Collection, Iterator, Sequence

from kvoffload.keys import OffloadKey
from kvoffload.policies.base import BlockStatus, CachePolicy


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
        if key in self._b1:
            del self._b1[key]
            self._t2[key] = status
        elif key in self._b2:
            del self._b2[key]
            self._t2[key] = status
        else:
            self._t1[key] = status

    def remove(self, key: OffloadKey) -> None:
        if self._t1.pop(key, None) is None:
            self._t2.pop(key, None)

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        t1, t2, b1, b2 = self._t1, self._t2, self._b1, self._b2
        for key in reversed(keys):
            status = t1.get(key)
            if status is not None:
                if status.ref >= 0:
                    del t1[key]
                    t2[key] = status
                else:
                    t1.move_to_end(key)
            elif key in t2:
                t2.move_to_end(key)
            elif key in b1:
                delta = max(1.0, len(b2) / len(b1))
                self.target_t1 = min(self.target_t1 + delta, float(self.capacity))
            elif key in b2:
                delta = max(1.0, len(b1) / len(b2))
                self.target_t1 = max(self.target_t1 - delta, 0.0)

    def evict(self, n: int, protected: Collection[OffloadKey]) -> list[OffloadKey] | None:
        if n <= 0:
            return []
        from_t1 = _evictable(self._t1, protected)
        from_t2 = _evictable(self._t2, protected)
        size_t1 = len(self._t1)
        victims: list[tuple[OffloadKey, bool]] = []  # (key, came from T1)
        t1_done = t2_done = False
        while len(victims) < n:
            prefer_t1 = size_t1 > self.target_t1
            key = None
            if prefer_t1 or t2_done:
                key = None if t1_done else next(from_t1, None)
                t1_done = key is None
                if key is not None:
                    size_t1 -= 1
                    victims.append((key, True))
                    continue
            if not t2_done:
                key = next(from_t2, None)
                t2_done = key is None
                if key is not None:
                    victims.append((key, False))
                    continue
            if t1_done and t2_done:
                return None
        for key, in_t1 in victims:
            if in_t1:
                del self._t1[key]
                self._b1[key] = None
            else:
                del self._t2[key]
                self._b2[key] = None
        _trim(self._b1, self.capacity)
        _trim(self._b2, self.capacity)
        return [key for key, _ in victims]

    def clear(self) -> None:
        self.target_t1 = 0.0
        for lst in (self._t1, self._t2, self._b1, self._b2):
            lst.clear()


def _evictable(
    order: OrderedDict[OffloadKey, BlockStatus], protected: Collection[OffloadKey]
) -> Iterator[OffloadKey]:
    for key, status in order.items():
        if status.ref == 0 and key not in protected:
            yield key


def _trim(ghosts: OrderedDict[OffloadKey, None], bound: int) -> None:
    while len(ghosts) > bound:
        ghosts.popitem(last=False)
