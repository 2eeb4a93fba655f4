"""Tiers from configuration: the scheduler-side manager and the worker-side worker.

An engine adapter builds both halves from one ``TierConfig`` and the bytes one offloaded
block takes on the host (a page of every KV tensor, ``blocks_per_offload_block`` times),
so the scheduler's slot ids and the worker's host pool always agree on the block count:

* ``build_manager(config, block_bytes, identity, world_size=W)`` -> the ``OffloadingManager`` the
  scheduler plans with: the CPU tier (``kvoffload.cpu.CPUOffloadingManager``) alone, or a
  ``TieredOffloadingManager`` over it and the configured secondary tiers;
* ``build_worker(config, layout, block_bytes, identity, rank, world_size=W)`` -> the
  ``OffloadingWorker`` that moves the jobs: a ``WorkerRouter`` over the host-memory
  ``TransferEngine`` and each secondary tier's worker. It imports the transfer layer
  (torch) only when called: the scheduler side never loads it.

With tensor (or pipeline) parallelism each of the ``W`` workers holds its own share of
every block (``block_bytes`` is one worker's); the byte budgets (``cpu_bytes_to_use``, a
secondary tier's ``bytes_to_use``) are totals over the ``W`` workers, as in vLLM, so each
worker's host pool holds ``cpu_bytes_to_use // (block_bytes * W)`` blocks, and a block is
in a tier only when every worker holds its share (``TierContext``).

The host pool reserves a prefix before each block's payload when a secondary tier asks
for one (``host_row_prefix``: the Mooncake tier keeps each object's header there, so an
object is one buffer); without such a tier its layout is the default one. The prefix is
not counted in ``cpu_bytes_to_use`` (at most 4 KiB per block, 128 bytes unless a disk tier
reads with ``O_DIRECT``).

Session controls (``kvoffload.scheduler.sessions``): every tier retains sessions' blocks
within ``retention_fraction`` of its capacity (the CPU tier, the disk tier, the shared
stores: every built tier with a ``retention`` index); the tiered manager issues a
session's prefetch ``prefetch_batch`` keys at a time, at most ``prefetch_in_flight``
transfers in flight (``kvoffload.tiers.tiered_sessions``).

``identity`` describes what the block bytes mean (model, dtype, layout, block size, group
specs, hash seed); secondary tiers derive their namespace from it
(``kvoffload.tiers.secondary.TierContext``).

Every error is a ``ValueError`` naming the setting and its bad value.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvoffload.cpu import CPUOffloadingManager
from kvoffload.extras import require
from kvoffload.manager import OffloadingManager
from kvoffload.policies import resolve_policy
from kvoffload.retention import retention_budget
from kvoffload.settings import POSITIVE_INT, Key, Kind, custom
from kvoffload.tiers.secondary import SecondaryTierType, TierContext
from kvoffload.tiers.tiered import TieredOffloadingManager
from kvoffload.validation import positive_int
from kvoffload.worker import OffloadingWorker, WorkerRouter

if TYPE_CHECKING:
    from kvoffload.transfer.layout import KVLayout

DEFAULT_RETENTION_FRACTION = 0.25
DEFAULT_PREFETCH_IN_FLIGHT = 2
DEFAULT_PREFETCH_BATCH = 64


def _policy(where: str, value: Any) -> Any:
    try:
        resolve_policy(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: {exc}") from None
    return value


# The ``eviction_policy`` key, as every engine adapter's configuration takes it.
EVICTION_POLICY = Key(
    "eviction_policy",
    custom("policy name or `package.module:ClassName`", _policy),
    "lru",
    "the eviction policy of every tier: `lru`, `arc`, `s3fifo`, `wtinylfu`, `turnlru`, … or a "
    "`CachePolicy` subclass by import path",
)


def _is_fraction(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= 1


# The session-control keys of the tiers, as every engine adapter's configuration takes them.
RETENTION_FRACTION = Key(
    "retention_fraction",
    Kind("number in [0, 1]", "be a number in [0, 1]", _is_fraction, float),
    DEFAULT_RETENTION_FRACTION,
    "the share of each tier's blocks (CPU, disk, shared stores) that sessions' retention may hold "
    '(README\'s "Sessions and controls"); past it a retention is trimmed from its tail; `0` retains nothing',
)
PREFETCH_IN_FLIGHT = Key(
    "prefetch_in_flight",
    POSITIVE_INT,
    DEFAULT_PREFETCH_IN_FLIGHT,
    "session prefetches (promotions from the tiers below CPU into CPU) in flight at most: a request's own "
    "promotion waits behind at most this many",
)
PREFETCH_BATCH = Key(
    "prefetch_batch",
    POSITIVE_INT,
    DEFAULT_PREFETCH_BATCH,
    "offloaded blocks one session prefetch transfer promotes at most (prefetches are issued only in steps "
    "where no request's promotion waits)",
)


@dataclass(frozen=True)
class TierConfig:
    """``cpu_bytes_to_use`` host bytes for the CPU tier; an offloaded block spans
    ``blocks_per_offload_block`` device blocks; ``eviction_policy`` names a policy (of
    every tier); ``secondary_tiers`` below the CPU tier, fastest first
    (``kvoffload.tiers.secondary.parse_secondary_tiers``); ``retention_fraction``: the
    share of every tier sessions may retain; ``prefetch_in_flight``, ``prefetch_batch``:
    the bounds of session prefetches (with secondary tiers)."""

    cpu_bytes_to_use: int
    blocks_per_offload_block: int = 1
    eviction_policy: str = "lru"
    secondary_tiers: tuple[SecondaryTierType, ...] = ()
    retention_fraction: float = DEFAULT_RETENTION_FRACTION
    prefetch_in_flight: int = DEFAULT_PREFETCH_IN_FLIGHT
    prefetch_batch: int = DEFAULT_PREFETCH_BATCH

    def __post_init__(self) -> None:
        positive_int("cpu_bytes_to_use", self.cpu_bytes_to_use)
        positive_int("blocks_per_offload_block", self.blocks_per_offload_block)
        retention_budget(0, self.retention_fraction)  # ValueError naming retention_fraction
        positive_int("prefetch_in_flight", self.prefetch_in_flight)
        positive_int("prefetch_batch", self.prefetch_batch)
        try:
            resolve_policy(self.eviction_policy)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"eviction_policy: {exc}") from None

    def num_host_blocks(self, block_bytes: int, world_size: int = 1) -> int:
        """How many offloaded blocks fit in ``cpu_bytes_to_use`` when each of ``world_size``
        workers holds ``block_bytes`` of every block."""
        positive_int("block_bytes", block_bytes)
        positive_int("world_size", world_size)
        count = self.cpu_bytes_to_use // (block_bytes * world_size)
        if count == 0:
            each = f"{block_bytes} bytes each" + (f" on {world_size} workers" if world_size > 1 else "")
            raise ValueError(f"cpu_bytes_to_use={self.cpu_bytes_to_use} holds no offloaded block ({each})")
        return count


def build_manager(
    config: TierConfig,
    block_bytes: int,
    identity: Mapping[str, Any] | None = None,
    enable_events: bool = True,
    world_size: int = 1,
) -> OffloadingManager:
    """The scheduler-side manager of the configured tiers, for ``world_size`` workers."""
    num_blocks = config.num_host_blocks(block_bytes, world_size)
    fraction = config.retention_fraction
    cpu = CPUOffloadingManager(num_blocks, config.eviction_policy, enable_events, retention_fraction=fraction)
    if not config.secondary_tiers:
        return cpu
    context = TierContext(block_bytes, dict(identity or {}), 0, world_size)
    secondaries = [tier.build_manager(context, config.eviction_policy) for tier in config.secondary_tiers]
    for tier in secondaries:
        _set_retention_fraction(tier, fraction)
    return TieredOffloadingManager(
        cpu,
        secondaries,
        prefetch_in_flight=config.prefetch_in_flight,
        prefetch_batch=config.prefetch_batch,
    )


def _set_retention_fraction(tier: OffloadingManager, fraction: float) -> None:
    """A secondary tier's retention budget, ``fraction`` of its capacity: a tier type builds
    its manager with the default fraction (its ``build_manager`` takes no such argument),
    and a new manager retains nothing yet, so its budget is set here. A tier with no
    ``retention`` index (an out-of-tree one) retains with its own rules."""
    retention = getattr(tier, "retention", None)
    if retention is None:
        return
    retention.budget = retention_budget(tier.stats().capacity, fraction)


def host_row_prefix(config: TierConfig, block_bytes: int) -> int:
    """Bytes the host pool reserves before each block's payload: the most any secondary
    tier asks for (its ``host_row_prefix_bytes``), 0 with none or for a tensor-major pool
    (``blocks_per_offload_block`` > 1: such a tier moves its header as a buffer of its own
    then). Rounded up to ``DIRECT_ALIGN`` when a tier reads into the pool with ``O_DIRECT``
    (a disk tier's ``direct_reads``) and blocks are whole such units, so its reads stay
    aligned."""
    from kvoffload.tiers.fs.direct import DIRECT_ALIGN

    tiers = config.secondary_tiers
    prefix = max((int(getattr(t, "host_row_prefix_bytes", 0)) for t in tiers), default=0)
    if not prefix or config.blocks_per_offload_block != 1:
        return 0
    if block_bytes % DIRECT_ALIGN == 0 and any(getattr(t, "direct_reads", False) for t in tiers):
        prefix = -(-prefix // DIRECT_ALIGN) * DIRECT_ALIGN
    return prefix


def build_worker(
    config: TierConfig,
    layout: KVLayout,
    block_bytes: int,
    identity: Mapping[str, Any] | None = None,
    rank: int = 0,
    world_size: int = 1,
) -> OffloadingWorker:
    """Worker ``rank``'s side of the configured tiers, over the device KV described by
    ``layout``."""
    require("torch", "torch", "the worker side of the tiers (kvoffload.transfer)")
    from kvoffload.transfer.engine import TransferEngine
    from kvoffload.transfer.host_pool import HostBlockPool

    num_blocks = config.num_host_blocks(block_bytes, world_size)
    prefix = host_row_prefix(config, block_bytes)
    pool = HostBlockPool(layout, num_blocks, config.blocks_per_offload_block, row_prefix_bytes=prefix)
    workers: list[OffloadingWorker] = [TransferEngine(layout, pool)]
    context = TierContext(block_bytes, dict(identity or {}), rank, world_size)
    try:
        workers += [tier.build_worker(context, pool) for tier in config.secondary_tiers]
    except BaseException:
        for worker in workers:
            worker.close()
        raise
    return WorkerRouter(workers)
