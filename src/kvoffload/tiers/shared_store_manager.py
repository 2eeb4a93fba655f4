"""``SharedStoreManager``: the scheduler-side view of a store that engine replicas share
and that evicts on its own (the base of the Redis and Mooncake tiers' managers).

It implements ``kvoffload.manager.OffloadingManager`` for the subclass's ``medium``. The
manager keeps a local index of the blocks it *believes* present (a
``CPUOffloadingManager`` bookkeeping ``capacity`` blocks: pins, in-flight stores,
eviction order) and learns the rest through a ``StoreLookups``
(``kvoffload.tiers.shared_store_lookups``) on a background thread. The scheduler thread
never calls the store or waits:

* ``lookup`` of a key in the index answers as the index does (``HIT``, ``PENDING`` while
  our store is in flight). A key not in the index is probed: ``RETRY`` until the answer
  is in (at most ``probe_timeout`` seconds, then ``MISS``); a key found present is
  adopted into the index (``HIT``), one found absent (or whose probe failed) answers
  ``MISS`` for ``absent_ttl`` seconds. While the store is down (``lookups.down``)
  every key answers ``MISS`` at once, indexed ones too: a load from a store that is down
  would only fail (on Mooncake after seconds).
* ``prepare_store`` reserves index room (evicting idle blocks by the policy). With
  ``delete_on_evict`` (set when the tier has a byte budget) the blocks this engine wrote
  are deleted from the store when the index evicts them, so the engine never holds more
  than its budget there.
* Blocks the store dropped (``gone`` answers) leave the index. Every
  ``reconcile_interval`` seconds, and at once after a ``resync`` answer, the indexed keys
  are checked against the store. After a ``lost`` answer (a store back from an outage that
  may have emptied it) every idle indexed block leaves the index at once (counted
  ``gone``, announced removed if ours) and is found again by probes if it is still there.
  A failed promotion ``discard``s its keys and they answer ``MISS`` for a while.
* Session retention is the index's (``CPUOffloadingManager``'s: ``retention_fraction`` of
  ``capacity``, deadlines on ``clock``): its evictions, and so the deletions of
  ``delete_on_evict``, pass over retained blocks. The store's own eviction is not ours
  to stop: a retained block the store drops (``gone``, ``lost``) leaves the retention.
* Events: only blocks this engine stored are announced (``removed=False`` at
  ``complete_store``), and only those announced are later announced removed, whatever
  removed them (our eviction, the store's). Blocks adopted from other replicas are not
  announced: their writer did.

A subclass sets ``medium`` and ``spec_type`` (the ``RemoteLoadStoreSpec`` of its medium)
and may set ``counters_type`` (a ``SharedStoreCounters`` subclass).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence, Set
from dataclasses import dataclass, replace

from kvoffload.counters import Counters
from kvoffload.cpu import CPUOffloadingManager
from kvoffload.keys import OffloadKey
from kvoffload.manager import (
    LookupResult,
    OffloadingEvent,
    OffloadingManager,
    PrepareStoreOutput,
    RequestContext,
    TierStats,
)
from kvoffload.policies import CachePolicy
from kvoffload.sessions import RetainedBlock, RetainOutcome, SessionId
from kvoffload.specs import RemoteLoadStoreSpec
from kvoffload.tiers.shared_store_lookups import StoreLookups

_HIT = LookupResult.HIT
_MISS = LookupResult.MISS
_RETRY = LookupResult.RETRY
_ABSENT_KEPT = 65536  # past this many absent keys, expired ones are dropped at the next probe


@dataclass
class SharedStoreCounters(Counters):
    probes: int = 0  # keys asked about
    found: int = 0  # probed keys found present and adopted
    probe_timeouts: int = 0  # probes unanswered within probe_timeout: answered MISS
    probe_failures: int = 0  # probes that could not be made (the store down)
    gone: int = 0  # indexed blocks the store dropped (notifications, reconciliation)
    discarded: int = 0  # blocks dropped after a failed promotion
    deleted: int = 0  # blocks this engine deleted from the store (budget evictions)
    reconciliations: int = 0
    outages: int = 0  # times the store became unavailable (its breaker opened)


class SharedStoreManager(OffloadingManager):
    medium: str
    spec_type: type[RemoteLoadStoreSpec] = RemoteLoadStoreSpec
    counters_type: type[SharedStoreCounters] = SharedStoreCounters

    def __init__(
        self,
        lookups: StoreLookups,
        capacity: int,
        cache_policy: str | type[CachePolicy] = "lru",
        enable_events: bool = False,
        *,
        delete_on_evict: bool = False,
        probe_timeout: float = 1.0,
        absent_ttl: float = 2.0,
        reconcile_interval: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        retention_fraction: float = 0.25,
    ) -> None:
        self._book = CPUOffloadingManager(
            capacity, cache_policy, enable_events=True, retention_fraction=retention_fraction, clock=clock
        )
        self.retention = self._book.retention  # read-only outside (counts for metrics)
        self._remote = lookups
        self.enable_events = enable_events
        self.delete_on_evict = delete_on_evict
        self.probe_timeout = probe_timeout
        self.absent_ttl = absent_ttl
        self.reconcile_interval = reconcile_interval
        self._clock = clock
        self._probing: dict[OffloadKey, float] = {}  # key -> deadline
        self._absent: dict[OffloadKey, float] = {}  # key -> until when it answers MISS
        self._ours: set[OffloadKey] = set()  # announced by this engine (it wrote them)
        self._events: list[OffloadingEvent] = []
        self._next_reconcile = clock() + reconcile_interval
        self._counters = self.counters_type()

    # -- answers from the background thread ---------------------------------------------

    def _absorb(self) -> None:
        """Apply the answers that came in; then start a reconciliation when one is due."""
        now = self._clock()
        counters = self._counters
        for answer in self._remote.answers() if self._remote.has_answers() else ():
            keys = [OffloadKey(k) for k in answer.keys]
            if answer.kind == "present":
                self._adopt([k for k in keys if self._probing.pop(k, None) is not None])
            elif answer.kind in ("absent", "failed"):
                if answer.kind == "failed":
                    counters.probe_failures += len(keys)
                until = now + self.absent_ttl
                for key in keys:
                    if self._probing.pop(key, None) is not None:
                        self._absent[key] = until
            elif answer.kind == "gone":
                before = self._book.stats().used
                self._book.discard(keys)
                counters.gone += before - self._book.stats().used
                self._collect()
            elif answer.kind == "resync":
                self._next_reconcile = now
            elif answer.kind == "lost":
                before = self._book.stats().used
                self._book.discard(list(self._book.keys()))
                counters.gone += before - self._book.stats().used
                self._collect()
                self._absent.clear()
                self._next_reconcile = now  # the blocks in use stayed: check them too
        if now >= self._next_reconcile:
            self._next_reconcile = now + self.reconcile_interval
            counters.reconciliations += 1
            self._remote.reconcile(self._book.keys())

    def _adopt(self, keys: list[OffloadKey]) -> None:
        """Index blocks another writer stored, without announcing them."""
        if not keys:
            return
        self._collect()
        out = self._book.prepare_store(keys)
        if out is None:  # no idle room: they stay unknown and answer MISS for a while
            until = self._clock() + self.absent_ttl
            for key in keys:
                self._absent[key] = until
            return
        self._book.complete_store(out.keys_to_store)
        self._counters.found += len(out.keys_to_store)
        self._evicted(out.evicted_keys)
        self._collect(announce=False)

    def _collect(self, announce: bool = True) -> None:
        """Move the index's events to ours: stores only when ``announce``, removals only
        of announced keys."""
        ours = self._ours
        for event in self._book.take_events():
            if event.removed:
                keys = [key for key in event.keys if key in ours]
                ours.difference_update(keys)
            elif announce:
                keys = event.keys
                ours.update(keys)
            else:
                continue
            if keys and self.enable_events:
                self._events.append(OffloadingEvent(keys, self.medium, event.removed))

    def _evicted(self, keys: Sequence[OffloadKey]) -> None:
        if self.delete_on_evict and keys:
            mine = [key for key in keys if key in self._ours]
            self._remote.delete(mine)
            self._counters.deleted += len(mine)

    # -- lookups -------------------------------------------------------------------------

    def lookup(self, key: OffloadKey) -> LookupResult:
        self._absorb()
        result = self._book.lookup(key)
        if result is not _MISS:
            return _MISS if self._remote.down else result
        now = self._clock()
        until = self._absent.get(key)
        if until is not None:
            if now < until:
                return _MISS
            del self._absent[key]
        deadline = self._probing.get(key)
        if deadline is not None:
            if now < deadline:
                return _RETRY
            del self._probing[key]
            self._counters.probe_timeouts += 1
            self._absent[key] = now + self.absent_ttl
            return _MISS
        if self._remote.down:
            return _MISS
        if len(self._absent) > _ABSENT_KEPT:
            self._absent = {k: t for k, t in self._absent.items() if t > now}
        self._probing[key] = now + self.probe_timeout
        self._counters.probes += 1
        self._remote.probe(key)
        return _RETRY

    def lookup_prefix(self, keys: Iterable[OffloadKey]) -> int:
        count = 0
        for key in keys:
            if self.lookup(key) is not _HIT:
                break
            count += 1
        return count

    def state(self, key: OffloadKey) -> int | None:
        return self._book.state(key)

    # -- loads and stores ----------------------------------------------------------------

    def prepare_load(self, keys: Sequence[OffloadKey]) -> RemoteLoadStoreSpec:
        self._book.prepare_load(keys)
        return self.spec_type(keys)

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        self._book.touch(keys)

    def complete_load(self, keys: Sequence[OffloadKey]) -> None:
        self._book.complete_load(keys)

    def prepare_store(self, keys: Sequence[OffloadKey]) -> PrepareStoreOutput | None:
        self._absorb()
        self._collect()
        out = self._book.prepare_store(keys)
        if out is None:
            return None
        self._evicted(out.evicted_keys)
        self._collect()
        for key in out.keys_to_store:
            self._absent.pop(key, None)
            self._probing.pop(key, None)
        return PrepareStoreOutput(out.keys_to_store, self.spec_type(out.keys_to_store), out.evicted_keys)

    def complete_store(self, keys: Sequence[OffloadKey], success: bool = True) -> None:
        self._collect()
        self._book.complete_store(keys, success)
        self._collect()

    def discard(self, keys: Sequence[OffloadKey]) -> None:
        """Drop idle ``keys`` whose promotion failed; they answer ``MISS`` for a while."""
        self._collect()
        before = self._book.stats().used
        self._book.discard(keys)
        self._counters.discarded += before - self._book.stats().used
        self._collect()
        until = self._clock() + self.absent_ttl
        for key in keys:
            if self._book.state(key) is None:
                self._absent[key] = until

    # -- housekeeping --------------------------------------------------------------------

    def take_events(self) -> list[OffloadingEvent]:
        self._absorb()
        self._collect()
        events, self._events = self._events, []
        return events

    def reset(self) -> None:
        """Forget every block (the store keeps them; lookups find them again)."""
        self._collect()
        self._book.reset()
        self._collect()
        self._probing.clear()
        self._absent.clear()

    def stats(self) -> TierStats:
        return replace(self._book.stats(), medium=self.medium)

    def counters(self) -> SharedStoreCounters:
        return self._counters.snapshot(outages=self._remote.outages)

    def on_new_request(self, request: RequestContext) -> None:
        self._book.on_new_request(request)

    def on_request_finished(
        self,
        request: RequestContext,
        key_groups: Sequence[Sequence[OffloadKey]],
        inserted: Set[OffloadKey],
        reused: Set[OffloadKey],
    ) -> None:
        self._book.on_request_finished(request, key_groups, inserted, reused)

    def retain(self, session: SessionId, keys: Sequence[OffloadKey], until: float) -> RetainOutcome:
        self._absorb()  # what the store dropped is not held
        return self._book.retain(session, keys, until)

    def release(self, session: SessionId) -> int:
        return self._book.release(session)

    def retained(self, session: SessionId) -> list[RetainedBlock]:
        return self._book.retention.retained(session, self.medium)

    def close(self) -> None:
        self._remote.close()
