"""Replay through the device tier, the CPU tier and a disk tier below it, driven through the
real ``TieredOffloadingManager`` (write-through, promotion, admission).

The disk tier's bookkeeping is ``SimDiskTier``: the CPU tier's, under medium ``"DISK"``,
with a capacity in blocks. No bytes move; a transfer between tiers completes (with
success) as soon as it is handed out.

Protocol, per request (extends ``kvoffload.sim.tiered``'s; with no disk tier it is that
protocol exactly, and ``replay_disk`` is not needed):

1. the device tier serves the longest prefix it holds (``d`` blocks, ``device_prefixes``);
2. the tiered manager's policies are touched with *all* the request's keys (the CPU and
   the disk tier's, as the scheduler does once per request);
3. the keys after ``d`` are looked up in order until the first ``MISS``: a CPU ``HIT`` is
   loadable; a key only on disk answers ``PENDING`` and is asked to be promoted; the scan
   goes on past it, as the scheduler's does, so that one batch promotes the whole prefix;
4. ``take_transfers()`` is run and every transfer completed at once (``run_transfers``):
   the promotions asked for in step 3 (and any other copy a manager queues there; each is
   counted by its direction). A promotion reserves CPU slots, evicting idle CPU blocks
   (none are pinned between requests). When the CPU tier cannot take the whole batch
   (more blocks than it has), nothing is promoted (``not_promoted`` counts those blocks)
   and the request computes them, as if they had missed;
5. the loadable prefix is the CPU tier's leading run of hits after ``d`` (``h`` blocks). A
   key of it that step 3 found on disk is a *disk hit*, the others are *CPU hits*; a key
   promoted but not in the prefix (rare: a promotion evicted an earlier key of the same
   request) is read from disk all the same. The ``h`` blocks are loaded (prepare, complete);
6. the blocks after ``d + h`` (computed by prefill) are stored to the CPU tier (prepare,
   complete); completing the store writes its new blocks through to the disk tier, as far
   as the admission rule and the disk tier's room allow; ``run_transfers`` hands out
   these writes and completes each at once.
7. the device tier then holds the whole request (``device_prefixes``).

Bytes per tier, in blocks: the CPU tier is written by stores (device -> CPU) and
promotions (disk -> CPU) and read by loads (CPU -> device) and write-through (CPU -> disk);
the disk tier is written by write-through and read by promotions.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvoffload.cpu import CPUOffloadingManager
from kvoffload.keys import OffloadKey
from kvoffload.manager import LookupResult, PrepareStoreOutput
from kvoffload.sim.tiered import block_tokens
from kvoffload.specs import MEDIUM_CPU, MEDIUM_DISK, MEDIUM_OBJECT, DiskLoadStoreSpec
from kvoffload.tiers.tiered import Admit, TieredOffloadingManager

_HIT = LookupResult.HIT
_MISS = LookupResult.MISS


class SimDiskTier(CPUOffloadingManager):
    """The CPU tier's bookkeeping of ``num_blocks`` disk slots, under medium ``"DISK"``;
    ``on_evict(keys)``, when set, hears every eviction (an object tier written on eviction,
    ``kvoffload.sim.object_tier``)."""

    medium = MEDIUM_DISK
    on_evict: Callable[[Sequence[OffloadKey]], None] | None = None

    def prepare_load(self, keys: Sequence[OffloadKey]) -> DiskLoadStoreSpec:
        return DiskLoadStoreSpec(super().prepare_load(keys).block_ids, keys)

    def prepare_store(self, keys: Sequence[OffloadKey]) -> PrepareStoreOutput | None:
        out = super().prepare_store(keys)
        if out is None:
            return None
        if out.evicted_keys and self.on_evict is not None:
            self.on_evict(out.evicted_keys)
        spec = DiskLoadStoreSpec(out.store_spec.block_ids, out.keys_to_store)
        return PrepareStoreOutput(out.keys_to_store, spec, out.evicted_keys)


def build_tiers(
    cpu_blocks: int,
    disk_blocks: int,
    policy: str = "lru",
    disk_policy: str | None = None,
    admit: Admit | None = None,
) -> TieredOffloadingManager:
    """A CPU tier of ``cpu_blocks`` over a ``SimDiskTier`` of ``disk_blocks``; the disk
    tier's eviction policy is ``disk_policy`` (default: ``policy``)."""
    primary = CPUOffloadingManager(cpu_blocks, policy)
    disk = SimDiskTier(disk_blocks, disk_policy or policy)
    return TieredOffloadingManager(primary, [disk], [admit])


