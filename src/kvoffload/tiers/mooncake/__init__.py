"""The Mooncake tier (``"mooncake"``): blocks in a Mooncake Store that engine replicas share.

* ``MooncakeOffloadingManager`` (``manager``): scheduler-side index of the blocks believed
  present; asks the master only through ``MooncakeLookups`` (``lookups``), off the
  scheduler thread. What they share with the Redis tier lives in
  ``kvoffload.tiers.shared_store_manager`` and ``shared_store_lookups`` (and the entry's
  common part in ``shared_store_tier``); these modules hold what Mooncake does differently.
* ``MooncakeWorker`` (``worker``): host pool <-> store jobs, batched, zero-copy through
  registered memory.
* ``store``: ``MooncakeStore``, the one owner of a native client (breaker, refusal after
  close, setup off the engine's threads); ``names``: the spec and object names; ``tier``:
  the ``secondary_tiers`` entry. Values use the Redis tier's format
  (``kvoffload.tiers.redis.format``).

Names are re-exported lazily: importing the manager never loads torch or Mooncake.
"""

from kvoffload._lazy import lazy_exports

_EXPORTS = {
    "MooncakeOffloadingManager": "kvoffload.tiers.mooncake.manager",
    "MooncakeManagerCounters": "kvoffload.tiers.mooncake.manager",
    "MooncakeWorker": "kvoffload.tiers.mooncake.worker",
    "MooncakeWorkerCounters": "kvoffload.tiers.mooncake.worker",
    "MooncakeLookups": "kvoffload.tiers.mooncake.lookups",
    "MooncakeStore": "kvoffload.tiers.mooncake.store",
    "ClientSettings": "kvoffload.tiers.mooncake.store",
    "StoreClosed": "kvoffload.tiers.mooncake.store",
    "MooncakeLoadStoreSpec": "kvoffload.tiers.mooncake.names",
    "MooncakeTierType": "kvoffload.tiers.mooncake.tier",
    "MOONCAKE_KEYS": "kvoffload.tiers.mooncake.tier",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
