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
from collections.abc import Sequence
from dataclasses import dataclass

from kvoffload.cpu import CPUOffloadingManager
from kvoffload.keys import OffloadKey
from kvoffload.manager import LookupResult, PrepareStoreOutput
from kvoffload.sim.tiered import block_tokens
from kvoffload.specs import MEDIUM_DISK, DiskLoadStoreSpec
from kvoffload.tiers.tiered import Admit, TieredOffloadingManager

_HIT = LookupResult.HIT
_MISS = LookupResult.MISS


class SimDiskTier(CPUOffloadingManager):
    """The CPU tier's bookkeeping of ``num_blocks`` disk slots, under medium ``"DISK"``."""

    medium = MEDIUM_DISK

    def prepare_load(self, keys: Sequence[OffloadKey]) -> DiskLoadStoreSpec:
        return DiskLoadStoreSpec(super().prepare_load(keys).block_ids, keys)

    def prepare_store(self, keys: Sequence[OffloadKey]) -> PrepareStoreOutput | None:
        out = super().prepare_store(keys)
        if out is None:
            return None
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

    @property
    def loaded(self) -> int:
        """Blocks loaded CPU -> device (CPU and disk hits)."""
        return self.cpu_hits + self.disk_hits

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
    def hit_ratio(self) -> float:
        return self._ratio(self.device_hits + self.cpu_hits + self.disk_hits)

    @property
    def requests_per_second(self) -> float:
        return self.requests / self.seconds if self.seconds > 0 else float("inf")


def _block_tokens(length: int, index: int, block_size: int) -> int:
    """Prompt tokens in block ``index`` of a prompt of ``length`` tokens."""
    return max(0, min(block_size, length - index * block_size))


def run_transfers(tiers: TieredOffloadingManager) -> tuple[int, int]:
    """Hand out the pending transfers between tiers and complete each with success; the
    blocks (promoted from disk, written to disk) they moved."""
    up = down = 0
    for transfer in tiers.take_transfers():
        if transfer.src_spec.medium == MEDIUM_DISK:
            up += len(transfer.src_spec.block_ids)
        else:
            down += len(transfer.dst_spec.block_ids)
        tiers.complete_transfer(transfer.token, True)
    return up, down


def replay_disk(
    tiers: TieredOffloadingManager,
    key_lists: Sequence[Sequence[OffloadKey]],
    served: Sequence[int],
    input_lengths: Sequence[int],
    block_size: int,
) -> DiskResult:
    """Drive ``tiers`` (a CPU tier over one disk tier) with the protocol above, behind a
    device tier whose per-request hits are ``served``."""
    if not len(key_lists) == len(served) == len(input_lengths):
        raise ValueError("key_lists, served and input_lengths must have one entry per request")
    if len(tiers.secondaries) != 1:
        raise ValueError(f"replay_disk drives one secondary tier, got {len(tiers.secondaries)}")
    primary, disk = tiers.primary, tiers.secondaries[0]
    lookup, touch = tiers.lookup, tiers.touch
    primary_prefix = primary.lookup_prefix
    prepare_load, complete_load = tiers.prepare_load, tiers.complete_load
    prepare_store, complete_store = tiers.prepare_store, tiers.complete_store
    cpu_evictions0, disk_evictions0 = primary.stats().evictions, disk.stats().evictions
    n_keys = device_hits = cpu_hits = disk_hits = stored = promoted = not_promoted = written = 0
    device_tokens = cpu_tokens = disk_tokens = prompt_tokens = 0
    start = time.perf_counter()
    for keys, d, length in zip(key_lists, served, input_lengths):
        n = len(keys)
        n_keys += n
        prompt_tokens += length
        touch(keys)
        on_disk: dict[OffloadKey, int] = {}  # key -> its index in the request
        for i in range(d, n):
            result = lookup(keys[i])
            if result is _MISS:
                break
            if result is not _HIT:
                on_disk[keys[i]] = i
        up, down = run_transfers(tiers)  # the promotions asked for (and any other transfer)
        promoted += up
        written += down
        not_promoted += max(0, len(on_disk) - up)
        rest = keys[d:] if d else keys
        h = primary_prefix(rest)
        if h:
            prefix = rest[:h]
            prepare_load(prefix)
            complete_load(prefix)
            from_disk = [i for i in on_disk.values() if i < d + h]
            disk_hits += len(from_disk)
            disk_tokens += sum(_block_tokens(length, i, block_size) for i in from_disk)
            cpu_hits += h - len(from_disk)
        if d + h < n:
            out = prepare_store(rest[h:])
            if out is not None:
                complete_store(out.keys_to_store)
                stored += len(out.keys_to_store)
                up, down = run_transfers(tiers)
                promoted += up
                written += down
        device_hits += d
        dt = block_tokens(length, d, block_size)
        device_tokens += dt
        cpu_tokens += block_tokens(length, d + h, block_size) - dt  # disk tokens taken out below
    seconds = time.perf_counter() - start
    cpu_tokens -= disk_tokens
    return DiskResult(
        requests=len(key_lists),
        keys=n_keys,
        device_hits=device_hits,
        cpu_hits=cpu_hits,
        disk_hits=disk_hits,
        stored=stored,
        promoted=promoted,
        not_promoted=not_promoted,
        written=written,
        cpu_evicted=primary.stats().evictions - cpu_evictions0,
        disk_evicted=disk.stats().evictions - disk_evictions0,
        device_tokens=device_tokens,
        cpu_tokens=cpu_tokens,
        disk_tokens=disk_tokens,
        prompt_tokens=prompt_tokens,
        seconds=seconds,
    )
