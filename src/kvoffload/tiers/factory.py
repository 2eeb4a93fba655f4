"""Tiers from configuration: the scheduler-side manager and the worker-side worker.

An engine adapter builds both halves from one ``TierConfig`` and the bytes one offloaded
block takes on the host (a page of every KV tensor, ``blocks_per_offload_block`` times),
so the scheduler's slot ids and the worker's host pool always agree on the block count:

* ``build_manager(config, block_bytes)`` -> the ``OffloadingManager`` the scheduler plans
  with (today the CPU tier, ``kvoffload.cpu.CPUOffloadingManager``);
* ``build_worker(config, layout, block_bytes)`` -> the ``OffloadingWorker`` that moves the
  jobs (a ``WorkerRouter`` over the host-memory ``TransferEngine``). It imports the
  transfer layer (torch) only when called: the scheduler side never loads it.

Every error is a ``ValueError`` naming the setting and its bad value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvoffload.cpu import CPUOffloadingManager
from kvoffload.manager import OffloadingManager
from kvoffload.policies import resolve_policy
from kvoffload.validation import positive_int
from kvoffload.worker import OffloadingWorker, WorkerRouter

if TYPE_CHECKING:
    from kvoffload.transfer.layout import KVLayout


@dataclass(frozen=True)
class TierConfig:
    """``cpu_bytes_to_use`` host bytes for the CPU tier; an offloaded block spans
    ``blocks_per_offload_block`` device blocks; ``eviction_policy`` names a policy."""

    cpu_bytes_to_use: int
    blocks_per_offload_block: int = 1
    eviction_policy: str = "lru"

    def __post_init__(self) -> None:
        positive_int("cpu_bytes_to_use", self.cpu_bytes_to_use)
        positive_int("blocks_per_offload_block", self.blocks_per_offload_block)
        try:
            resolve_policy(self.eviction_policy)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"eviction_policy: {exc}") from None

    def num_host_blocks(self, block_bytes: int) -> int:
        """How many offloaded blocks of ``block_bytes`` fit in ``cpu_bytes_to_use``."""
        positive_int("block_bytes", block_bytes)
        count = self.cpu_bytes_to_use // block_bytes
        if count == 0:
            raise ValueError(
                f"cpu_bytes_to_use={self.cpu_bytes_to_use} holds no offloaded block "
                f"({block_bytes} bytes each)"
            )
        return count


def build_manager(config: TierConfig, block_bytes: int, enable_events: bool = True) -> OffloadingManager:
    """The scheduler-side manager of the configured tiers."""
    return CPUOffloadingManager(config.num_host_blocks(block_bytes), config.eviction_policy, enable_events)


def build_worker(config: TierConfig, layout: KVLayout, block_bytes: int) -> OffloadingWorker:
    """The worker side of the configured tiers, over the device KV described by ``layout``."""
    from kvoffload.transfer.engine import TransferEngine
    from kvoffload.transfer.host_pool import HostBlockPool

    pool = HostBlockPool(layout, config.num_host_blocks(block_bytes), config.blocks_per_offload_block)
    return WorkerRouter([TransferEngine(layout, pool)])