@dataclass(frozen=True)
class DiskResult:
    """Block counts of one replay; ``*_tokens`` count prompt tokens in those blocks."""

    requests: int
    keys: int
    device_hits: int
    cpu_hits: int
    disk_hits: int
    stored: int  # device -> CPU
    promoted: int  # disk -> CPU
    not_promoted: int  # found on disk, but the CPU tier could not take the batch
    written: int  # CPU -> disk (write-through)
    cpu_evicted: int
    disk_evicted: int
    device_tokens: int
    cpu_tokens: int
    disk_tokens: int
    prompt_tokens: int
    seconds: float
    # an object tier under the disk (``kvoffload.sim.object_tier``), when there is one
    object_hits: int = 0
    object_tokens: int = 0
    object_promoted: int = 0  # object -> CPU
    object_written: int = 0  # CPU -> object (write-through), or disk -> object (on eviction)
    object_evicted: int = 0
    object_requests: int = 0  # requests with at least one object hit (one round trip each)
    eviction_reads: int = 0  # disk blocks read back to be written to the object tier

    @property
    def loaded(self) -> int:
        """Blocks loaded CPU -> device (CPU, disk and object hits)."""
        return self.cpu_hits + self.disk_hits + self.object_hits

    @property
    def cpu_blocks_read(self) -> int:
        return self.loaded + self.written

    @property
    def cpu_blocks_written(self) -> int:
        return self.stored + self.promoted

    def _ratio(self, n: int) -> float:
        return n / self.keys if self.keys else 0.0

    @property
    def device_hit_ratio(self) -> float:
        return self._ratio(self.device_hits)

    @property
    def cpu_hit_ratio(self) -> float:
        return self._ratio(self.cpu_hits)

    @property
    def disk_hit_ratio(self) -> float:
        return self._ratio(self.disk_hits)

    @property
    def object_hit_ratio(self) -> float:
        return self._ratio(self.object_hits)

    @property
    def hit_ratio(self) -> float:
        return self._ratio(self.device_hits + self.cpu_hits + self.disk_hits + self.object_hits)

    @property
    def requests_per_second(self) -> float:
        return self.requests / self.seconds if self.seconds > 0 else float("inf")


def _block_tokens(length: int, index: int, block_size: int) -> int:
    """Prompt tokens in block ``index`` of a prompt of ``length`` tokens."""
    return max(0, min(block_size, length - index * block_size))


def run_transfers(tiers: TieredOffloadingManager, promoted: dict[OffloadKey, str] | None = None) -> Counter:
    """Hand out the pending transfers between tiers and complete each with success; the
    blocks moved, by ``(direction, medium)``: ``("up", medium)`` promoted from that tier,
    ``("down", medium)`` written to it. ``promoted`` (if given) learns each promoted key's
    tier."""
    moved: Counter = Counter()
    for transfer in tiers.take_transfers():
        src, dst = transfer.src_spec, transfer.dst_spec
        if src.medium == MEDIUM_CPU:
            moved["down", dst.medium] += len(dst.keys)
        else:
            moved["up", src.medium] += len(src.keys)
            if promoted is not None:
                promoted.update(dict.fromkeys(src.keys, src.medium))
        tiers.complete_transfer(transfer.token, True)
    return moved


