"""The shared tier (``"redis"``): blocks in a Redis/Valkey server (or Redis Cluster)
that engine replicas share.

* ``RedisOffloadingManager`` (``manager``): scheduler-side index of the blocks believed
  present; asks the server only through ``RemoteLookups`` (``lookups``), off the
  scheduler thread.
* ``RedisWorker`` (``worker``): host pool <-> server jobs, pipelined.
* ``format``: values (header, key, payload, CRC32C) and key names; ``client``: URLs,
  credentials, timeouts; ``breaker``: the circuit breaker every call goes through;
  ``tier``: the ``secondary_tiers`` entry.

Names are re-exported lazily: importing the manager never loads torch.
"""

from kvoffload._lazy import lazy_exports

_EXPORTS = {
    "RedisOffloadingManager": "kvoffload.tiers.redis.manager",
    "RedisManagerCounters": "kvoffload.tiers.redis.manager",
    "RedisWorker": "kvoffload.tiers.redis.worker",
    "RedisWorkerCounters": "kvoffload.tiers.redis.worker",
    "RemoteLookups": "kvoffload.tiers.redis.lookups",
    "CircuitBreaker": "kvoffload.tiers.redis.breaker",
    "KeyNames": "kvoffload.tiers.redis.format",
    "redis_namespace": "kvoffload.tiers.redis.format",
    "RedisTierType": "kvoffload.tiers.redis.tier",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
