"""``PageTiers``: kvoffload's tiers as one synchronous, thread-safe page store.

The engine-agnostic half of the SGLang backend: it knows keys (``OffloadKey``) and page
numbers of a host pool, not SGLang. Each configured tier keeps its two halves as they are
(the manager's index and policy, the worker moving bytes between the pool's pages and
the medium, both built by the tier type from one ``TierContext``); a lock serialises the
managers (they are single-threaded bookkeeping), jobs run outside it, so one thread's
load overlaps another's store.

* ``exists(keys, wait_s)`` -> how many leading keys some tier holds now. A shared tier
  answers ``RETRY`` for a key it has not seen while its background thread asks the
  server; the call asks again every millisecond or so, for at most ``wait_s`` seconds, then
  counts the key missing. A key whose store is in flight is missing.
* ``load(keys, pages)`` -> per key, whether page ``pages[i]`` now holds its bytes, read
  from the first tier that holds it and checked there (key, namespace, CRC32C). Keys no
  tier holds are ``False``. A job that fails is retried one page at a time up to its
  first failing page, which the tier drops (``discard``: a corrupt or unreadable block is
  never read again); the pages after it are ``False`` too (the engine uses a loaded
  prefix only).
* ``store(keys, pages)`` -> per key, whether some tier holds it after the call: each tier
  reserves room for the keys it lacks (evicting by its policy; declining when it cannot)
  and the pages are written to every tier that reserved. A failed write frees the
  reservation: nothing half-written is ever loadable.
* ``take_events()`` -> ``(tier index, OffloadingEvent)`` of every tier, in order.

Nothing here raises for a failing medium: it costs ``False`` answers, counted in
``counters()``. A manager error that is a bug (not a medium's failure) propagates.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvoffload.counters import Counters
from kvoffload.integrations.sglang.jobs import JobRunner
from kvoffload.keys import OffloadKey
from kvoffload.manager import LookupResult, OffloadingEvent, OffloadingManager
from kvoffload.specs import CPULoadStoreSpec
from kvoffload.tiers.secondary import SecondaryTierType, TierContext
from kvoffload.worker import OffloadingWorker

_HIT = LookupResult.HIT
_RETRY = LookupResult.RETRY
_POLL_S = 0.001


@dataclass
class PageTierCounters(Counters):
    exists_calls: int = 0
    exists_pages: int = 0  # pages asked about
    exists_hits: int = 0  # pages answered present
    exists_waits: int = 0  # calls that waited for a shared tier's answer
    load_pages: int = 0  # pages asked to load
    loaded_pages: int = 0
    failed_load_pages: int = 0  # pages a tier could not read or that failed a check
    store_pages: int = 0  # pages asked to store
    present_pages: int = 0  # pages a tier already held (per tier)
    stored_pages: int = 0  # pages written (per tier)
    failed_store_pages: int = 0  # page writes that failed (per tier)
    declined_pages: int = 0  # distinct pages no tier holds after the call


class PageTiers:
    def __init__(
        self,
        tiers: Sequence[SecondaryTierType],
        context: TierContext,
        pool: Any,
        eviction_policy: str = "lru",
        meter: Any = None,
    ) -> None:
        self.managers: list[OffloadingManager] = []
        self.workers: list[OffloadingWorker] = []
        try:
            for tier in tiers:
                self.managers.append(tier.build_manager(context, eviction_policy))
                self.workers.append(tier.build_worker(context, pool))
        except BaseException:
            self.close()
            raise
        self.names = [getattr(tier, "type_name", "") or type(tier).__name__ for tier in tiers]
        self._runners = [JobRunner(worker, meter) for worker in self.workers]
        self._lock = threading.Lock()
        self._events: list[tuple[int, OffloadingEvent]] = []
        self._counters = PageTierCounters()

    # -- queries ---------------------------------------------------------------------------

    def exists(self, keys: Sequence[OffloadKey], wait_s: float = 0.0) -> int:
        deadline = None
        hits = 0
        while True:
            with self._lock:
                unknown = False
                while hits < len(keys):
                    answers = [manager.lookup(keys[hits]) for manager in self.managers]
                    if _HIT in answers:
                        hits += 1
                        continue
                    unknown = _RETRY in answers
                    break
                self._collect()
            if not unknown:
                break
            now = time.monotonic()
            if deadline is None:
                deadline = now + wait_s
            if now >= deadline:
                break
            time.sleep(_POLL_S)
        with self._lock:
            counters = self._counters
            counters.exists_calls += 1
            counters.exists_pages += len(keys)
            counters.exists_hits += hits
            counters.exists_waits += deadline is not None
        return hits

    # -- loads -----------------------------------------------------------------------------

    def load(self, keys: Sequence[OffloadKey], pages: Sequence[int]) -> list[bool]:
        ok = [False] * len(keys)
        # Runs of consecutive keys read from one tier: (tier, first position, keys).
        runs: list[tuple[int, int, list[OffloadKey]]] = []
        with self._lock:
            for i, key in enumerate(keys):
                tier = self._holder(key)
                if tier is None:
                    break  # the engine uses a loaded prefix only
                if runs and runs[-1][0] == tier and runs[-1][1] + len(runs[-1][2]) == i:
                    runs[-1][2].append(key)
                else:
                    runs.append((tier, i, [key]))
            for tier, _, run in runs:
                self.managers[tier].touch(run)
        for tier, first, run in runs:
            done = self._load_run(tier, run, pages[first : first + len(run)])
            ok[first : first + done] = [True] * done
            if done < len(run):
                break
        with self._lock:
            self._counters.load_pages += len(keys)
            self._counters.loaded_pages += sum(ok)
        return ok

    def _holder(self, key: OffloadKey) -> int | None:
        for tier, manager in enumerate(self.managers):
            state = manager.state(key)
            if state is not None and state >= 0:
                return tier
        return None

    def _load_run(self, tier: int, keys: list[OffloadKey], pages: Sequence[int]) -> int:
        """Load ``keys`` from ``tier`` into ``pages``; how many leading pages hold them."""
        if self._read(tier, keys, pages, discard=len(keys) == 1):
            return len(keys)
        if len(keys) == 1:
            return 0
        for i, key in enumerate(keys):  # the good pages before the first bad one
            if not self._read(tier, [key], pages[i : i + 1], discard=True):
                return i
        return len(keys)

    def _read(self, tier: int, keys: list[OffloadKey], pages: Sequence[int], discard: bool) -> bool:
        """One job; a failed one-page job's key is dropped from the tier (``discard``)."""
        manager = self.managers[tier]
        with self._lock:
            try:
                source = manager.prepare_load(keys)
            except KeyError:  # evicted meanwhile (a shared store's eviction learnt just now)
                self._collect()
                return False
        result = self._runners[tier].run(source, CPULoadStoreSpec(list(pages)), len(keys))
        with self._lock:
            manager.complete_load(keys)
            if not result.success and discard:
                manager.discard(keys)
                self._counters.failed_load_pages += len(keys)
            self._collect()
        return result.success

    # -- stores ----------------------------------------------------------------------------

    def store(self, keys: Sequence[OffloadKey], pages: Sequence[int]) -> list[bool]:
        page_of: dict[OffloadKey, int] = {}
        for key, page in zip(keys, pages):  # a key given twice is stored from its first page
            page_of.setdefault(key, page)
        held: set[OffloadKey] = set()
        counts = {"present": 0, "stored": 0, "failed": 0}
        for tier, manager in enumerate(self.managers):
            with self._lock:
                out = manager.prepare_store(list(page_of))
                self._collect()
            if out is None:
                continue  # full of pinned or in-flight blocks: declined
            todo = list(out.keys_to_store)
            fresh = set(todo)
            present = [key for key in page_of if key not in fresh]
            counts["present"] += len(present)
            held.update(present)
            if not todo:
                continue
            spec = CPULoadStoreSpec([page_of[key] for key in todo])
            result = self._runners[tier].run(spec, out.store_spec, len(todo))
            with self._lock:
                manager.complete_store(todo, result.success)
                self._collect()
            if result.success:
                held.update(todo)
            counts["stored" if result.success else "failed"] += len(todo)
        ok = [key in held for key in keys]
        with self._lock:
            counters = self._counters
            counters.store_pages += len(keys)
            counters.present_pages += counts["present"]
            counters.stored_pages += counts["stored"]
            counters.failed_store_pages += counts["failed"]
            counters.declined_pages += sum(key not in held for key in page_of)
        return ok

    # -- events, stats, shutdown -----------------------------------------------------------

    def _collect(self) -> None:
        for tier, manager in enumerate(self.managers):
            for event in manager.take_events():
                self._events.append((tier, event))

    def take_events(self) -> list[tuple[int, OffloadingEvent]]:
        with self._lock:
            self._collect()
            events, self._events = self._events, []
        return events

    def counters(self) -> PageTierCounters:
        with self._lock:
            return self._counters.snapshot()

    def tier_stats(self) -> list[Any]:
        with self._lock:
            return [manager.stats() for manager in self.managers]

    def close(self) -> None:
        for worker in self.workers:
            worker.close()
        for manager in self.managers:
            manager.close()
        self.workers, self.managers = [], []
