"""Turn-aware LRU: recency, plus a measured head start for conversations that came back.

The idea. In prefix-cached serving the unit of reuse is a conversation (or a session):
a request either comes back as the next turn, hitting the previous turn's prefix, or
never. Conversations that already came back are more likely to come back again, and the
time they need to be held for that is the typical gap between turns, a property of the
traffic rather than of the cache size. So every request gets a *turn level*: 0 when it
reuses nothing beyond its first block, ``l + 1`` when its reused prefix (at least two
leading blocks, resident or remembered) ends in a block stored by a level-``l`` request,
capped at ``levels - 1``. A block's level is the highest level of any request that used
it, and eviction takes the lowest

    priority = time of last use + level x G

where time counts requests (``touch`` calls) and ``G`` is the
measured turn gap: a moving average (weight ``gap_weight``) of the time between a
returning request and the last use of its prefix's deepest block. Within one level this
is plain LRU; across levels a conversation that has come back ``l`` times keeps its
blocks ``l`` gaps longer than a new one.

Two more rules:

* a request's final block is usually partial, and a partial block's id never recurs (the
  next turn's block at that position holds more tokens), so when a store ends with the
  final key of the request just touched, that key goes to a separate queue that is
  evicted first;
* a ghost list remembers the level and last-use time of the ``ghost_factor x capacity``
  most recently evicted keys, so a conversation whose blocks were evicted still counts as
  returning (and its gap is still measured) when it comes back.

The fixed configuration, the same for every trace and capacity: ``levels=4``,
``gap_weight=0.01``, ``ghost_factor=3``. The only scale, ``G``, is measured online.

Mapping onto the tier protocol: ``touch`` is a request's one use of its keys (the
scheduler touches once per request, at its match). It computes the request's level and
reserves it for each absent key it names; a key stored later takes its reservation
(level, and whether it was the touch's last key), whoever else touched or stored in
between; a key stored without one gets level 0. Reservations are bounded
(``max(capacity, 1024)`` keys, oldest dropped first). ``touch`` walks the keys in reverse
so a prefix's head is used last, and evicted last within its level. Keys in flight or
pinned, and keys the caller protects, are skipped.

With the request hooks (the scheduler's path) the request context replaces the rest of
the inference: time counts announced requests (``on_new_request``; the request's touches,
one per KV-cache group, follow it directly and share its level), and at
``on_request_finished`` the request's inserted blocks that a lower level holds (blocks it
generated, never named by its touch) take its level, and its deepest block goes to the
final queue only if the request ended with it: it inserted it and its touch named it last
(a request that went on to generate whole blocks had no partial final block). Without
the hooks (a trace replay) time counts touches and a stored key that its touch named last
is final at once.

The queues and the ghost list are ``kvoffload.policies.blocks.Order`` lists (a ghost keeps
its old status) and ``touch``, ``insert_many`` and ``evict`` are one call each into them:
C loops where ``kvoffload.policies._blocks`` was built, the Python functions here
otherwise. The index of resident and ghost keys (``known``) holds, in C, the status linked
for each key, which carries its birth level and last use; in Python, ``[birth, used]``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Iterable, Sequence, Set
from itertools import islice, takewhile

from kvoffload.keys import OffloadKey
from kvoffload.manager import RequestContext
from kvoffload.policies.base import BlockStatus, CachePolicy
from kvoffload.policies.blocks import NATIVE, Order
from kvoffload.validation import positive_int


class TurnLRUPolicy(CachePolicy):
    name = "turnlru"

    def __init__(
        self, capacity: int, levels: int = 4, gap_weight: float = 0.01, ghost_factor: float = 3.0
    ) -> None:
        super().__init__(capacity)
        positive_int("levels", levels)
        if not 0.0 < gap_weight <= 1.0:
            raise ValueError(f"gap_weight must be in (0, 1], got {gap_weight!r}")
        if ghost_factor < 0:
            raise ValueError(f"ghost_factor must be non-negative, got {ghost_factor!r}")
        self.levels = levels
        self.gap_weight = gap_weight
        self.ghost_limit = int(ghost_factor * capacity)
        # One recency order per level, then the order of final blocks, evicted first.
        self._queues: tuple[Order, ...] = tuple(Order() for _ in range(levels + 1))
        self._resident = [queue.table for queue in self._queues]  # key -> BlockStatus, for readers
        self._ghost = Order()  # recently evicted keys, least recent first
        # resident and ghost key -> its birth level and last use (the module docstring says how)
        self._index: dict = {}
        self._clock = 0
        self._gap: float | None = None
        # absent key -> (level of the request whose touch named it, named last by it)
        # (a dict: a key reserved again goes to the end, as it is popped first)
        self._reserved: dict[OffloadKey, tuple[int, bool]] = {}
        self._reserve_limit = max(capacity, 1024)
        # announced requests: id -> [level, keys its touches named last]
        self._running: dict[str, tuple[list[int], set[OffloadKey]]] = {}
        self._current: str | None = None  # the request announced last (its touches follow)

    @property
    def turn_gap(self) -> float | None:
        """The measured gap between turns, in requests (``None`` before the first return)."""
        return self._gap

    @property
    def _level(self) -> dict[OffloadKey, int]:
        """Resident key -> the index of its queue (a copy, for readers)."""
        return {key: i for i, queue in enumerate(self._queues) for key in queue.table}

    def _queue_of(self, key: OffloadKey) -> int | None:
        for i, queue in enumerate(self._queues):
            if key in queue.table:
                return i
        return None

    # -- bookkeeping ---------------------------------------------------------------

    def insert(self, key: OffloadKey, status: BlockStatus) -> None:
        self.insert_many([key], [status])

    def insert_many(self, keys: Sequence[OffloadKey], statuses: Sequence[BlockStatus]) -> None:
        finals = self.levels if not self._running else -1  # with the hooks: at the finish
        turn_insert(
            self._queues, self._ghost, self._index, self._reserved, keys, statuses, self._clock, finals
        )

    def remove(self, key: OffloadKey) -> None:
        level = self._queue_of(key)
        if level is not None:
            self._queues[level].remove(key)
            del self._index[key]

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        if self._current is None:
            self._clock += 1  # no announced request: each touch is one
        reserved = self._reserved
        request_level, gap = turn_touch(self._queues, self._index, reserved, keys, self._clock)
        if gap is not None:
            self._gap = float(gap) if self._gap is None else self._gap + self.gap_weight * (gap - self._gap)
        if self._current is not None:
            running = self._running.get(self._current)
            if running is not None:
                running[0][0] = max(running[0][0], request_level)
                if keys:
                    running[1].add(keys[-1])
        excess = len(reserved) - self._reserve_limit
        if excess > 0:  # the oldest ``excess``, in a C loop
            deque(map(reserved.pop, list(islice(reserved, excess))), maxlen=0)

    # -- request hooks -------------------------------------------------------------

    def on_new_request(self, request: RequestContext) -> None:
        self._clock += 1
        self._current = request.request_id
        self._running[request.request_id] = ([0], set())

    def on_request_finished(
        self,
        request: RequestContext,
        key_groups: Sequence[Sequence[OffloadKey]],
        inserted: Set[OffloadKey],
        reused: Set[OffloadKey],
    ) -> None:
        entry = self._running.pop(request.request_id, None)
        if self._current == request.request_id:
            self._current = None
        if entry is None:
            return
        (level,), named_last = entry
        queues, finals = self._queues, self.levels
        if level:
            turn_raise(queues, self._index, inserted, level, self._clock)
        for keys in key_groups:
            last = keys[-1] if keys else None
            if last in inserted and last in named_last:
                at = self._queue_of(last)
                if at is not None and at != finals:
                    queues[finals].take_from(queues[at], [last])

    # -- eviction ------------------------------------------------------------------

    def evict(self, n: int, protected: Collection[OffloadKey]) -> list[OffloadKey] | None:
        if n <= 0:
            return []
        if n > sum(map(len, self._queues)):
            return None
        return turn_evict(
            self._queues, self._ghost, self._index, n, protected, self._gap or 0.0, self.ghost_limit
        )

    def clear(self) -> None:
        for queue in self._queues:
            queue.clear()
        self._ghost.clear()
        self._index.clear()
        self._clock = 0
        self._gap = None
        self._reserved.clear()
        self._running.clear()
        self._current = None


# -- the per-key paths (C versions replace them where built) ---------------------------
# ``queues`` are the level orders, the last one the final blocks'; ``known`` holds the
# resident and the ghost keys: key -> [level it was stored at, time of its last use].


def _find(queues: Sequence[Order], key: OffloadKey) -> int | None:
    for i, queue in enumerate(queues):
        if key in queue.table:
            return i
    return None


def turn_touch(
    queues: Sequence[Order],
    known: dict,
    reserved: dict,
    keys: Sequence[OffloadKey],
    clock: int,
) -> tuple[int, int | None]:
    """A request's touch at ``clock``: its level (one above the birth level of the deepest
    of its leading known keys, when at least two; capped below the final queue) and its
    gap (``clock`` less that key's last use, else ``None``); then, walking ``keys``
    backwards, each resident one to the recent end of the queue of the higher of its level
    (0 for a final block) and the request's, used at ``clock``, and each absent one
    reserved anew (to ``reserved``' end): ``(level, whether it is keys[-1])``. Returns the
    level and the gap."""
    finals = len(queues) - 1
    leading = list(takewhile(known.__contains__, keys))
    level, gap = 0, None
    if len(leading) >= 2:
        born, used = known[leading[-1]]
        level = min(finals - 1, born + 1)
        gap = clock - used
    final = keys[-1] if keys else None
    for key in reversed(keys):
        at = _find(queues, key)
        if at is None:
            reserved.pop(key, None)
            reserved[key] = (level, key == final)
            continue
        status = queues[at].table.pop(key)
        queues[max(0 if at == finals else at, level)].table[key] = status
        known[key][1] = clock
    return level, gap


def turn_insert(
    queues: Sequence[Order],
    ghost: Order,
    known: dict,
    reserved: dict,
    keys: Sequence[OffloadKey],
    statuses: Sequence[BlockStatus],
    clock: int,
    finals: int,
) -> None:
    """Each key (out of any queue and the ghost list first) stored with its status and its
    reservation ``(level, named last)`` popped (``(0, False)`` without one): born at
    ``level``, used at ``clock``, in queue ``finals`` when named last and ``finals >= 0``,
    else in queue ``level``."""
    if len(keys) != len(statuses):
        raise ValueError(f"{len(keys)} keys but {len(statuses)} statuses")
    for key, status in zip(keys, statuses):
        level, last = reserved.pop(key, (0, False))
        at = _find(queues, key)
        if at is not None:
            del queues[at].table[key]
        known[key] = [level, clock]
        queues[finals if last and finals >= 0 else level].table[key] = status
        ghost.remove(key)


def turn_raise(
    queues: Sequence[Order], known: dict, keys: Iterable[OffloadKey], level: int, clock: int
) -> None:
    """Each resident key of a queue below ``level`` to queue ``level``'s recent end, born at
    ``level`` and used at ``clock``."""
    for key in keys:
        at = _find(queues, key)
        if at is not None and at < level:
            queues[level].table[key] = queues[at].table.pop(key)
            known[key] = [level, clock]


def turn_evict(
    queues: Sequence[Order],
    ghost: Order,
    known: dict,
    n: int,
    protected: Collection[OffloadKey],
    step: float,
    ghost_limit: int,
) -> list[OffloadKey] | None:
    """``n`` idle keys outside ``protected``: the final queue's first, then the lowest
    ``time + level x step`` of each queue's least recent (the lower level on a tie); the
    non-final ones to the ghost list (if ``ghost_limit``), trimmed to ``ghost_limit``. Or
    ``None``, changing nothing."""
    finals = len(queues) - 1
    iterators = [iter(queue.table.items()) for queue in queues]

    def advance(index: int) -> OffloadKey | None:
        for key, status in iterators[index]:
            if status.ref == 0 and key not in protected:
                return key
        return None

    heads = [advance(index) for index in range(len(queues))]
    victims: list[tuple[OffloadKey, int]] = []
    while len(victims) < n:
        pick = finals if heads[finals] is not None else -1
        if pick < 0:
            best = 0.0
            for level in range(finals):
                head = heads[level]
                if head is not None:
                    priority = known[head][1] + level * step
                    if pick < 0 or priority < best:
                        pick, best = level, priority
            if pick < 0:
                return None
        victims.append((heads[pick], pick))
        heads[pick] = advance(pick)
    for key, at in victims:
        status = queues[at].table.pop(key)
        if at != finals and ghost_limit:
            ghost.table[key] = status
        else:
            del known[key]
    while len(ghost) > ghost_limit:
        key, _ = ghost.table.popitem(last=False)
        del known[key]
    return [key for key, _ in victims]


# The Python versions, kept where the C ones replace them (tests compare the two).
PYTHON_VERSIONS = {
    "turn_touch": turn_touch,
    "turn_insert": turn_insert,
    "turn_raise": turn_raise,
    "turn_evict": turn_evict,
}

if NATIVE:
    from kvoffload.policies._blocks import (  # type: ignore[no-redef] # noqa: E402,F811
        turn_evict,
        turn_insert,
        turn_raise,
        turn_touch,
    )
