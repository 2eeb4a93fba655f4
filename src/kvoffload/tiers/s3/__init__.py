"""The object-storage tier (``"s3"``): blocks as objects in an S3-compatible bucket that
engine replicas share (AWS S3, SeaweedFS, MinIO, Ceph RGW, ...), through ``obstore``.

* ``S3OffloadingManager`` (``manager``): scheduler-side index of the blocks believed
  present; asks the bucket only through ``S3Lookups`` (``lookups``: concurrent ``HEAD``s,
  reconciliation by listing), off the scheduler thread. What it shares with the Redis and
  Mooncake tiers lives in ``kvoffload.tiers.shared_store_manager``, ``shared_store_lookups``
  and ``shared_store_tier``; these modules hold what object storage does differently.
* ``S3Worker`` (``worker``): host pool <-> bucket jobs, one object per block, created with
  ``If-None-Match: *`` (first writer wins).
* ``store``: ``ObjectStore``, the one owner of a client (bounded timeouts and retries, a
  breaker, every answer an outcome); ``names``: the spec and object names; ``tier``: the
  ``secondary_tiers`` entry. Values use the Redis tier's format
  (``kvoffload.tiers.redis.format``).

Names are re-exported lazily: importing the manager never loads torch or obstore.
"""

from kvoffload._lazy import lazy_exports

_EXPORTS = {
    "S3OffloadingManager": "kvoffload.tiers.s3.manager",
    "S3ManagerCounters": "kvoffload.tiers.s3.manager",
    "S3Worker": "kvoffload.tiers.s3.worker",
    "S3WorkerCounters": "kvoffload.tiers.s3.worker",
    "S3Lookups": "kvoffload.tiers.s3.lookups",
    "ObjectStore": "kvoffload.tiers.s3.store",
    "S3Settings": "kvoffload.tiers.s3.store",
    "S3LoadStoreSpec": "kvoffload.tiers.s3.names",
    "ObjectNames": "kvoffload.tiers.s3.names",
    "S3TierType": "kvoffload.tiers.s3.tier",
    "S3_KEYS": "kvoffload.tiers.s3.tier",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
