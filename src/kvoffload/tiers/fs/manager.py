"""``FSOffloadingManager``: the scheduler-side bookkeeping of the local-disk tier.

It implements ``kvoffload.manager.OffloadingManager`` for medium ``"DISK"`` with the same
semantics as ``kvoffload.cpu.CPUOffloadingManager`` (see there: slot hand-out order,
``PENDING`` while in flight, one event per ``prepare_store`` eviction batch and per
``complete_store``, declines by the policy, ``discard`` of idle keys only), over slots of
the namespace directory ``<root_dir>/<namespace>`` that ``FSWorker`` reads and writes.
Specs are ``DiskLoadStoreSpec(slots, keys)``.

* Capacity: ``bytes_to_use // stored_block_bytes`` slots, where a stored block is its
  payload (``block_bytes``, the host bytes of one offloaded block) padded to 4 KiB plus
  its header record (``kvoffload.tiers.fs.format``). The worker is built with the same
  ``block_bytes`` (its host pool's) and ``bytes_to_use``, so both agree on the slots.
* The index lives in memory (``SlotIndex`` plus an ``int32`` state per slot and the
  eviction order, ``kvoffload.tiers.fs.order``): with the default LRU about 70 bytes per
  block. After construction the manager never touches a file.
* Construction does the only I/O: it creates the namespace directory, takes an exclusive
  lock on it (a second manager on the same namespace, in any process, is a
  ``ValueError``; the lock dies with the process), and rebuilds the index from the header
  file (``kvoffload.tiers.fs.scan``): intact blocks are loadable at once, torn ones are
  left out (and overwritten when their slot is reused). With events enabled it queues
  ONE ``removed=False`` event listing the blocks found, so a restarted engine announces
  them.
* Tensor parallelism: each worker writes its share of a block into its own namespace, in
  the slot this one manager handed out. ``rank_namespaces`` names the other ranks'; they
  are created, locked and scanned with this one, and a block is rebuilt only where every
  rank holds it intact in the same slot (the others count as ``partial_at_start``).
* ``discard(keys)`` drops idle keys that a failed read found corrupt or unreadable (the
  worker has already invalidated them on disk): misses from then on, one
  ``removed=True`` event, counted in ``counters().discarded``.
* ``on_new_request``/``on_request_finished`` are passed on to the eviction order.
* Session retention as the CPU tier's (``kvoffload.retention``; ``retention_fraction``
  of its slots, deadlines on ``clock``): eviction passes over retained blocks.
* ``counters()`` adds the tier's own counts to ``stats()``: blocks rebuilt, torn records
  left out at start-up, duplicates, discards.
"""

from __future__ import annotations

import array
import os
import time
from collections.abc import Callable, Iterable, Sequence, Set
from dataclasses import dataclass

import numpy as np

from kvoffload.counters import Counters
from kvoffload.keys import OffloadKey
from kvoffload.manager import (
    LookupResult,
    OffloadingEvent,
    OffloadingManager,
    PrepareStoreOutput,
    RequestContext,
    TierStats,
)
from kvoffload.policies import CachePolicy, resolve_policy
from kvoffload.private import open_private
from kvoffload.retention import RetainingTier, RetentionIndex, retention_budget
from kvoffload.specs import MEDIUM_DISK, DiskLoadStoreSpec
from kvoffload.tiers.fs.format import INFO_FILE, MAX_KEY_BYTES, Geometry
from kvoffload.tiers.fs.index import SlotIndex, _slotfind
from kvoffload.tiers.fs.namespace import (
    check_namespace,
    lock_namespace_dir,
    namespace_digest,
    open_namespace_dir,
)
from kvoffload.tiers.fs.order import make_order
from kvoffload.tiers.fs.scan import scan_ranks
from kvoffload.validation import positive_int

_HIT = LookupResult.HIT
_MISS = LookupResult.MISS
_PENDING = LookupResult.PENDING
_FREE = -2  # slot state of a free slot (blocks are -1 in flight, 0 idle, n pinned)


