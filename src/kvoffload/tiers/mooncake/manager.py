"""``MooncakeOffloadingManager``: the scheduler-side view of the shared Mooncake Store tier.

A ``SharedStoreManager`` (``kvoffload.tiers.shared_store_manager``: local index, probes
answered ``RETRY`` then ``HIT``/``MISS``, adoption, budget deletions, reconciliation,
events of this engine's own blocks) for medium ``MEDIUM_MOONCAKE``, asking the master
through ``MooncakeLookups`` only. What is the Mooncake tier's own:

* the store sends no notifications: blocks it dropped (its background eviction, a master
  restart, which empties it) are found by the periodic reconciliation, and by one at
  once when the master answers again after an outage (the lookups' ``resync``); they are
  announced removed if this engine announced them;
* budget deletions are forced removals (probes and reads hold leases);
* the master is down while its client is not set up or its breaker is open.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvoffload.specs import MEDIUM_MOONCAKE
from kvoffload.tiers.mooncake.names import MooncakeLoadStoreSpec
from kvoffload.tiers.shared_store_manager import SharedStoreCounters, SharedStoreManager


@dataclass
class MooncakeManagerCounters(SharedStoreCounters):
    """``SharedStoreCounters``; ``gone`` counts reconciliations' findings only."""


class MooncakeOffloadingManager(SharedStoreManager):
    """``SharedStoreManager(lookups: MooncakeLookups, capacity, ...)`` for the Mooncake tier."""

    medium = MEDIUM_MOONCAKE
    spec_type = MooncakeLoadStoreSpec
    counters_type = MooncakeManagerCounters
