"""Retention bookkeeping of one tier: which keys sessions retain, until when, within a budget.

A ``RetentionIndex`` is the session-control state every tier keeps beside its own index
(``kvoffload.manager`` says what retention does to eviction; ``kvoffload.sessions`` what
a session is). It moves no block and asks no policy; the tier asks it:

* ``retain(session, keys, until, held)``: each key ``held`` says the tier holds, head to
  tail, is retained for ``session`` until ``until`` (a key the session retains already
  has its deadline moved to ``until``). At most ``budget`` distinct keys are retained over
  all sessions; a key another session retains costs nothing more; a new key past the
  budget is trimmed (so a budget cuts a prefix's tail first). Counted in the outcome.
* ``release(session)``: the session retains nothing from now; how many keys it retained.
* ``expire()``: ends every retention whose deadline is at or before the clock's now, and
  returns the keys no session retains any more (the tier may evict them again). Cheap when
  nothing is due (a heap top compare); the tier calls it before it evicts.
* ``forget(keys)``: the tier dropped ``keys`` (a failed store, a corrupt block, a reset's
  ``clear``): no session retains them any more.
* ``key in index``, ``len(index)``, ``iter(index)``: the keys some session retains;
  ``protect(named)`` is what a policy's ``evict`` must not take: ``named`` and every
  retained key, tested with ``in`` without copying the retained set.

A block retained by several sessions stays retained until the last of them ends. The
deadline clock is injectable (``time.monotonic`` by default) so tests need no sleeps.
``counts`` (a ``RetentionCounts``) tallies retained, trimmed, released and expired keys.
``RetainingTier`` gives a tier the manager's session methods over its index.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections.abc import Callable, Container, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from kvoffload.keys import OffloadKey
from kvoffload.sessions import RetainedBlock, RetainOutcome, SessionId

Clock = Callable[[], float]
KeyOf = Callable[[Any], OffloadKey]


def retention_budget(capacity: int, fraction: float) -> int:
    """The retention budget (in blocks) of a tier of ``capacity`` blocks; ``ValueError``
    naming ``retention_fraction`` unless it is a number in [0, 1]."""
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 <= fraction <= 1.0:
        raise ValueError(f"retention_fraction must be a number in [0, 1], got {fraction!r}")
    return int(capacity * fraction)


@dataclass
class RetentionCounts:
    """Keys retained (each retain's, a repeat counted again), trimmed over the budget,
    released, and expired (a session's retention of a key reaching its deadline)."""

    retained: int = 0
    trimmed: int = 0
    released: int = 0
    expired: int = 0


class _Protected(Container[Any]):
    """``named`` and the retained keys as one ``protected`` argument of ``evict`` (tested
    with ``in`` only); ``key_of`` maps a member to its key where members are slots."""

    __slots__ = ("_named", "_holders", "_key_of")

    def __init__(self, named: Container[Any], holders: dict, key_of: KeyOf | None) -> None:
        self._named = named
        self._holders = holders
        self._key_of = key_of

    def __contains__(self, item: object) -> bool:
        if item in self._named:
            return True
        return (item if self._key_of is None else self._key_of(item)) in self._holders


class RetentionIndex:
    """The retained keys of one tier (see the module docstring)."""

    def __init__(self, budget: int, clock: Clock = time.monotonic) -> None:
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
            raise ValueError(f"retention budget must be a non-negative int of blocks, got {budget!r}")
        if not callable(clock):
            raise TypeError(f"retention clock must be callable, got {clock!r}")
        self.budget = budget
        self.clock = clock
        self.counts = RetentionCounts()
        self._sessions: dict[SessionId, dict[OffloadKey, float]] = {}  # key -> its deadline
        self._holders: dict[OffloadKey, list[SessionId]] = {}  # key -> sessions retaining it
        # (deadline, seq, session, keys) per retain call; stale once its keys moved on
        self._deadlines: list[tuple[float, int, SessionId, tuple[OffloadKey, ...]]] = []
        self._queued = 0  # keys named by the heap's entries
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._holders)

    def __contains__(self, key: object) -> bool:
        return key in self._holders

    def __iter__(self) -> Iterator[OffloadKey]:
        return iter(self._holders)

    def protect(self, named: Container[Any], key_of: KeyOf | None = None) -> Container[Any]:
        """``named`` plus every retained key, for ``evict`` (``named`` itself when none is
        retained). ``key_of``: where ``named`` holds slots, a slot's key."""
        return _Protected(named, self._holders, key_of) if self._holders else named

    def retain(
        self, session: SessionId, keys: Sequence[OffloadKey], until: float, held: Callable[[OffloadKey], bool]
    ) -> RetainOutcome:
        if not isinstance(session, SessionId):
            raise TypeError(f"retain needs a SessionId, got {session!r}")
        if isinstance(until, bool) or not isinstance(until, (int, float)) or math.isnan(until):
            raise ValueError(f"retention deadline must be a time.monotonic() value, got {until!r}")
        self.expire()
        mine = self._sessions.get(session)
        holders = self._holders
        retained, trimmed, absent = [], 0, 0
        for key in dict.fromkeys(keys):
            if not held(key):
                absent += 1
            elif (mine is not None and key in mine) or key in holders or len(holders) < self.budget:
                if mine is None:
                    mine = self._sessions[session] = {}
                if key not in mine:
                    holders.setdefault(key, []).append(session)
                mine[key] = until
                retained.append(key)
            else:
                trimmed += 1
        if retained:
            heapq.heappush(self._deadlines, (until, next(self._seq), session, tuple(retained)))
            self._queued += len(retained)
            self._compact()
        self.counts.retained += len(retained)
        self.counts.trimmed += trimmed
        return RetainOutcome(len(retained), trimmed, absent)

    def release(self, session: SessionId) -> int:
        """End ``session``'s retention; how many keys it retained (expired ones aside)."""
        self.expire()
        mine = self._sessions.pop(session, None)
        if not mine:
            return 0
        self.counts.released += len(mine)
        self._drop(session, mine)
        return len(mine)

    def retained(self, session: SessionId, medium: str) -> list[RetainedBlock]:
        """What ``session`` retains, in the order it was first retained."""
        self.expire()
        mine = self._sessions.get(session, {})
        return [RetainedBlock(key, medium, until) for key, until in mine.items()]

    def expire(self) -> list[OffloadKey]:
        """End the retentions whose deadline has come; the keys no session retains now."""
        heap = self._deadlines
        if not heap:
            return []
        now = self.clock()
        if heap[0][0] > now:
            return []
        freed: list[OffloadKey] = []
        while heap and heap[0][0] <= now:
            until, _, session, keys = heapq.heappop(heap)
            self._queued -= len(keys)
            mine = self._sessions.get(session)
            if mine is None:
                continue
            due = [key for key in keys if mine.get(key) == until]
            for key in due:
                del mine[key]
            if not mine:
                del self._sessions[session]
            self.counts.expired += len(due)
            freed += self._drop(session, due)
        return freed

    def forget(self, keys: Iterable[OffloadKey]) -> None:
        """The tier no longer holds ``keys``: nothing retains them."""
        holders, sessions = self._holders, self._sessions
        if not holders:
            return
        for key in keys:
            for session in holders.pop(key, ()):
                mine = sessions.get(session)
                if mine is not None:
                    mine.pop(key, None)
                    if not mine:
                        del sessions[session]

    def clear(self) -> None:
        """Forget every retention (the tier dropped every block); counts stay."""
        self._sessions.clear()
        self._holders.clear()
        self._deadlines.clear()
        self._queued = 0

    def sessions(self) -> int:
        """How many sessions retain something."""
        return len(self._sessions)

    def _drop(self, session: SessionId, keys: Iterable[OffloadKey]) -> list[OffloadKey]:
        holders, freed = self._holders, []
        for key in keys:
            owners = holders.get(key)
            if owners is None:
                continue
            owners.remove(session)
            if not owners:
                del holders[key]
                freed.append(key)
        return freed

    def _compact(self) -> None:
        """Rebuild the deadline heap from the live retentions once stale entries (keys
        retained again or released since) outnumber the live ones."""
        if self._queued <= 2 * len(self._holders) + 1024:  # (no more than the live entries)
            return
        live = sum(map(len, self._sessions.values()))
        if self._queued <= 2 * live + 1024:
            return
        groups: dict[tuple[float, SessionId], list[OffloadKey]] = {}
        for session, mine in self._sessions.items():
            for key, until in mine.items():
                groups.setdefault((until, session), []).append(key)
        self._deadlines = [(until, next(self._seq), s, tuple(keys)) for (until, s), keys in groups.items()]
        heapq.heapify(self._deadlines)
        self._queued = live


class RetainingTier:
    """``retain``, ``release`` and ``retained`` of an ``OffloadingManager`` (a mixin, first
    among its bases) over its ``retention`` index and its ``holds(key)``."""

    retention: RetentionIndex
    medium: str

    def holds(self, key: OffloadKey) -> bool:
        """Whether the tier holds ``key`` in any state (what ``retain`` may retain)."""
        raise NotImplementedError

    def retain(self, session: SessionId, keys: Sequence[OffloadKey], until: float) -> RetainOutcome:
        return self.retention.retain(session, keys, until, self.holds)

    def release(self, session: SessionId) -> int:
        return self.retention.release(session)

    def retained(self, session: SessionId) -> list[RetainedBlock]:
        return self.retention.retained(session, self.medium)
