"""The host-memory tier: slot bookkeeping for ``num_blocks`` host blocks.

``CPUOffloadingManager`` implements ``OffloadingManager`` for medium ``"CPU"``. Exact
semantics beyond the base contract:

* Slot ids: never-used ids are handed out first, in increasing order; after that freed ids
  are reused last-freed-first (the free list is a stack).
* ``lookup`` is ``PENDING`` while a key's store is in flight and ``HIT`` once completed;
  ``hits`` and ``misses`` count ``HIT`` and ``MISS`` answers (of ``lookup`` and of the keys
  ``lookup_prefix`` examines).
* ``prepare_store`` queues one ``removed=True`` event per call listing its evictions in
  eviction order; ``complete_store`` queues one ``removed=False`` event with the keys that
  became loadable. ``reset`` queues one ``removed=True`` event with every loadable key.
  Events are recorded only when ``enable_events`` is true.
* A policy may decline keys (``CachePolicy.admit``); they are left out of
  ``keys_to_store`` and stay absent.
* It counts its in-flight and pinned blocks as they change, so ``stats`` costs nothing and
  ``prepare_store`` returns ``None`` at once, without asking the policy, when fewer idle
  blocks than it must evict exist.
* ``on_new_request`` and ``on_request_finished`` are passed on to the policy.
* Session controls (``retain``, ``release``, ``retained``) keep a
  ``kvoffload.retention.RetentionIndex`` of at most ``retention_fraction`` of its blocks,
  with deadlines on ``clock`` (``time.monotonic`` by default). Any held key can be
  retained (in flight, pinned or idle). ``prepare_store`` asks the policy to evict with
  the retained keys protected, after ending the retentions due; with nothing retained it
  costs nothing more. It still returns ``None`` at once when the idle blocks no session
  retains are too few (counting those only when the retained ones could make the
  difference). A block dropped otherwise (failed store, ``discard``, ``reset``) leaves
  every retention.

Its per-key work (the lookups of a prefix, pins and unpins, completions, new statuses, the
slots of evictions) is one call each into ``kvoffload.policies.blocks``: C loops over its
table where ``kvoffload.policies._blocks`` was built, the same in Python otherwise.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence, Set

from kvoffload.keys import OffloadKey
from kvoffload.manager import (
    LookupResult,
    OffloadingEvent,
    OffloadingManager,
    PrepareStoreOutput,
    RequestContext,
    TierStats,
)
from kvoffload.policies import BlockStatus, CachePolicy, resolve_policy
from kvoffload.policies.blocks import absent as _absent
from kvoffload.policies.blocks import complete as _complete
from kvoffload.policies.blocks import lookup_prefix as _lookup_prefix
from kvoffload.policies.blocks import pin as _pin
from kvoffload.policies.blocks import release as _release
from kvoffload.policies.blocks import reserve as _reserve
from kvoffload.policies.blocks import unpin as _unpin
from kvoffload.retention import RetainingTier, RetentionIndex, retention_budget
from kvoffload.specs import CPULoadStoreSpec
from kvoffload.validation import non_negative_int

_HIT = LookupResult.HIT
_MISS = LookupResult.MISS
_PENDING = LookupResult.PENDING


class CPUOffloadingManager(RetainingTier, OffloadingManager):
    """Bookkeeping of ``num_blocks`` host blocks under an eviction policy."""

    medium = "CPU"

    def __init__(
        self,
        num_blocks: int,
        cache_policy: str | type[CachePolicy] = "lru",
        enable_events: bool = False,
        retention_fraction: float = 0.25,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.num_blocks = non_negative_int("num_blocks", num_blocks)
        # Session retention, read-only outside (``retention.counts`` for metrics).
        self.retention = RetentionIndex(retention_budget(num_blocks, retention_fraction), clock)
        self.policy: CachePolicy = resolve_policy(cache_policy)(num_blocks)
        self.enable_events = enable_events
        self._blocks: dict[OffloadKey, BlockStatus] = {}
        # key -> BlockStatus (``ref``: the block state), for reading only: a caller that
        # answers lookups itself on a hot path (the tiered manager) reads it and reports
        # what it answered with ``count_lookups``.
        self.block_table: Mapping[OffloadKey, BlockStatus] = self._blocks
        self._next_unused = 0
        self._free: list[int] = []
        self._events: list[OffloadingEvent] = []
        self._hits = 0
        self._misses = 0
        self._evictions = 0
        self._in_flight = 0  # blocks with ref == -1
        self._pinned = 0  # blocks with ref > 0

    # -- lookups ---------------------------------------------------------------------

    def lookup(self, key: OffloadKey) -> LookupResult:
        status = self._blocks.get(key)
        if status is None:
            self._misses += 1
            return _MISS
        if status.ref < 0:
            return _PENDING
        self._hits += 1
        return _HIT

    def lookup_prefix(self, keys: Iterable[OffloadKey]) -> int:
        count, missed = _lookup_prefix(self._blocks, keys)
        self._hits += count
        self._misses += missed
        return count

    def count_lookups(self, hits: int, misses: int) -> None:
        """Count ``HIT`` and ``MISS`` answers given for this tier from ``block_table``."""
        self._hits += hits
        self._misses += misses

    # -- loads -----------------------------------------------------------------------

    def prepare_load(self, keys: Sequence[OffloadKey]) -> CPULoadStoreSpec:
        pinned = _pin(self._blocks, keys)
        if pinned is None:  # all or nothing: name the first key that is not a HIT
            for key in keys:
                status = self._blocks.get(key)
                if status is None or status.ref < 0:
                    state = "absent" if status is None else "still being stored"
                    raise KeyError(f"cannot load key {key.hex()}: it is {state}, not a HIT")
        slots, newly = pinned
        self._pinned += newly
        return CPULoadStoreSpec(slots)

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        self.policy.touch(keys)

    def complete_load(self, keys: Sequence[OffloadKey]) -> None:
        idle = _unpin(self._blocks, keys)
        if idle is None:  # all or nothing: name the first key (counting repeats) not pinned
            left = {key: status.ref for key in keys if (status := self._blocks.get(key)) is not None}
            for key in keys:
                left[key] = left.get(key, 0) - 1
                if left[key] < 0:
                    raise KeyError(f"cannot complete load of key {key.hex()}: no load was prepared")
        self._pinned -= idle

    # -- stores ----------------------------------------------------------------------

    def prepare_store(self, keys: Sequence[OffloadKey]) -> PrepareStoreOutput | None:
        blocks = self._blocks
        new_keys = _absent(blocks, keys)
        policy = self.policy
        if not policy.admits_all:
            new_keys = list(filter(policy.admit, new_keys))
        free = self._free
        available = self.num_blocks - self._next_unused + len(free)
        shortfall = len(new_keys) - available
        evicted: list[OffloadKey] = []
        if shortfall > 0:
            if len(new_keys) > self.num_blocks:
                return None
            idle = len(blocks) - self._in_flight - self._pinned
            if shortfall > idle:
                return None  # fewer idle blocks than needed: no policy can help
            retention = self.retention
            if len(retention):
                retention.expire()
                if shortfall > idle - len(retention) and shortfall > idle - self._retained_idle():
                    return None
            victims = policy.evict(shortfall, retention.protect(set(keys)))
            if victims is None:
                return None
            evicted = victims
            _release(blocks, victims, free)
            self._evictions += len(victims)
            if self.enable_events:
                self._events.append(OffloadingEvent(list(victims), self.medium, True))
        # Never-used slots first, in increasing order; then freed ones, last freed first.
        fresh = min(len(new_keys), self.num_blocks - self._next_unused)
        slots = list(range(self._next_unused, self._next_unused + fresh))
        self._next_unused += fresh
        reused = len(new_keys) - fresh
        if reused:
            slots += free[: -reused - 1 : -1]
            del free[-reused:]
        self._in_flight += len(new_keys)
        policy.insert_many(new_keys, _reserve(blocks, new_keys, slots))
        return PrepareStoreOutput(new_keys, CPULoadStoreSpec(slots), evicted)

    def complete_store(self, keys: Sequence[OffloadKey], success: bool = True) -> None:
        blocks = self._blocks
        if success:
            done = _complete(blocks, keys)
            self._in_flight -= len(done)
            if done and self.enable_events:
                self._events.append(OffloadingEvent(done, self.medium, False))
            return
        for key in keys:
            status = blocks.get(key)
            if status is None or status.ref != -1:
                continue
            self._in_flight -= 1
            del blocks[key]
            self.policy.remove(key)
            self._free.append(status.slot)
            self.retention.forget((key,))

    def discard(self, keys: Sequence[OffloadKey]) -> None:
        blocks = self._blocks
        dropped = []
        for key in dict.fromkeys(keys):
            status = blocks.get(key)
            if status is None or status.ref != 0:
                continue
            del blocks[key]
            self.policy.remove(key)
            self._free.append(status.slot)
            dropped.append(key)
        self.retention.forget(dropped)
        if dropped and self.enable_events:
            self._events.append(OffloadingEvent(dropped, self.medium, True))

    def state(self, key: OffloadKey) -> int | None:
        """The block state of ``key`` (-1 being written, 0 idle, n pinned) or ``None`` if
        absent; unlike ``lookup`` it counts nothing."""
        status = self._blocks.get(key)
        return None if status is None else status.ref

    def keys(self) -> list[OffloadKey]:
        """Every key held (loadable, pinned or being written), as a new list."""
        return list(self._blocks)

    # -- housekeeping ----------------------------------------------------------------

    def take_events(self) -> list[OffloadingEvent]:
        events, self._events = self._events, []
        return events

    def reset(self) -> None:
        loadable = [key for key, status in self._blocks.items() if status.ref >= 0]
        if loadable and self.enable_events:
            self._events.append(OffloadingEvent(loadable, self.medium, True))
        self._blocks.clear()
        self.policy.clear()
        self._next_unused = 0
        self._free.clear()
        self._in_flight = self._pinned = 0
        self.retention.clear()

    def holds(self, key: OffloadKey) -> bool:
        return key in self._blocks

    def _retained_idle(self) -> int:
        blocks = self._blocks
        return sum(blocks[key].ref == 0 for key in self.retention)

    def on_new_request(self, request: RequestContext) -> None:
        self.policy.on_new_request(request)

    def on_request_finished(
        self,
        request: RequestContext,
        key_groups: Sequence[Sequence[OffloadKey]],
        inserted: Set[OffloadKey],
        reused: Set[OffloadKey],
    ) -> None:
        self.policy.on_request_finished(request, key_groups, inserted, reused)

    def stats(self) -> TierStats:
        return TierStats(
            medium=self.medium,
            capacity=self.num_blocks,
            used=len(self._blocks),
            in_flight=self._in_flight,
            pinned=self._pinned,
            hits=self._hits,
            misses=self._misses,
            evictions=self._evictions,
        )
