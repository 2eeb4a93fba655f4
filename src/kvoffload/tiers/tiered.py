"""``TieredOffloadingManager``: the CPU tier with secondary tiers (disk, remote) below it.

The scheduler sees one ``OffloadingManager``. The primary (CPU) tier is the only one that
exchanges blocks with the device: loads and stores of the engine go to it unchanged. The
secondary tiers are filled and read in the background, through ``TierTransfer``s the
scheduler hands to the worker:

* Write-through: when a store completes in the primary, each of its new blocks is
  offered to every secondary tier whose ``admit`` accepts it. The secondary reserves room
  (``prepare_store``; it may evict its own idle blocks or decline when it cannot) and the
  primary block is pinned until the copy is done, so it can be neither evicted nor
  overwritten while it is read. A failed write frees the secondary's reservation.
* Promotion: ``lookup`` of a key the primary misses but a secondary holds answers
  ``PENDING`` and asks for the key to be promoted; while a secondary cannot tell yet (a
  remote tier asking its server in the background) and none holds it, ``RETRY``.
  ``take_transfers`` (once per scheduler step) batches the asked keys per tier: the
  primary reserves slots (evicting its idle blocks if needed; nothing is promoted when it
  cannot make room), the secondary pins its copies, and the copy runs. On success the
  block is loadable in the primary (announced by the primary's own event) and the next
  lookup is a ``HIT``; on failure the primary frees the slots and the secondary drops the
  block (``discard``: a failed read is a corrupt or unreadable block, never retried as
  is). When the primary cannot make room for all the asked keys (a prefix longer than the
  primary, or a primary full of pinned blocks), the leading part that fits is promoted and
  the rest is *declined*: a lookup of a declined key answers ``MISS`` for the next
  ``DECLINE_STEPS`` steps, so the request goes on with what was promoted (the engine
  computes the rest) instead of waiting for room that may never come, and a later
  promotion cannot evict the blocks just promoted for it.
* Loads chained on promotions (one scheduler round trip less): ``kvoffload.tiers.chained``.

Lookups where every secondary keeps its index in memory: a key that no tier holds is a
``MISS`` at once, whatever was asked for it before (a promotion would find nothing), and a
miss of every tier is counted in every tier. A secondary offers this by having
``probe(key)`` (its slot, or -1, counting nothing) and ``count_lookups(hits, misses)``; and
where its probe is a C object, ``finder`` (that object) and ``tiered_lookup`` (a C factory
``(block_table, finders, slow_lookup, HIT, MISS, PENDING)`` answering for the CPU tier over
finders of its kind; the disk tier's is ``_slotfind.TieredLookup``). ``lookup`` is then
one C call over the primary's block table and the secondaries' indexes (a closure where a
secondary has no C finder): the scheduler looks up every key of every request, and a miss
of every tier costs no more than a CPU-only miss (bench/bench_scheduler.py). It counts its
answers itself and hands the counts to the tiers once per step (``take_transfers``) and in
``stats``/``tier_stats``.

Everything here is bookkeeping on the scheduler thread: no I/O, no waiting. Events of
every tier are passed on with their own medium. ``reset`` drops every tier.

Session controls (retention in every tier, prefetch below every request's promotions):
``kvoffload.tiers.tiered_sessions``.

Request hooks (``on_new_request``, ``on_request_finished``) go to every tier, the primary
first, with the same arguments: ``inserted`` and ``reused`` name the primary's keys (the
engine stores to and loads from it alone; a block found below is promoted first). A
request's finish comes after its last store completed, so the write-through that store
started is already planned: no tier is asked anything for the request afterwards.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence, Set
from dataclasses import dataclass

from kvoffload.cpu import CPUOffloadingManager
from kvoffload.keys import OffloadKey
from kvoffload.manager import (
    LookupResult,
    OffloadingEvent,
    OffloadingManager,
    PrepareStoreOutput,
    RequestContext,
    TierStats,
    TierTransfer,
)
from kvoffload.specs import LoadStoreSpec
from kvoffload.tiers.chained import ChainedLoads
from kvoffload.tiers.tiered_sessions import TieredSessions

_HIT = LookupResult.HIT
_MISS = LookupResult.MISS
_PENDING = LookupResult.PENDING
_RETRY = LookupResult.RETRY

# Steps (``take_transfers`` calls) a key whose promotion found no room stays a miss: long
# enough for the request that asked to load what was promoted, short enough that the key
# is tried again once the primary has room.
DECLINE_STEPS = 16
# Promoted keys remembered for ``load_source`` until loaded.
_PROMOTED_MEMORY = 65536

Admit = Callable[[OffloadKey], bool]


@dataclass
class _Transfer:
    promotion: bool  # secondary -> primary; else write-through primary -> secondary
    tier: int  # index into the secondaries
    keys: list[OffloadKey]


class TieredOffloadingManager(TieredSessions, ChainedLoads, OffloadingManager):
    """``primary`` (the CPU tier) over ``secondaries``, fastest first."""

    def __init__(
        self,
        primary: CPUOffloadingManager,
        secondaries: Sequence[OffloadingManager],
        admit: Sequence[Admit | None] | None = None,
        *,
        prefetch_in_flight: int = 2,
        prefetch_batch: int = 64,
    ) -> None:
        """``admit[i]`` (default: every block) decides which blocks go to secondary ``i``;
        ``prefetch_*``: how prefetches are bounded (``kvoffload.tiers.tiered_sessions``)."""
        if not secondaries:
            raise ValueError("a tiered manager needs at least one secondary tier")
        media = [primary.medium, *(tier.medium for tier in secondaries)]
        if len(set(media)) != len(media):
            raise ValueError(f"every tier needs its own medium, got {media}")
        admit = list(admit) if admit is not None else [None] * len(secondaries)
        if len(admit) != len(secondaries):
            raise ValueError(f"{len(admit)} admission rules for {len(secondaries)} secondary tiers")
        self.primary = primary
        self.secondaries = list(secondaries)
        self.medium = primary.medium
        self._admit = admit
        self._wanted: dict[OffloadKey, int] = {}  # key -> tier to promote it from
        self._promoting: dict[OffloadKey, int] = {}  # key -> token of the promotion writing it
        self._planned: list[TierTransfer] = []  # promotions planned now (promote_now)
        self._sourced: set[OffloadKey] = set()  # load_source answered while being promoted
        self._declined: dict[OffloadKey, int] = {}  # key -> step it was declined at
        self._step = 0
        self._writes: list[tuple[int, PrepareStoreOutput, LoadStoreSpec]] = []
        self._transfers: dict[int, _Transfer] = {}
        self._next_token = 0
        # key -> secondary it was promoted from, until its first load (or a bound): a load
        # that found it there reports that tier as its source (metrics only)
        self._promoted_from: dict[OffloadKey, int] = {}
        self._init_prefetch(prefetch_in_flight, prefetch_batch)
        # Every secondary's ``probe`` (an in-memory index says at once whether the tier
        # holds a key; ``count_lookups`` takes what was answered from it), or None where
        # one tier has none (a remote tier must ask).
        probes = tuple(
            getattr(tier, "probe", None) if hasattr(tier, "count_lookups") else None
            for tier in self.secondaries
        )
        self._probes: tuple[Callable[[OffloadKey], int], ...] | None = None if None in probes else probes
        self._take_counts: Callable[[], tuple[int, int]] = lambda: (0, 0)
        fast = self._fast_lookup()
        if fast is not None:
            self.lookup = fast  # type: ignore[method-assign]

    # -- lookups -------------------------------------------------------------------------

    def lookup(self, key: OffloadKey) -> LookupResult:
        return self._lookup(key, None)

    def _lookup(self, key: OffloadKey, load_from: frozenset[str] | None) -> LookupResult:
        """``lookup``, asking for promotions only from the tiers in ``load_from`` (all: None)."""
        result = self.primary.lookup(key)
        if result is not _MISS:
            return result
        probes = self._probes
        if probes is not None and all(probe(key) < 0 for probe in probes):
            for tier in self.secondaries:  # no tier holds it (whatever was asked before)
                tier.count_lookups(0, 1)
            return _MISS
        if key in self._promoting or key in self._wanted:
            return _PENDING
        declined = self._declined.get(key)
        if declined is not None:
            if self._step - declined < DECLINE_STEPS:
                return _MISS
            del self._declined[key]
        waiting = False
        for index, tier in enumerate(self.secondaries):
            if load_from is not None and tier.medium not in load_from:
                continue
            result = tier.lookup(key)
            if result is _HIT:
                self._wanted[key] = index
                return _PENDING
            waiting = waiting or result is _RETRY
        return _RETRY if waiting else _MISS

    def _fast_lookup(self) -> Callable[[OffloadKey], LookupResult] | None:
        """``lookup`` answering a key the primary holds, and a key no tier holds, from the
        primary's ``block_table`` and the secondaries' probes; everything else (a key some
        secondary holds) goes to the general path. One C call where every secondary has a
        C probe (``finder``) and they share one ``tiered_lookup``, else a closure. ``None``
        where the secondaries cannot all tell at once."""
        primary, probes = self.primary, self._probes
        if type(primary).lookup is not CPUOffloadingManager.lookup or probes is None:
            return None  # (a subclass answering lookups its own way keeps its answers)
        table = primary.block_table
        slow = self.lookup  # the bound method: the general path
        finders = tuple(getattr(tier, "finder", None) for tier in self.secondaries)
        factories = {getattr(tier, "tiered_lookup", None) for tier in self.secondaries}
        if None not in finders and None not in factories and len(factories) == 1 and isinstance(table, dict):
            native = factories.pop()(table, finders, slow, _HIT, _MISS, _PENDING)
            self._take_counts = native.take_counts
            return native.lookup
        status_of = table.get
        hits = misses = 0

        def counted() -> tuple[int, int]:
            nonlocal hits, misses
            counts = hits, misses
            hits = misses = 0
            return counts

        self._take_counts = counted

        def lookup(key: OffloadKey) -> LookupResult:
            nonlocal hits, misses
            status = status_of(key)
            if status is None:
                for probe in probes:
                    if probe(key) >= 0:
                        return slow(key)
                misses += 1
                return _MISS
            if status.ref < 0:
                return _PENDING
            hits += 1
            return _HIT

        return lookup

    def _count_lookups(self) -> None:
        """Hand the fast lookup's counts to the tiers: a hit is the primary's; a miss is a
        miss of every tier."""
        hits, misses = self._take_counts()
        if hits or misses:
            self.primary.count_lookups(hits, misses)
            for tier in self.secondaries:
                tier.count_lookups(0, misses)

    # -- the engine's loads and stores: the primary's --------------------------------------

    def prepare_load(self, keys: Sequence[OffloadKey]) -> LoadStoreSpec:
        return self.primary.prepare_load(keys)

    def load_source(self, key: OffloadKey) -> str:
        tier = self._promoted_from.pop(key, None)
        if tier is None and key in self._promoting:
            tier = self._chained_source(key)
        return self.primary.medium if tier is None else self.secondaries[tier].medium

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        self.primary.touch(keys)
        for tier in self.secondaries:
            tier.touch(keys)

    def complete_load(self, keys: Sequence[OffloadKey]) -> None:
        self.primary.complete_load(keys)

    def prepare_store(self, keys: Sequence[OffloadKey]) -> PrepareStoreOutput | None:
        return self.primary.prepare_store(keys)

    def complete_store(self, keys: Sequence[OffloadKey], success: bool = True) -> None:
        primary = self.primary
        if success:  # the keys this call makes loadable (the others are not in flight)
            get = primary.block_table.get
            in_flight = [key for key in keys if (status := get(key)) is not None and status.ref == -1]
        else:
            in_flight = []
        primary.complete_store(keys, success)
        if in_flight:
            self._write_through(in_flight)
        if self._write_limits:
            self._write_limits.clear()

    def _write_through(self, keys: list[OffloadKey]) -> None:
        for index, tier in enumerate(self.secondaries):
            admit = self._admit[index]
            chosen = keys if admit is None else [key for key in keys if admit(key)]
            if self._write_limits:  # a request's tier choice (limit_write_through)
                limits, medium = self._write_limits, tier.medium
                chosen = [key for key in chosen if medium in limits.get(key, (medium,))]
            if not chosen:
                continue
            out = tier.prepare_store(chosen)
            if out is None or not out.keys_to_store:
                continue  # the tier declines (full of pinned blocks, or holds them all)
            self._writes.append((index, out, self.primary.prepare_load(out.keys_to_store)))

    # -- transfers between tiers ---------------------------------------------------------

    def take_transfers(self) -> list[TierTransfer]:
        self._step += 1
        self._count_lookups()
        if self._declined and len(self._declined) > 4096:  # forget the expired ones
            step = self._step
            self._declined = {k: d for k, d in self._declined.items() if step - d < DECLINE_STEPS}
        transfers = [self._new_transfer(False, index, out.keys_to_store, cpu, out.store_spec)
                     for index, out, cpu in self._writes]  # fmt: skip
        self._writes = []
        requests_waiting = bool(self._planned or self._wanted)
        if self._planned:
            transfers += self._planned
            self._planned = []
        if self._wanted:
            by_tier: dict[int, list[OffloadKey]] = {}
            for key, index in self._wanted.items():
                by_tier.setdefault(index, []).append(key)
            self._wanted = {}
            for index, keys in by_tier.items():
                transfer = self._promote(index, keys)
                if transfer is not None:
                    transfers.append(transfer)
        if not requests_waiting:
            transfers += self._take_prefetches()
        return transfers

    def _promote(self, index: int, keys: list[OffloadKey], decline: bool = True) -> TierTransfer | None:
        tier = self.secondaries[index]
        # A key may have gone from the secondary (evicted) or reached the primary since.
        keys = [key for key in keys if tier.lookup(key) is _HIT and self.primary.state(key) is None]
        if not keys:
            return None
        # A leading part the primary can make room for (prepare_store is atomic:
        # a refusal changes nothing), halving on each refusal.
        count, out = len(keys), None
        while count and (out := self.primary.prepare_store(keys[:count])) is None:
            count //= 2
        for key in keys[count:] if decline else ():
            self._declined[key] = self._step
        if out is None or not out.keys_to_store:
            return None
        try:
            source = tier.prepare_load(out.keys_to_store)
        except KeyError:
            # A shared tier learns of its server's evictions in its own calls (lookups
            # apply what its background thread heard): a key the filter above saw may be
            # gone by now. prepare_load pinned nothing; free the primary's room. The
            # requests ask again next step and find what is left.
            self.primary.complete_store(out.keys_to_store, success=False)
            return None
        transfer = self._new_transfer(True, index, out.keys_to_store, source, out.store_spec)
        self._promoting.update(dict.fromkeys(out.keys_to_store, transfer.token))
        return transfer

    def _new_transfer(
        self, promotion: bool, tier: int, keys: list[OffloadKey], src: LoadStoreSpec, dst: LoadStoreSpec
    ) -> TierTransfer:
        token = self._next_token
        self._next_token += 1
        self._transfers[token] = _Transfer(promotion, tier, list(keys))
        return TierTransfer(token, src, dst)

    def complete_transfer(self, token: int, success: bool) -> None:
        transfer = self._transfers.pop(token, None)
        if transfer is None:
            raise KeyError(f"unknown tier transfer {token}")
        tier = self.secondaries[transfer.tier]
        self._prefetching.discard(token)
        if transfer.promotion:
            tier.complete_load(transfer.keys)
            self.primary.complete_store(transfer.keys, success)
            keys = self._promoted(transfer.keys)
            if not success:
                tier.discard(transfer.keys)
            else:
                promoted = self._promoted_from
                promoted.update(dict.fromkeys(keys, transfer.tier))
                while len(promoted) > _PROMOTED_MEMORY:  # promoted, never loaded: forget the oldest
                    del promoted[next(iter(promoted))]
        else:
            self.primary.complete_load(transfer.keys)
            tier.complete_store(transfer.keys, success)

    @property
    def transfers_in_flight(self) -> int:
        return len(self._transfers)

    # -- request hooks: every tier -------------------------------------------------------

    def on_new_request(self, request: RequestContext) -> None:
        for tier in (self.primary, *self.secondaries):
            tier.on_new_request(request)

    def on_request_finished(
        self,
        request: RequestContext,
        key_groups: Sequence[Sequence[OffloadKey]],
        inserted: Set[OffloadKey],
        reused: Set[OffloadKey],
    ) -> None:
        for tier in (self.primary, *self.secondaries):
            tier.on_request_finished(request, key_groups, inserted, reused)

    # -- housekeeping --------------------------------------------------------------------

    def take_events(self) -> list[OffloadingEvent]:
        events = self.primary.take_events()
        for tier in self.secondaries:
            events += tier.take_events()
        return events

    def reset(self) -> None:
        """Drop every block of every tier; transfers in flight are forgotten (their
        outcomes must no longer be reported)."""
        self.primary.reset()
        for tier in self.secondaries:
            tier.reset()
        self._wanted.clear()
        self._promoting.clear()
        self._planned.clear()
        self._sourced.clear()
        self._declined.clear()
        self._writes.clear()
        self._transfers.clear()
        self._promoted_from.clear()
        self._prefetch_queue.clear()
        self._prefetching.clear()

    def stats(self) -> TierStats:
        self._count_lookups()
        return self.primary.stats()

    def tier_stats(self) -> list[TierStats]:
        """Stats of every tier, the primary first."""
        self._count_lookups()
        return [self.primary.stats(), *(tier.stats() for tier in self.secondaries)]

    def close(self) -> None:
        for tier in (self.primary, *self.secondaries):
            tier.close()