@dataclass
class FSManagerCounters(Counters):
    rebuilt: int = 0  # blocks found intact at start-up
    torn_at_start: int = 0  # non-empty header records left out at start-up
    duplicates_at_start: int = 0  # older copies of a key held by another slot
    partial_at_start: int = 0  # blocks some rank's share lacked (tensor parallelism)
    discarded: int = 0  # blocks dropped by discard()
    evictions: int = 0


class FSOffloadingManager(RetainingTier, OffloadingManager):
    """Bookkeeping of the disk tier's slots under ``<root_dir>/<namespace>``."""

    medium = MEDIUM_DISK

    def __init__(
        self,
        root_dir: str | os.PathLike,
        namespace: str,
        block_bytes: int,
        bytes_to_use: int,
        cache_policy: str | type[CachePolicy] = "lru",
        enable_events: bool = False,
        *,
        max_key_bytes: int = 36,
        verify_on_start: bool = False,
        info: str | Sequence[str] | None = None,
        rank_namespaces: Sequence[str] = (),
        retention_fraction: float = 0.25,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``block_bytes``: payload bytes of one block (the host pool's bytes per host
        block); ``max_key_bytes``: the longest key (``OffloadKey`` of a 32-byte hash is
        36); ``verify_on_start``: also check every payload's CRC while rebuilding (a full
        read); ``info``: text written to ``namespace.json`` for people (e.g.
        ``namespace.describe(identity)``), or one per namespace (this one first);
        ``rank_namespaces``: the other ranks' namespaces, rank 1 first."""
        self.geometry = Geometry(positive_int("block_bytes", block_bytes))
        self.num_blocks = self.geometry.num_slots(bytes_to_use)
        self.bytes_to_use = bytes_to_use
        self.retention = RetentionIndex(retention_budget(self.num_blocks, retention_fraction), clock)
        if not 0 < positive_int("max_key_bytes", max_key_bytes) <= MAX_KEY_BYTES:
            raise ValueError(f"max_key_bytes must be at most {MAX_KEY_BYTES}, got {max_key_bytes}")
        policy_cls = resolve_policy(cache_policy)
        self.namespace = check_namespace(namespace)
        self.path = open_namespace_dir(root_dir, namespace)
        self.rank_namespaces = [check_namespace(ns) for ns in rank_namespaces]
        paths = [self.path] + [open_namespace_dir(root_dir, ns) for ns in self.rank_namespaces]
        self.enable_events = enable_events
        self._lock_fds: list[int] = []
        try:
            for path in paths:
                self._lock_fds.append(lock_namespace_dir(path))
        except BaseException:
            self.close()
            raise
        n = self.num_blocks
        self._index = SlotIndex(n, max_key_bytes)
        self._find = self._index.find
        # The slot of a key in any state, -1 if absent; counts nothing. One C call where
        # the probe is built (SlotIndex): the tiered manager asks it for every key the CPU
        # tier misses, and reports its misses with ``count_lookups``. ``finder``: the C
        # probe object itself (None without it), which the tiered manager's C lookup reads.
        self.probe = self._find
        self.finder = self._index.finder
        # and the C lookup that answers for a CPU tier over probes of this kind (the
        # tiered manager's fast path): a tier with an in-memory index offers both
        self.tiered_lookup = _slotfind.TieredLookup if self.finder is not None else None
        self._state_array = np.full(n, _FREE, dtype=np.int32)
        self._state = memoryview(self._state_array)
        self.order = make_order(policy_cls, n, self._index, self._state)
        self._free = array.array("i")  # a stack: last freed first
        self._next_unused = 0
        self._events: list[OffloadingEvent] = []
        self._hits = 0
        self._misses = 0
        self._in_flight = 0
        self._pinned = 0
        self._counters = FSManagerCounters()
        infos = [info] * len(paths) if info is None or isinstance(info, str) else list(info)
        for path, text in zip(paths, infos):
            if text is not None:
                fd = open_private(os.path.join(path, INFO_FILE), os.O_WRONLY | os.O_TRUNC)
                with os.fdopen(fd, "w") as f:
                    f.write(text + "\n")
        self._rebuild(paths, verify_on_start)

    def _rebuild(self, paths: list[str], verify: bool) -> None:
        namespaces = [self.namespace, *self.rank_namespaces]
        found = scan_ranks(
            [(path, namespace_digest(ns)) for path, ns in zip(paths, namespaces)],
            self.geometry, self.num_blocks, self._index.max_key_bytes, verify,
        )  # fmt: skip
        counters = self._counters
        counters.torn_at_start = found.torn
        counters.duplicates_at_start = found.duplicates
        counters.partial_at_start = found.partial
        counters.rebuilt = len(found.slots)
        if not found.slots:
            return
        self._index.insert_many(found.keys, found.slots)
        self._state_array[found.slots] = 0
        self.order.insert(found.keys, found.slots)
        # Free slots: never-used ones above the highest used slot, the holes below it on
        # the stack so that the lowest is reused first.
        self._next_unused = max(found.slots) + 1
        holes = np.flatnonzero(self._state_array[: self._next_unused] == _FREE)
        self._free.extend(holes[::-1].tolist())
        if self.enable_events:
            self._events.append(OffloadingEvent(list(found.keys), self.medium, False))

    # -- lookups ---------------------------------------------------------------------

    def lookup(self, key: OffloadKey) -> LookupResult:
        slot = self._find(key)
        if slot < 0:
            self._misses += 1
            return _MISS
        if self._state[slot] < 0:
            return _PENDING
        self._hits += 1
        return _HIT

    def count_lookups(self, hits: int, misses: int) -> None:
        """Count ``HIT`` and ``MISS`` answers given for this tier from ``probe``."""
        self._hits += hits
        self._misses += misses

    def lookup_prefix(self, keys: Iterable[OffloadKey]) -> int:
        find, state = self._find, self._state
        count = 0
        for key in keys:
            slot = find(key)
            if slot < 0:
                self._misses += 1
                break
            if state[slot] < 0:
                break
            count += 1
        self._hits += count
        return count

    def state(self, key: OffloadKey) -> int | None:
        """The block state of ``key`` (-1 being written, 0 idle, n pinned) or ``None`` if
        absent; unlike ``lookup`` it counts nothing."""
        slot = self._find(key)
        return None if slot < 0 else self._state[slot]

    # -- loads -----------------------------------------------------------------------

    def prepare_load(self, keys: Sequence[OffloadKey]) -> DiskLoadStoreSpec:
        find, state = self._find, self._state
        slots: list[int] = []
        for key in keys:
            slot = find(key)
            if slot < 0 or state[slot] < 0:
                self._unpin(slots)  # all or nothing
                what = "absent" if slot < 0 else "still being stored"
                raise KeyError(f"cannot load key {key.hex()}: it is {what}, not a HIT")
            if state[slot] == 0:
                self._pinned += 1
            state[slot] += 1
            slots.append(slot)
        return DiskLoadStoreSpec(slots, list(keys))

    def _unpin(self, slots: list[int]) -> None:
        state = self._state
        for slot in slots:
            state[slot] -= 1
            if state[slot] == 0:
                self._pinned -= 1

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        self.order.touch(keys)

    def complete_load(self, keys: Sequence[OffloadKey]) -> None:
        find, state = self._find, self._state
        done: list[int] = []
        for key in keys:
            slot = find(key)
            if slot < 0 or state[slot] <= 0:
                for s in done:  # all or nothing
                    if state[s] == 0:
                        self._pinned += 1
                    state[s] += 1
                raise KeyError(f"cannot complete load of key {key.hex()}: no load was prepared")
            state[slot] -= 1
            if state[slot] == 0:
                self._pinned -= 1
            done.append(slot)

    # -- stores ----------------------------------------------------------------------

    def prepare_store(self, keys: Sequence[OffloadKey]) -> PrepareStoreOutput | None:
        index, state, order = self._index, self._state, self.order
        unique = list(dict.fromkeys(keys))
        index.check_keys(unique)
        present, new_keys = index.split(unique)
        if not order.admits_all:
            new_keys = [key for key in new_keys if order.admit(key)]
        free = self._free
        available = self.num_blocks - self._next_unused + len(free)
        shortfall = len(new_keys) - available
        evicted: list[OffloadKey] = []
        if shortfall > 0:
            if len(new_keys) > self.num_blocks:
                return None
            retention = self.retention
            retention.expire()
            named_keys, named_slots = retention.protect(set(keys)), set(present)
            victims = order.evict(shortfall, named_keys, retention.protect(named_slots, index.key_of))
            if victims is None:
                return None
            evicted = index.keys_of(victims)  # OffloadKey is bytes
            index.remove_many(victims)
            for slot in victims:
                state[slot] = _FREE
            free.extend(victims)
            self._counters.evictions += len(victims)
            if self.enable_events:
                self._events.append(OffloadingEvent(evicted, self.medium, True))
        # Never-used slots first, in increasing order; then freed ones, last freed first.
        fresh = min(len(new_keys), self.num_blocks - self._next_unused)
        slots = list(range(self._next_unused, self._next_unused + fresh))
        self._next_unused += fresh
        reused = len(new_keys) - fresh
        if reused:
            slots.extend(reversed(free[-reused:]))
            del free[-reused:]
        index.insert_many(new_keys, slots)
        for slot in slots:
            state[slot] = -1
        self._in_flight += len(new_keys)
        order.insert(new_keys, slots)
        return PrepareStoreOutput(new_keys, DiskLoadStoreSpec(slots, new_keys), evicted)

    def complete_store(self, keys: Sequence[OffloadKey], success: bool = True) -> None:
        find, state = self._find, self._state
        done = []
        for key in keys:
            slot = find(key)
            if slot < 0 or state[slot] != -1:
                continue
            self._in_flight -= 1
            if success:
                state[slot] = 0
                done.append(key)
            else:
                self._drop(key, slot)
        if done and self.enable_events:
            self._events.append(OffloadingEvent(done, self.medium, False))

    def holds(self, key: OffloadKey) -> bool:
        return self._find(key) >= 0

    def _drop(self, key: OffloadKey, slot: int) -> None:
        self.retention.forget((key,))
        self.order.remove(key, slot)
        self._index.remove(slot)
        self._state[slot] = _FREE
        self._free.append(slot)

    def discard(self, keys: Sequence[OffloadKey]) -> None:
        find, state = self._find, self._state
        dropped = []
        for key in dict.fromkeys(keys):
            slot = find(key)
            if slot < 0 or state[slot] != 0:
                continue
            self._drop(key, slot)
            dropped.append(key)
        self._counters.discarded += len(dropped)
        if dropped and self.enable_events:
            self._events.append(OffloadingEvent(dropped, self.medium, True))

    # -- housekeeping ----------------------------------------------------------------

    def take_events(self) -> list[OffloadingEvent]:
        events, self._events = self._events, []
        return events

    def reset(self) -> None:
        """Drop every block from the index (the bytes stay on disk until their slots are
        reused; a restart finds the intact ones again)."""
        used = np.flatnonzero(self._state_array >= 0)
        if len(used) and self.enable_events:
            key_of = self._index.key_of
            self._events.append(
                OffloadingEvent([OffloadKey(key_of(s)) for s in used.tolist()], self.medium, True)
            )
        self._index.clear()
        self._state_array.fill(_FREE)
        self.order.clear()
        self._next_unused = 0
        del self._free[:]
        self._in_flight = 0
        self._pinned = 0
        self.retention.clear()

    def stats(self) -> TierStats:
        return TierStats(
            medium=self.medium,
            capacity=self.num_blocks,
            used=self._index.size,
            in_flight=self._in_flight,
            pinned=self._pinned,
            hits=self._hits,
            misses=self._misses,
            evictions=self._counters.evictions,
        )

    def counters(self) -> FSManagerCounters:
        return self._counters.snapshot()

    def on_new_request(self, request: RequestContext) -> None:
        self.order.on_new_request(request)

    def on_request_finished(
        self,
        request: RequestContext,
        key_groups: Sequence[Sequence[OffloadKey]],
        inserted: Set[OffloadKey],
        reused: Set[OffloadKey],
    ) -> None:
        self.order.on_request_finished(request, key_groups, inserted, reused)

    def close(self) -> None:
        """Release the namespace locks; the manager must not be used afterwards."""
        fds, self._lock_fds = getattr(self, "_lock_fds", []), []
        for fd in fds:
            os.close(fd)

    def __del__(self) -> None:
        self.close()
