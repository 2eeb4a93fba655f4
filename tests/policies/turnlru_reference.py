"""The turn-aware LRU as it was before its queues moved onto ``Order`` lists (C loops where
built): OrderedDicts walked in Python, kept as the reference its eviction order must match
(tests/policies/test_policies_turnlru_reference.py). ``kvoffload.policies.turnlru`` has the
contract."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence, Set

from kvoffload.keys import OffloadKey
from kvoffload.manager import RequestContext
from kvoffload.policies.base import BlockStatus, CachePolicy
from kvoffload.validation import positive_int


class ReferenceTurnLRU(CachePolicy):
    name = "turnlru-reference"

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
        # One recency queue per level (key -> (status, time of last use)), then the queue
        # of final blocks, evicted first.
        self._queues: list[OrderedDict[OffloadKey, tuple[BlockStatus, int]]] = [
            OrderedDict() for _ in range(levels + 1)
        ]
        self._level: dict[OffloadKey, int] = {}  # resident key -> its queue index
        self._birth: dict[OffloadKey, int] = {}  # resident key -> level it was stored at
        self._ghost: OrderedDict[OffloadKey, tuple[int, int]] = OrderedDict()  # level, time
        self._clock = 0
        self._gap: float | None = None
        # absent key -> (level of the request whose touch named it, named last by it)
        self._reserved: OrderedDict[OffloadKey, tuple[int, bool]] = OrderedDict()
        self._reserve_limit = max(capacity, 1024)
        # announced requests: id -> [level, keys its touches named last]
        self._running: dict[str, tuple[list[int], set[OffloadKey]]] = {}
        self._current: str | None = None  # the request announced last (its touches follow)

    @property
    def turn_gap(self) -> float | None:
        """The measured gap between turns, in requests (``None`` before the first return)."""
        return self._gap

    # -- bookkeeping ---------------------------------------------------------------

    def insert(self, key: OffloadKey, status: BlockStatus) -> None:
        self.insert_many([key], [status])

    def insert_many(self, keys: Sequence[OffloadKey], statuses: Sequence[BlockStatus]) -> None:
        queues, levels, ghost, clock = self._queues, self._level, self._ghost, self._clock
        births, reserved = self._birth, self._reserved
        finals = self.levels if not self._running else -1  # with the hooks: at the finish
        for key, status in zip(keys, statuses):
            old = levels.get(key)
            if old is not None:
                del queues[old][key]
            level, last = reserved.pop(key, (0, False))
            births[key] = level
            if last and finals >= 0:
                level = finals
            queues[level][key] = (status, clock)
            levels[key] = level
            ghost.pop(key, None)

    def remove(self, key: OffloadKey) -> None:
        level = self._level.pop(key, None)
        if level is not None:
            del self._queues[level][key]
            del self._birth[key]

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        if self._current is None:
            self._clock += 1  # no announced request: each touch is one
        clock = self._clock
        queues, levels, ghost = self._queues, self._level, self._ghost
        # Leading keys known (resident or remembered): the request's reuse depth.
        depth = 0
        deepest: tuple[int, int] | None = None
        for key in keys:
            queue = levels.get(key)
            if queue is not None:
                deepest = (self._birth[key], queues[queue][key][1])
            elif key in ghost:
                deepest = ghost[key]
            else:
                break
            depth += 1
        request_level = 0
        if depth >= 2 and deepest is not None:
            level, last_use = deepest
            request_level = min(self.levels - 1, level + 1)
            gap = clock - last_use
            if self._gap is None:
                self._gap = float(gap)
            else:
                self._gap += self.gap_weight * (gap - self._gap)
        running = self._running.get(self._current) if self._current is not None else None
        if running is not None:
            running[0][0] = max(running[0][0], request_level)
            if keys:
                running[1].add(keys[-1])
        reserved = self._reserved
        final = keys[-1] if keys else None
        for key in reversed(keys):
            queue = levels.get(key)
            if queue is None:
                reserved.pop(key, None)
                reserved[key] = (request_level, key == final)
                continue
            status = queues[queue].pop(key)[0]
            level = max(0 if queue == self.levels else queue, request_level)
            queues[level][key] = (status, clock)
            levels[key] = level
        while len(reserved) > self._reserve_limit:
            reserved.popitem(last=False)

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
        queues, levels, births, finals = self._queues, self._level, self._birth, self.levels
        for key in inserted:
            queue = levels.get(key)
            if queue is not None and queue < level:
                queues[level][key] = (queues[queue].pop(key)[0], self._clock)
                levels[key] = births[key] = level
        for keys in key_groups:
            last = keys[-1] if keys else None
            if last in inserted and last in named_last and levels.get(last, finals) != finals:
                queues[finals][last] = queues[levels[last]].pop(last)
                levels[last] = finals

    # -- eviction ------------------------------------------------------------------

    def evict(self, n: int, protected: Collection[OffloadKey]) -> list[OffloadKey] | None:
        if n <= 0:
            return []
        if n > len(self._level):
            return None
        queues = self._queues
        step = self._gap or 0.0
        iterators = [iter(queue.items()) for queue in queues]
        heads: list[tuple[OffloadKey, int] | None] = []

        def advance(index: int) -> tuple[OffloadKey, int] | None:
            for key, (status, last_use) in iterators[index]:
                if status.ref == 0 and key not in protected:
                    return key, last_use
            return None

        heads = [advance(index) for index in range(len(queues))]
        finals = self.levels
        victims: list[tuple[OffloadKey, int, int]] = []  # key, queue, last use
        while len(victims) < n:
            pick = finals if heads[finals] is not None else -1
            if pick < 0:
                best = 0.0
                for level in range(finals):
                    head = heads[level]
                    if head is not None:
                        priority = head[1] + level * step
                        if pick < 0 or priority < best:
                            pick, best = level, priority
                if pick < 0:
                    return None
            key, last_use = heads[pick]  # type: ignore[misc]
            victims.append((key, pick, last_use))
            heads[pick] = advance(pick)
        levels, births, ghost = self._level, self._birth, self._ghost
        for key, queue, last_use in victims:
            del queues[queue][key]
            del levels[key]
            birth = births.pop(key)
            if queue != finals and self.ghost_limit:
                ghost[key] = (birth, last_use)
                ghost.move_to_end(key)
        while len(ghost) > self.ghost_limit:
            ghost.popitem(last=False)
        return [key for key, _, _ in victims]

    def clear(self) -> None:
        for queue in self._queues:
            queue.clear()
        self._level.clear()
        self._birth.clear()
        self._ghost.clear()
        self._clock = 0
        self._gap = None
        self._reserved.clear()
        self._running.clear()
        self._current = None
