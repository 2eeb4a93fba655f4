"""``RedisOffloadingManager``: the scheduler-side view of the shared Redis/Valkey tier.

A ``SharedStoreManager`` (``kvoffload.tiers.shared_store_manager``: local index, probes
answered ``RETRY`` then ``HIT``/``MISS``, adoption, budget deletions, reconciliation,
events of this engine's own blocks) for medium ``"REMOTE"``, asking the server through
``RemoteLookups`` only. What is the Redis tier's own:

* the worker writes with ``SET NX``: two replicas storing the same new block at the same
  moment keep one copy, and may both announce it;
* blocks the server dropped are heard at once from keyspace notifications where the
  server sends them, else found by the periodic reconciliation; a lost notification
  stream triggers a reconciliation when it reconnects;
* the server is down while the lookups' ``NodeCalls`` breaker is open.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvoffload.specs import MEDIUM_REMOTE, RemoteLoadStoreSpec
from kvoffload.tiers.shared_store_manager import SharedStoreCounters, SharedStoreManager


@dataclass
class RedisManagerCounters(SharedStoreCounters):
    """``SharedStoreCounters``; ``gone`` counts notifications and reconciliations."""


class RedisOffloadingManager(SharedStoreManager):
    """``SharedStoreManager(lookups: RemoteLookups, capacity, ...)`` for the Redis tier."""

    medium = MEDIUM_REMOTE
    spec_type = RemoteLoadStoreSpec
    counters_type = RedisManagerCounters
