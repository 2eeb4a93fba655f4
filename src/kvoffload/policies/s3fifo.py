"""S3-FIFO eviction (Yang et al., "FIFO queues are all you need for cache eviction", SOSP'23).

Three FIFO queues: a small one S (a tenth of the capacity) where new keys start, a main
one M for keys that proved themselves, and a ghost queue G of keys recently dropped from
S (keys only, bounded by the capacity). Each resident key has a small use counter
(0..3) that ``touch`` raises; nothing moves on a hit, which is what makes FIFO cheap.

Eviction, one key at a time:

* while S holds more than its share (or M has nothing evictable), look at the oldest
  key of S: if it was used since it entered (counter >= ``promote_after``) it moves to M
  instead of leaving; otherwise it is evicted and remembered in G;
* otherwise look at the oldest key of M: if its counter is positive it is decremented
  and the key goes back to the new end of M (a second chance); otherwise it is evicted.

A key stored again while remembered in G enters M directly: it was dropped from S too
early. Keys that cannot be evicted (in flight, pinned, or protected by the caller) keep
their place. A failed ``evict`` forgets no key (it may have moved keys from S to M).

Mapping onto the tier protocol: keys of one store enter S in reverse call order, so the
head of a prefix leaves S after its tail (a tail is useless without its head).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence

from kvoffload.keys import OffloadKey
from kvoffload.policies.base import BlockStatus, CachePolicy, first_evictable

_MAX_FREQ = 3


class S3FIFOPolicy(CachePolicy):
    name = "s3fifo"

    def __init__(self, capacity: int, small_fraction: float = 0.1, promote_after: int = 1) -> None:
        super().__init__(capacity)
        if not 0.0 < small_fraction < 1.0:
            raise ValueError(f"small_fraction must be in (0, 1), got {small_fraction!r}")
        self.small_target = max(1, round(small_fraction * capacity))
        self.promote_after = promote_after
        self._small: OrderedDict[OffloadKey, BlockStatus] = OrderedDict()
        self._main: OrderedDict[OffloadKey, BlockStatus] = OrderedDict()
        self._ghost: OrderedDict[OffloadKey, None] = OrderedDict()
        self._freq: dict[OffloadKey, int] = {}

    def insert(self, key: OffloadKey, status: BlockStatus) -> None:
        if key in self._ghost:
            del self._ghost[key]
            self._main[key] = status
        else:
            self._small[key] = status
        self._freq[key] = 0

    def insert_many(self, keys: Sequence[OffloadKey], statuses: Sequence[BlockStatus]) -> None:
        for key, status in zip(reversed(keys), reversed(statuses)):
            self.insert(key, status)

    def remove(self, key: OffloadKey) -> None:
        if self._freq.pop(key, None) is not None and self._small.pop(key, None) is None:
            self._main.pop(key, None)

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        freq = self._freq
        for key in keys:
            count = freq.get(key)
            if count is not None and count < _MAX_FREQ:
                freq[key] = count + 1

    def evict(self, n: int, protected: Collection[OffloadKey]) -> list[OffloadKey] | None:
        if n <= 0:
            return []
        small, main, freq = self._small, self._main, self._freq
        if n > len(freq):
            return None
        victims: list[tuple[OffloadKey, BlockStatus, bool]] = []  # (key, status, from S)
        while len(victims) < n:
            key = None
            if len(small) > self.small_target or first_evictable(main, protected) is None:
                key = self._evict_small(protected)
                if key is not None:
                    victims.append((key, small.pop(key), True))
                    continue
            key = self._evict_main(protected)
            if key is None:
                key = self._evict_small(protected)
                if key is None:
                    self._restore(victims)
                    return None
                victims.append((key, small.pop(key), True))
            else:
                victims.append((key, main.pop(key), False))
        ghost = self._ghost
        out = []
        for key, _, from_small in victims:
            del freq[key]
            if from_small:
                ghost[key] = None
            out.append(key)
        while len(ghost) > self.capacity:
            ghost.popitem(last=False)
        return out

    def _evict_small(self, protected: Collection[OffloadKey]) -> OffloadKey | None:
        """The oldest evictable key of S that earned no promotion; promotes those that did."""
        small, main, freq = self._small, self._main, self._freq
        while True:
            key = first_evictable(small, protected)
            if key is None:
                return None
            if freq[key] < self.promote_after:
                return key
            main[key] = small.pop(key)
            freq[key] = 0

    def _evict_main(self, protected: Collection[OffloadKey]) -> OffloadKey | None:
        """The oldest evictable key of M with no use left; re-queues those with some."""
        main, freq = self._main, self._freq
        # Counters are at most 3, so four passes over the evictable keys always find one.
        for _ in range(_MAX_FREQ * len(main) + 1):
            key = first_evictable(main, protected)
            if key is None:
                return None
            if freq[key] == 0:
                return key
            freq[key] -= 1
            main.move_to_end(key)
        return None

    def _restore(self, victims: list[tuple[OffloadKey, BlockStatus, bool]]) -> None:
        """Put chosen victims back at the old ends of their queues, in their old order."""
        for key, status, from_small in reversed(victims):
            queue = self._small if from_small else self._main
            queue[key] = status
            queue.move_to_end(key, last=False)

    def clear(self) -> None:
        for store in (self._small, self._main, self._ghost, self._freq):
            store.clear()
