"""``SharedStoreTierType``: what the shared-store tier types (``redis``, ``mooncake``,
``s3``) build alike.

They keep one value per rank's share of a block in the Redis tier's format
(``kvoffload.tiers.redis.format``: ``value_bytes``, ``KeyNames`` under ``redis_namespace``
of the rank's identity; the object tier overrides ``_names`` with its ``/``-separated
``ObjectNames`` of the same namespace), and build a ``SharedStoreManager`` over a
``StoreLookups``:

* the index holds ``bytes_to_use // (value bytes x world_size)`` blocks (every rank's
  share counted; a budget that holds no block is a ``ValueError`` naming it), or
  ``max_index_blocks`` without a budget; with a budget, the blocks this engine wrote are
  deleted when the index evicts them;
* a worker whose host pool disagrees with the sizing (``TierContext.block_bytes``) is
  closed and refused, naming both sizes.

A subclass parses its entry, sets ``prefix``, ``bytes_to_use``, ``max_index_blocks``,
``probe_timeout`` and ``reconcile_interval``, and gives ``_manager_type`` and ``_lookups``
(importing them on use). ``NAME``, ``MAX_INDEX_BLOCKS`` and ``PROBE_TIMEOUT`` are the
entry keys that mean the same in both.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvoffload.settings import POSITIVE_INT, POSITIVE_SECONDS, Key, text
from kvoffload.tiers.redis.format import KeyNames, redis_namespace, value_bytes
from kvoffload.tiers.secondary import SecondaryTierType, TierContext
from kvoffload.worker import OffloadingWorker

if TYPE_CHECKING:
    from kvoffload.tiers.shared_store_lookups import StoreLookups
    from kvoffload.tiers.shared_store_manager import SharedStoreManager

NAME = text(
    "name", "be a non-empty name without spaces or ':'", lambda v: v != "" and not set(v) & set(" :\n\r\0")
)
MAX_INDEX_BLOCKS = Key(
    "max_index_blocks", POSITIVE_INT, 1_000_000, "blocks the local index tracks without `bytes_to_use`"
)
PROBE_TIMEOUT = Key(
    "probe_timeout_s", POSITIVE_SECONDS, 1.0, "a lookup still unanswered after this is a miss"
)


class SharedStoreTierType(SecondaryTierType):
    prefix: str
    bytes_to_use: int | None
    max_index_blocks: int
    probe_timeout: float
    reconcile_interval: float

    def _manager_type(self) -> type[SharedStoreManager]:
        raise NotImplementedError

    def _lookups(self, names: Sequence[KeyNames]) -> StoreLookups:
        """The manager's lookups over every rank's names (rank 0 first)."""
        raise NotImplementedError

    def _names(self, context: TierContext, rank: int | None = None) -> KeyNames:
        """The names of one rank's shares (default: this worker's)."""
        return KeyNames(self.prefix, redis_namespace(context.rank_identity(rank)))

    def _capacity(self, context: TierContext) -> int:
        """Blocks the index holds: the budget over every rank's value, or ``max_index_blocks``."""
        if self.bytes_to_use is None:
            return self.max_index_blocks
        per_block = value_bytes(context.block_bytes) * context.world_size
        capacity = self.bytes_to_use // per_block
        if capacity == 0:
            raise ValueError(f"bytes_to_use={self.bytes_to_use} holds no block ({per_block} bytes each)")
        return capacity

    def build_manager(self, context: TierContext, eviction_policy: str) -> SharedStoreManager:
        capacity = self._capacity(context)  # before the lookups start their threads
        manager_type = self._manager_type()
        lookups = self._lookups([self._names(context, rank) for rank in range(context.world_size)])
        return manager_type(
            lookups,
            capacity,
            eviction_policy,
            enable_events=True,
            delete_on_evict=self.bytes_to_use is not None,
            probe_timeout=self.probe_timeout,
            reconcile_interval=self.reconcile_interval,
        )

    @staticmethod
    def _checked(worker: OffloadingWorker, context: TierContext) -> OffloadingWorker:
        """``worker`` if its pool's block bytes match the sizing; else it is closed and refused."""
        if worker.block_bytes != context.block_bytes:
            worker.close()
            raise ValueError(
                f"the host pool holds {worker.block_bytes} bytes per block but the tier was sized "
                f"for {context.block_bytes}"
            )
        return worker
