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

The queues are ``kvoffload.policies.blocks.Order`` lists (a ghost keeps its old status,
never read); the insert, touch and eviction loops run in C where
``kvoffload.policies._blocks`` was built, as the Python functions here otherwise.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from kvoffload.keys import OffloadKey
from kvoffload.policies.base import BlockStatus, CachePolicy, first_evictable
from kvoffload.policies.blocks import NATIVE, Order

_MAX_FREQ = 3


class S3FIFOPolicy(CachePolicy):
    name = "s3fifo"

    def __init__(self, capacity: int, small_fraction: float = 0.1, promote_after: int = 1) -> None:
        super().__init__(capacity)
        if not 0.0 < small_fraction < 1.0:
            raise ValueError(f"small_fraction must be in (0, 1), got {small_fraction!r}")
        self.small_target = max(1, round(small_fraction * capacity))
        self.promote_after = promote_after
        self._small, self._main, self._ghost = Order(), Order(), Order()
        self._small_resident = self._small.table  # key -> BlockStatus, for readers
        self._main_resident = self._main.table
        self._freq: dict[OffloadKey, int] = {}

    def insert(self, key: OffloadKey, status: BlockStatus) -> None:
        self.insert_many((key,), (status,))

    def insert_many(self, keys: Sequence[OffloadKey], statuses: Sequence[BlockStatus]) -> None:
        s3fifo_insert(self._small, self._main, self._ghost, self._freq, keys, statuses)

    def remove(self, key: OffloadKey) -> None:
        if self._freq.pop(key, None) is not None and not self._small.remove(key):
            self._main.remove(key)

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        bump(self._freq, keys, _MAX_FREQ)

    def evict(self, n: int, protected: Collection[OffloadKey]) -> list[OffloadKey] | None:
        if n <= 0:
            return []
        if n > len(self._freq):
            return None
        return s3fifo_evict(
            self._small,
            self._main,
            self._ghost,
            self._freq,
            n,
            protected,
            self.small_target,
            self.promote_after,
            self.capacity,
        )

    def clear(self) -> None:
        for store in (self._small, self._main, self._ghost, self._freq):
            store.clear()


def bump(freq: dict[OffloadKey, int], keys: Sequence[OffloadKey], most: int) -> None:
    """Raise the counter of each key ``freq`` holds, up to ``most``."""
    for key in keys:
        count = freq.get(key)
        if count is not None and count < most:
            freq[key] = count + 1


def s3fifo_insert(
    small: Order,
    main: Order,
    ghost: Order,
    freq: dict[OffloadKey, int],
    keys: Sequence[OffloadKey],
    statuses: Sequence[BlockStatus],
) -> None:
    """New keys, in reverse: a ghost's to M, the others to S; counters at 0."""
    if len(keys) != len(statuses):
        raise ValueError(f"{len(keys)} keys but {len(statuses)} statuses")
    for key, status in zip(reversed(keys), reversed(statuses)):
        (main if ghost.remove(key) else small).table[key] = status
        freq[key] = 0


def s3fifo_evict(
    small_order: Order,
    main_order: Order,
    ghost_order: Order,
    freq: dict[OffloadKey, int],
    n: int,
    protected: Collection[OffloadKey],
    small_target: int,
    promote_after: int,
    capacity: int,
) -> list[OffloadKey] | None:
    """``n`` victims chosen one at a time as the module docstring says, or ``None`` with
    each chosen one back in its place."""
    small, main = small_order.table, main_order.table

    def evict_small() -> OffloadKey | None:
        """The oldest evictable key of S that earned no promotion; promotes those that did."""
        while True:
            key = first_evictable(small, protected)
            if key is None or freq[key] < promote_after:
                return key
            main[key] = small.pop(key)
            freq[key] = 0

    def evict_main() -> OffloadKey | None:
        """The oldest evictable key of M with no use left; re-queues those with some."""
        for _ in range(_MAX_FREQ * len(main) + 1):  # four passes always find one
            key = first_evictable(main, protected)
            if key is None or freq[key] == 0:
                return key
            freq[key] -= 1
            main.move_to_end(key)
        return None

    victims: list[tuple[OffloadKey, BlockStatus, bool]] = []  # (key, status, from S)
    while len(victims) < n:
        if len(small) > small_target or first_evictable(main, protected) is None:
            key = evict_small()
            if key is not None:
                victims.append((key, small.pop(key), True))
                continue
        key = evict_main()
        if key is not None:
            victims.append((key, main.pop(key), False))
            continue
        key = evict_small()
        if key is None:
            for key, status, from_small in reversed(victims):  # back at the old ends, in order
                queue = small if from_small else main
                queue[key] = status
                queue.move_to_end(key, last=False)
            return None
        victims.append((key, small.pop(key), True))
    ghost = ghost_order.table
    for key, status, from_small in victims:
        del freq[key]
        if from_small:
            ghost[key] = status
    ghost_order.trim(capacity)
    return [key for key, _, _ in victims]


# The Python versions, kept where the C ones replace them (tests compare the two).
PYTHON_VERSIONS = {"bump": bump, "s3fifo_insert": s3fifo_insert, "s3fifo_evict": s3fifo_evict}

if NATIVE:
    from kvoffload.policies._blocks import bump, s3fifo_evict, s3fifo_insert  # type: ignore[no-redef] # noqa: E402,F811
