"""W-TinyLFU eviction (Einziger, Friedman and Manes, "TinyLFU: a highly efficient cache
admission policy", ACM ToS 2017).

New keys enter a small LRU *window*; the rest of the capacity is a segmented LRU *main*
area: *probation* for keys admitted once, *protected* for keys used again while there.
Recency lives in the LRU orders, frequency in a ``FrequencySketch`` that counts every key
a request names (resident or not) and ages by halving, so it measures recent popularity.

Eviction, one key at a time: while the window is over its share, its oldest key is a
candidate for the main area and duels the main area's victim (the oldest probation key,
else the oldest protected one). The more frequent one stays; on a tie the candidate loses,
so one-time keys cannot push out keys with a history. With the window within its share,
the main area's victim is evicted directly (then the window's, if the main area has none).

A use of a probation key moves it to protected; protected overflow goes back to
probation. ``touch`` walks its keys in reverse and keys of one store enter the window in
reverse call order, so a prefix's head is more recent than its tail. Keys that cannot be
evicted (in flight, pinned, protected by the caller) keep their place; a failed ``evict``
forgets no key (candidates may have moved from the window to probation).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence

from kvoffload.keys import OffloadKey
from kvoffload.policies.base import BlockStatus, CachePolicy, first_evictable
from kvoffload.policies.sketch import FrequencySketch

_Segment = OrderedDict  # key -> BlockStatus, oldest first


class WTinyLFUPolicy(CachePolicy):
    name = "wtinylfu"

    def __init__(
        self,
        capacity: int,
        window_fraction: float = 0.01,
        protected_fraction: float = 0.8,
        sample_factor: int = 10,
        width_factor: int = 1,
    ) -> None:
        super().__init__(capacity)
        if not 0.0 < window_fraction < 1.0:
            raise ValueError(f"window_fraction must be in (0, 1), got {window_fraction!r}")
        if not 0.0 <= protected_fraction < 1.0:
            raise ValueError(f"protected_fraction must be in [0, 1), got {protected_fraction!r}")
        self.window_target = max(1, round(window_fraction * capacity))
        self.protected_target = int(protected_fraction * max(0, capacity - self.window_target))
        self.sketch = FrequencySketch(capacity, sample_factor, width_factor)
        self._window: _Segment = OrderedDict()
        self._probation: _Segment = OrderedDict()
        self._protected: _Segment = OrderedDict()

    # -- bookkeeping -----------------------------------------------------------------

    def insert(self, key: OffloadKey, status: BlockStatus) -> None:
        self._window[key] = status

    def insert_many(self, keys: Sequence[OffloadKey], statuses: Sequence[BlockStatus]) -> None:
        window = self._window
        for key, status in zip(reversed(keys), reversed(statuses)):
            window[key] = status

    def remove(self, key: OffloadKey) -> None:
        for segment in (self._window, self._probation, self._protected):
            if segment.pop(key, None) is not None:
                return

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        increment = self.sketch.increment
        window, probation, protected = self._window, self._probation, self._protected
        for key in reversed(keys):
            increment(key)
            if key in window:
                window.move_to_end(key)
            elif key in protected:
                protected.move_to_end(key)
            elif key in probation:
                protected[key] = probation.pop(key)
                if len(protected) > self.protected_target:
                    self._demote()

    def _demote(self) -> None:
        old, status = self._protected.popitem(last=False)
        self._probation[old] = status

    def clear(self) -> None:
        for segment in (self._window, self._probation, self._protected):
            segment.clear()
        self.sketch.clear()

    # -- eviction --------------------------------------------------------------------

    def evict(self, n: int, protected: Collection[OffloadKey]) -> list[OffloadKey] | None:
        if n <= 0:
            return []
        window = self._window
        if n > len(window) + len(self._probation) + len(self._protected):
            return None
        victims: list[tuple[OffloadKey, BlockStatus, _Segment]] = []
        main_share = self.capacity - self.window_target
        while len(victims) < n:
            candidate = first_evictable(window, protected) if len(window) > self.window_target else None
            if candidate is not None and len(self._probation) + len(self._protected) < main_share:
                # The main area has room (the cache is filling up): no duel needed.
                self._probation[candidate] = window.pop(candidate)
                continue
            main_victim, segment = self._main_victim(protected)
            if candidate is not None and main_victim is not None:
                estimate = self.sketch.estimate
                if estimate(candidate) > estimate(main_victim):
                    victims.append((main_victim, segment.pop(main_victim), segment))
                    self._probation[candidate] = window.pop(candidate)
                else:
                    victims.append((candidate, window.pop(candidate), window))
            elif main_victim is not None:
                victims.append((main_victim, segment.pop(main_victim), segment))
            else:
                candidate = candidate or first_evictable(window, protected)
                if candidate is None:
                    for key, status, seg in reversed(victims):
                        seg[key] = status
                        seg.move_to_end(key, last=False)
                    return None
                victims.append((candidate, window.pop(candidate), window))
        return [key for key, _, _ in victims]

    def _main_victim(self, protected: Collection[OffloadKey]) -> tuple[OffloadKey | None, _Segment]:
        key = first_evictable(self._probation, protected)
        if key is not None:
            return key, self._probation
        return first_evictable(self._protected, protected), self._protected