def replay_disk(
    tiers: TieredOffloadingManager,
    key_lists: Sequence[Sequence[OffloadKey]],
    served: Sequence[int],
    input_lengths: Sequence[int],
    block_size: int,
) -> DiskResult:
    """Drive ``tiers`` (a CPU tier over one disk tier, and optionally an object tier below
    it: ``kvoffload.sim.object_tier``) with the protocol above, behind a device tier whose
    per-request hits are ``served``. A block promoted from the object tier is an object
    hit, one from the disk a disk hit."""
    if not len(key_lists) == len(served) == len(input_lengths):
        raise ValueError("key_lists, served and input_lengths must have one entry per request")
    media = [tier.medium for tier in tiers.secondaries]
    if media not in ([MEDIUM_DISK], [MEDIUM_DISK, MEDIUM_OBJECT]):
        raise ValueError(
            f"replay_disk drives one secondary tier (a disk) or a disk over an object tier, got {media}"
        )
    primary, disk = tiers.primary, tiers.secondaries[0]
    objects = tiers.secondaries[1] if len(media) == 2 else None
    lookup, touch = tiers.lookup, tiers.touch
    primary_prefix = primary.lookup_prefix
    prepare_load, complete_load = tiers.prepare_load, tiers.complete_load
    prepare_store, complete_store = tiers.prepare_store, tiers.complete_store
    evictions0 = [tier.stats().evictions for tier in (primary, disk, objects) if tier is not None]
    eviction_writes0 = getattr(objects, "eviction_writes", 0)
    n_keys = device_hits = cpu_hits = disk_hits = stored = not_promoted = 0
    object_hits = object_tokens = object_requests = 0
    device_tokens = cpu_tokens = disk_tokens = prompt_tokens = 0
    moved: Counter = Counter()
    start = time.perf_counter()
    for keys, d, length in zip(key_lists, served, input_lengths):
        n = len(keys)
        n_keys += n
        prompt_tokens += length
        touch(keys)
        below: dict[OffloadKey, int] = {}  # key -> its index in the request
        for i in range(d, n):
            result = lookup(keys[i])
            if result is _MISS:
                break
            if result is not _HIT:
                below[keys[i]] = i
        source: dict[OffloadKey, str] = {}
        step = run_transfers(tiers, source)  # the promotions asked for (and any other transfer)
        moved += step
        not_promoted += max(0, len(below) - sum(v for (way, _), v in step.items() if way == "up"))
        rest = keys[d:] if d else keys
        h = primary_prefix(rest)
        if h:
            prefix = rest[:h]
            prepare_load(prefix)
            complete_load(prefix)
            lower = [(i, source.get(key, MEDIUM_DISK)) for key, i in below.items() if i < d + h]
            from_objects = [i for i, medium in lower if medium == MEDIUM_OBJECT]
            from_disk = [i for i, medium in lower if medium != MEDIUM_OBJECT]
            disk_hits += len(from_disk)
            disk_tokens += sum(_block_tokens(length, i, block_size) for i in from_disk)
            object_hits += len(from_objects)
            object_tokens += sum(_block_tokens(length, i, block_size) for i in from_objects)
            object_requests += bool(from_objects)
            cpu_hits += h - len(lower)
        if d + h < n:
            out = prepare_store(rest[h:])
            if out is not None:
                complete_store(out.keys_to_store)
                stored += len(out.keys_to_store)
                moved += run_transfers(tiers)
        device_hits += d
        dt = block_tokens(length, d, block_size)
        device_tokens += dt
        cpu_tokens += block_tokens(length, d + h, block_size) - dt  # lower tiers' tokens taken out below
    seconds = time.perf_counter() - start
    cpu_tokens -= disk_tokens + object_tokens
    evicted = [tier.stats().evictions - e0 for tier, e0 in zip((primary, disk, objects), evictions0)]
    eviction_writes = getattr(objects, "eviction_writes", 0) - eviction_writes0
    return DiskResult(
        requests=len(key_lists),
        keys=n_keys,
        device_hits=device_hits,
        cpu_hits=cpu_hits,
        disk_hits=disk_hits,
        stored=stored,
        promoted=moved["up", MEDIUM_DISK],
        not_promoted=not_promoted,
        written=moved["down", MEDIUM_DISK],
        cpu_evicted=evicted[0],
        disk_evicted=evicted[1],
        device_tokens=device_tokens,
        cpu_tokens=cpu_tokens,
        disk_tokens=disk_tokens,
        prompt_tokens=prompt_tokens,
        seconds=seconds,
        object_hits=object_hits,
        object_tokens=object_tokens,
        object_promoted=moved["up", MEDIUM_OBJECT],
        object_written=moved["down", MEDIUM_OBJECT] + eviction_writes,
        object_evicted=evicted[2] if objects is not None else 0,
        object_requests=object_requests,
        eviction_reads=eviction_writes,
    )
