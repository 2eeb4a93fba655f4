"""``S3Worker``: moves blocks between the host pool and an S3 bucket.

It is the ``kvoffload.worker.OffloadingWorker`` of routes ``CPU -> OBJECT`` (a store) and
``OBJECT -> CPU`` (a load), a peer of the other movers behind a ``WorkerRouter``.

One object per block, in the Redis tier's value format (``kvoffload.tiers.redis.format``:
header with magic, version, lengths, CRC32C of key and payload, namespace digest; the
key; the payload, the block's row of every host-pool tensor in tensor order), named
``<prefix>/<namespace>/<key hex>`` (``kvoffload.tiers.s3.names``). Each block is one
request, ``concurrency`` of them in flight at once over the worker's threads (obstore's
calls release the GIL); a job finishes when its last block did, and succeeds only if
every block did.

* store: ``submit(job_id, CPULoadStoreSpec(host_ids), S3LoadStoreSpec(keys))`` creates
  each block's object with ``If-None-Match: *``. The first writer wins: a block another
  replica stored already answers 412 and counts as stored (``already_present``), its
  object untouched. In a host pool with a row prefix (what ``kvoffload.tiers.factory``
  builds when an object tier is configured) the header and key are written into the
  block's prefix and the object is put straight from the pool, one buffer
  (``kvoffload.tiers.mooncake.objects.OneBuffer``); otherwise header and rows are joined
  into one value first (one copy). A put the bucket refuses (403: a read-only identity or
  bucket policy, ``puts_denied``) or rejects (another HTTP error, e.g. 500 from a full
  SeaweedFS, ``puts_rejected``) fails the job: its blocks are never announced, and those
  that were created stay, checked on every read like any other.
* load: ``submit(job_id, S3LoadStoreSpec(keys), CPULoadStoreSpec(host_ids))`` gets each
  object (a ranged read of one byte more than a block's object: a larger object, say a
  stranger's under the name, costs no more than that, and fails the size check), checks
  it (size, header, key, namespace digest, CRC32C) in the buffer it was received into,
  and copies its payload into the block's rows: one copy (obstore returns a buffer of its
  own; it cannot receive into ours). A missing object (deleted, expired)
  fails the load (``missing_values``); one that fails a check fails it too, is deleted
  from the bucket and counted (``corrupt_values``): it never reaches the engine. A failed
  load leaves its host rows unspecified (the rows of a load are reserved, not loadable,
  and a failed load never makes them so).

``submit`` validates first (``TypeError``, ``ValueError`` naming the bad value,
``RuntimeError`` after ``close``) and never calls the network. Every call goes through the
``ObjectStore`` (bounded timeouts, a breaker): while the endpoint is down jobs fail at
once, never raise, and ``close`` lets queued requests finish (each bounded) first.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from kvoffload.counters import Counters
from kvoffload.specs import MEDIUM_CPU, MEDIUM_OBJECT, LoadStoreSpec
from kvoffload.tiers.host_rows import HostRows
from kvoffload.tiers.mooncake.objects import MAX_KEY_BYTES, SLOT_BYTES, OneBuffer
from kvoffload.tiers.redis.format import HEADER_BYTES, CorruptValue, decode, encode
from kvoffload.tiers.s3.lookups import expired
from kvoffload.tiers.s3.names import ObjectNames, S3LoadStoreSpec
from kvoffload.tiers.s3.store import DENIED, DOWN, EXISTS, MISSING, OK, REJECTED, SHORT, ObjectStore
from kvoffload.tiers.shared_store_jobs import check_job
from kvoffload.validation import positive_int
from kvoffload.worker import JobBook, OffloadingWorker, Route, TransferResult

STORE = "s3_store"  # host -> bucket
LOAD = "s3_load"  # bucket -> host
_DIRECTIONS: dict[Route, str] = {(MEDIUM_CPU, MEDIUM_OBJECT): STORE, (MEDIUM_OBJECT, MEDIUM_CPU): LOAD}
CORRUPT = "corrupt"


@dataclass
class S3WorkerCounters(Counters):
    stores: int = 0  # store jobs that succeeded
    stores_dropped: int = 0  # store jobs failed (endpoint down, put refused or rejected)
    loads: int = 0
    loads_failed: int = 0
    blocks_written: int = 0  # objects this worker created
    already_present: int = 0  # the put found the object created already (412: another writer was first)
    puts_denied: int = 0  # puts the bucket refused (403: read-only identity or policy)
    puts_rejected: int = 0  # puts the server answered with another error (e.g. 500: full)
    blocks_read: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    missing_values: int = 0  # a loaded key the bucket no longer had (or past lifetime_s)
    corrupt_values: int = 0  # failed a check on read; deleted from the bucket
    outages: int = 0


@dataclass
class _Job:
    job_id: int
    direction: str
    count: int  # blocks
    left: int  # blocks not finished yet
    start: float
    error: str | None = None


def _unregistered(ptr: int, size: int) -> None:
    """``OneBuffer`` registers the pool with a store that needs it; S3 does not."""


class S3Worker(OffloadingWorker):
    """Moves blocks between ``host_pool`` and the bucket behind ``store``."""

    routes = frozenset(_DIRECTIONS)

    def __init__(
        self,
        host_pool,
        store: ObjectStore,
        names: ObjectNames,
        *,
        concurrency: int = 8,
        lifetime: float | None = None,
    ) -> None:
        threads = positive_int("concurrency", concurrency)
        self.host_pool = host_pool
        self.store = store
        self._names = names
        self._lifetime = lifetime
        self._host = HostRows(host_pool)
        self.block_bytes = self._host.block_bytes
        prefix = getattr(host_pool, "row_prefix_bytes", 0)
        one = getattr(host_pool, "interleaved", False) and prefix >= SLOT_BYTES
        self._one = OneBuffer(host_pool, names.digest, _unregistered) if one else None
        self.one_buffer = self._one is not None  # stores put straight from the pool
        self._pool = ThreadPoolExecutor(threads, "kvoffload-s3-io")
        self._jobs = JobBook()
        self._lock = self._jobs.lock  # also guards the counters
        self._counters = S3WorkerCounters()

    # -- submission ----------------------------------------------------------------------

    def submit(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        direction, host_ids, keys = check_job(
            "S3Worker", _DIRECTIONS, S3LoadStoreSpec, job_id, src_spec, dst_spec, self.host_pool.num_blocks
        )
        long = [k for k in keys if len(k) > MAX_KEY_BYTES]
        if long:
            raise ValueError(f"key of {len(long[0])} bytes is longer than {MAX_KEY_BYTES}: {long[0].hex()}")
        self._jobs.begin(job_id, direction)
        job = _Job(job_id, direction, len(keys), len(keys), time.perf_counter())
        if not keys:
            self._finish(job)
            return True
        run = self._store_one if direction == STORE else self._load_one
        for host_id, key in zip(host_ids, keys):
            self._pool.submit(run, job, host_id, key)
        return True

    # -- one block -----------------------------------------------------------------------

    def _store_one(self, job: _Job, host_id: int, key: bytes) -> None:
        try:
            if self._one is not None:
                (body,) = self._one.objects([host_id], [key])
            else:
                body = encode(key, self._host.block(host_id), self._names.digest)
            outcome, why = self.store.put_new(self._names.name(key), body)
        except Exception as exc:  # noqa: BLE001 - a block never raises into the engine
            outcome, why = REJECTED, f"{type(exc).__name__}: {exc}"
        self._done(job, key, outcome, why)

    def _load_one(self, job: _Job, host_id: int, key: bytes) -> None:
        name = self._names.name(key)
        try:
            outcome, value = self.store.get(name, self._object_bytes(key) + 1)
            if outcome == SHORT:
                outcome, value = CORRUPT, "the object is empty"
            if outcome == OK:
                meta, body = value
                if expired(meta, self._lifetime, time.time()):
                    outcome, value = MISSING, "past lifetime_s"
                else:
                    outcome, value = self._receive(host_id, key, body)
            if outcome == CORRUPT:
                self.store.delete([name])
        except Exception as exc:  # noqa: BLE001 - a block never raises into the engine
            outcome, value = REJECTED, f"{type(exc).__name__}: {exc}"
        self._done(job, key, outcome, value)

    def _object_bytes(self, key: bytes) -> int:
        return HEADER_BYTES + len(key) + self.block_bytes

    def _receive(self, host_id: int, key: bytes, body) -> tuple[str, str | None]:
        """Check ``body`` as ``key``'s object and copy its payload into the block's rows."""
        try:
            payload = memoryview(decode(body, key, self._names.digest, self.block_bytes)).cast("B")
        except CorruptValue as exc:
            return CORRUPT, str(exc)
        offset = 0
        for view in self._host.block(host_id):
            view[:] = payload[offset : offset + len(view)]
            offset += len(view)
        return OK, None

    def _done(self, job: _Job, key: bytes, outcome: str, why) -> None:
        """Count one block's outcome; the last block of a job posts its result."""
        failure = None
        with self._lock:
            c = self._counters
            if job.direction == STORE:
                if outcome == OK:
                    c.blocks_written += 1
                    c.bytes_written += self.block_bytes
                elif outcome == EXISTS:
                    c.already_present += 1
                elif outcome == DENIED:
                    c.puts_denied += 1
                    failure = f"store failed: the bucket refused the put: {why}"
                elif outcome == DOWN:
                    failure = f"store failed: the endpoint is down: {why}"
                else:
                    c.puts_rejected += 1
                    failure = f"store failed: the server rejected the put: {why}"
            elif outcome == OK:
                c.blocks_read += 1
                c.bytes_read += self.block_bytes
            elif outcome == MISSING:
                c.missing_values += 1
                failure = f"block {key.hex()} is no longer in the bucket ({why})"
            elif outcome == CORRUPT:
                c.corrupt_values += 1
                failure = f"block {key.hex()} is corrupt: {why}"
            else:
                failure = f"load failed: {why}"
            if failure is not None and job.error is None:
                job.error = failure
            job.left -= 1
            if job.left == 0:
                self._finish(job)

    def _finish(self, job: _Job) -> None:
        with self._lock:
            c = self._counters
            ok = job.error is None
            if job.direction == STORE:
                c.stores += ok
                c.stores_dropped += not ok
            else:
                c.loads += ok
                c.loads_failed += not ok
            moved = self.block_bytes * job.count if ok else 0
            seconds = time.perf_counter() - job.start
            self._jobs.finish(TransferResult(job.job_id, ok, moved, seconds, job.direction, job.error))

    # -- results -------------------------------------------------------------------------

    def poll(self) -> list[TransferResult]:
        return self._jobs.poll()

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> None:
        self._jobs.wait(job_ids, timeout)

    def counters(self) -> S3WorkerCounters:
        with self._lock:
            return self._counters.snapshot(outages=self.store.breaker.outages)

    def close(self) -> None:
        """Let queued requests finish (each bounded by the client's timeouts), then release."""
        if self._jobs.close():
            self._pool.shutdown(wait=True)
