"""An object-storage tier under the disk tier in the replay (``kvoffload.sim.disk``): its
bookkeeping, and the two ways blocks can reach it.

``SimObjectTier(num_blocks)`` is the CPU tier's bookkeeping under medium ``"OBJECT"``
(specs of keys, as the real tier's, ``kvoffload.tiers.s3``); no bytes move.

``OBJECT_WRITES`` names when a block is written to it:

* ``"through"`` (what kvoffload does): every block stored to the CPU tier is written
  through to the object tier, as to the disk tier (the tiered manager offers it to both);
* ``"on-eviction"``: the object tier takes a block only when the disk tier evicts it (read
  back from disk first: counted in ``eviction_reads``), so the object tier holds what fell
  out of the disk rather than a copy of it.

``build_object_tiers(...)`` gives the tiered manager of a CPU tier, a disk tier and an
object tier wired for one of them. The replay attributes each promoted block to the tier
it came from (``kvoffload.sim.disk.run_transfers``).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvoffload.cpu import CPUOffloadingManager
from kvoffload.keys import OffloadKey
from kvoffload.manager import PrepareStoreOutput
from kvoffload.specs import MEDIUM_OBJECT, RemoteLoadStoreSpec
from kvoffload.tiers.tiered import Admit, TieredOffloadingManager

OBJECT_WRITES = ("through", "on-eviction")
DEFAULT_OBJECT_WRITES = "through"


class _ObjectSpec(RemoteLoadStoreSpec):
    medium = MEDIUM_OBJECT


class SimObjectTier(CPUOffloadingManager):
    """The CPU tier's bookkeeping of ``num_blocks`` objects, under medium ``"OBJECT"``."""

    medium = MEDIUM_OBJECT

    def __init__(self, num_blocks: int, policy: str = "lru") -> None:
        super().__init__(num_blocks, policy)
        self.eviction_writes = 0  # blocks taken from the disk tier's evictions

    def prepare_load(self, keys: Sequence[OffloadKey]) -> _ObjectSpec:
        super().prepare_load(keys)
        return _ObjectSpec(keys)

    def prepare_store(self, keys: Sequence[OffloadKey]) -> PrepareStoreOutput | None:
        out = super().prepare_store(keys)
        if out is None:
            return None
        return PrepareStoreOutput(out.keys_to_store, _ObjectSpec(out.keys_to_store), out.evicted_keys)

    def take_evicted(self, keys: Sequence[OffloadKey]) -> None:
        """Store what the disk tier just evicted (those not held already), at once."""
        out = self.prepare_store(keys)
        if out is not None and out.keys_to_store:
            self.complete_store(out.keys_to_store)
            self.eviction_writes += len(out.keys_to_store)


def _never(key: OffloadKey) -> bool:
    return False


def build_object_tiers(
    cpu_blocks: int,
    disk_blocks: int,
    object_blocks: int,
    policy: str = "lru",
    disk_policy: str | None = None,
    admit: Admit | None = None,
    writes: str = DEFAULT_OBJECT_WRITES,
) -> TieredOffloadingManager:
    """A CPU tier over a disk tier (``admit`` its admission rule) over an object tier whose
    blocks arrive as ``writes`` says."""
    from kvoffload.sim.disk import SimDiskTier

    if writes not in OBJECT_WRITES:
        raise ValueError(f"unknown object writes {writes!r}; known: {', '.join(OBJECT_WRITES)}")
    objects = SimObjectTier(object_blocks, disk_policy or policy)
    disk = SimDiskTier(disk_blocks, disk_policy or policy)
    if writes == "on-eviction":
        disk.on_evict = objects.take_evicted
    rules = [admit, None if writes == "through" else _never]
    return TieredOffloadingManager(CPUOffloadingManager(cpu_blocks, policy), [disk, objects], rules)
