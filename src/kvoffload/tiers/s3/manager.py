"""``S3OffloadingManager``: the scheduler-side view of the object-storage tier.

A ``SharedStoreManager`` (``kvoffload.tiers.shared_store_manager``: local index, probes
answered ``RETRY`` then ``HIT``/``MISS``, adoption, budget deletions, reconciliation,
events of this engine's own blocks) for medium ``MEDIUM_OBJECT``, asking the bucket
through ``S3Lookups`` only. What is the object tier's own:

* the worker creates objects with ``If-None-Match: *``: of two replicas storing the same
  new block at the same moment one wins, the other's put answers 412 and counts as
  present (both may announce the block, as with Redis's ``SET NX``);
* the store sends no notifications: objects deleted by another writer, a lifecycle rule
  or ``lifetime_s`` are found by the periodic reconciliation (a listing), and by one at
  once when the endpoint answers again after an outage (the lookups' ``resync``);
  objects persist across a server restart, so an outage does not empty the index;
* the endpoint is down while its breaker is open.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvoffload.specs import MEDIUM_OBJECT
from kvoffload.tiers.s3.names import S3LoadStoreSpec
from kvoffload.tiers.shared_store_manager import SharedStoreCounters, SharedStoreManager


@dataclass
class S3ManagerCounters(SharedStoreCounters):
    """``SharedStoreCounters``; ``gone`` counts reconciliations' findings only."""


class S3OffloadingManager(SharedStoreManager):
    """``SharedStoreManager(lookups: S3Lookups, capacity, ...)`` for the object tier."""

    medium = MEDIUM_OBJECT
    spec_type = S3LoadStoreSpec
    counters_type = S3ManagerCounters
