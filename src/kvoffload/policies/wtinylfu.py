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

The segments are ``kvoffload.policies.blocks.Order`` lists and ``touch`` and ``evict`` one
call each into them, with the sketch: C loops where ``kvoffload.policies._blocks`` was
built (and the sketch its C one), the Python functions here otherwise.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from kvoffload.keys import OffloadKey
from kvoffload.policies.base import BlockStatus, CachePolicy, first_evictable
from kvoffload.policies.blocks import NATIVE, Order
from kvoffload.policies.sketch import PYTHON_VERSIONS as _SKETCH_PYTHON
from kvoffload.policies.sketch import FrequencySketch


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
        self._window, self._probation, self._protected = Order(), Order(), Order()
        # key -> BlockStatus of each segment, for readers
        self._window_resident = self._window.table
        self._probation_resident = self._probation.table
        self._protected_resident = self._protected.table

    # -- bookkeeping -----------------------------------------------------------------

    def insert(self, key: OffloadKey, status: BlockStatus) -> None:
        self._window.insert_many((key,), (status,))

    def insert_many(self, keys: Sequence[OffloadKey], statuses: Sequence[BlockStatus]) -> None:
        self._window.insert_many(keys[::-1], statuses[::-1])  # a prefix's head newest

    def remove(self, key: OffloadKey) -> None:
        for segment in (self._window, self._probation, self._protected):
            if segment.remove(key):
                return

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        wtinylfu_touch(
            self._window, self._probation, self._protected, self.sketch, keys, self.protected_target
        )

    def clear(self) -> None:
        for segment in (self._window, self._probation, self._protected):
            segment.clear()
        self.sketch.clear()

    # -- eviction --------------------------------------------------------------------

    def evict(self, n: int, protected: Collection[OffloadKey]) -> list[OffloadKey] | None:
        if n <= 0:
            return []
        if n > len(self._window) + len(self._probation) + len(self._protected):
            return None
        return wtinylfu_evict(
            self._window,
            self._probation,
            self._protected,
            self.sketch,
            n,
            protected,
            self.window_target,
            self.capacity - self.window_target,
        )


# -- the per-key paths (C versions replace them where built) ---------------------------


def wtinylfu_touch(
    window: Order,
    probation: Order,
    protected: Order,
    sketch: FrequencySketch,
    keys: Sequence[OffloadKey],
    protected_target: int,
) -> None:
    """Walking ``keys`` backwards: count each in ``sketch``; a window or protected key to its
    segment's recent end, a probation key to protected's (its overflow, oldest first, back
    to probation's recent end)."""
    increment = sketch.increment
    win, prob, prot = window.table, probation.table, protected.table
    for key in reversed(keys):
        increment(key)
        if key in win:
            win.move_to_end(key)
        elif key in prot:
            prot.move_to_end(key)
        elif key in prob:
            prot[key] = prob.pop(key)
            if len(prot) > protected_target:
                old, status = prot.popitem(last=False)
                prob[old] = status


def wtinylfu_evict(
    window_order: Order,
    probation_order: Order,
    protected_order: Order,
    sketch: FrequencySketch,
    n: int,
    protected: Collection[OffloadKey],
    window_target: int,
    main_share: int,
) -> list[OffloadKey] | None:
    """``n`` victims chosen one at a time as the module docstring says, or ``None`` with
    each chosen one back in its place (candidates admitted to probation stay there)."""
    window, probation, main_protected = window_order.table, probation_order.table, protected_order.table
    victims: list[tuple[OffloadKey, BlockStatus, dict]] = []
    while len(victims) < n:
        candidate = first_evictable(window, protected) if len(window) > window_target else None
        if candidate is not None and len(probation) + len(main_protected) < main_share:
            # The main area has room (the cache is filling up): no duel needed.
            probation[candidate] = window.pop(candidate)
            continue
        segment = probation
        main_victim = first_evictable(probation, protected)
        if main_victim is None:
            segment = main_protected
            main_victim = first_evictable(main_protected, protected)
        if candidate is not None and main_victim is not None:
            if sketch.estimate(candidate) > sketch.estimate(main_victim):
                victims.append((main_victim, segment.pop(main_victim), segment))
                probation[candidate] = window.pop(candidate)
            else:
                victims.append((candidate, window.pop(candidate), window))
        elif main_victim is not None:
            victims.append((main_victim, segment.pop(main_victim), segment))
        else:
            candidate = candidate if candidate is not None else first_evictable(window, protected)
            if candidate is None:
                for key, status, seg in reversed(victims):
                    seg[key] = status
                    seg.move_to_end(key, last=False)
                return None
            victims.append((candidate, window.pop(candidate), window))
    return [key for key, _, _ in victims]


# The Python versions, kept where the C ones replace them (tests compare the two).
PYTHON_VERSIONS = {
    "wtinylfu_touch": wtinylfu_touch,
    "wtinylfu_evict": wtinylfu_evict,
    "FrequencySketch": _SKETCH_PYTHON["FrequencySketch"],
}

if NATIVE:
    from kvoffload.policies._blocks import wtinylfu_evict, wtinylfu_touch  # type: ignore[no-redef] # noqa: E402,F811
