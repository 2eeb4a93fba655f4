"""``MooncakeWorker``: moves blocks between the host pool and the shared Mooncake Store.

It is the ``kvoffload.worker.OffloadingWorker`` of routes ``CPU -> MOONCAKE`` (a store)
and ``MOONCAKE -> CPU`` (a load), a peer of the other movers behind a ``WorkerRouter``.

One object per block, in the Redis tier's value format (``kvoffload.tiers.redis.format``):
header and key (magic, version, lengths, CRC32C of key and payload, namespace digest),
then the payload (the block's row of every host-pool tensor, in tensor order). Where it
lies (``kvoffload.tiers.mooncake.objects``): in a host pool with a row prefix (what
``kvoffload.tiers.factory`` builds when a Mooncake tier is configured) header, key and
payload are one buffer of the pool, moved with ``batch_put_from`` / ``batch_get_into``;
in any other pool the header sits in a slot of a small registered staging array and the
object is moved as the slot and the block's rows (the ``_multi_buffers`` calls). Either
way the payload moves between the pool and the store with no Python copy, and a block is
one object: present or absent as a whole, one lease, one master round trip per block,
none of the states a separate header object would add (a header without its payload, or
the other way round, after an eviction or a restart).

* store: ``submit(job_id, CPULoadStoreSpec(host_ids), MooncakeLoadStoreSpec(keys))`` puts
  host block ``host_ids[i]`` as ``keys[i]``'s object, in batches of ``batch_blocks``. A
  put of a name the store holds already keeps the old object and answers success (a block
  another replica stored is not written again). A full store answers ``-200`` for the
  blocks it had no room for (``store_full``); any failed block fails the job (the blocks
  that were put stay, checked on every read like any other).
* load: ``submit(job_id, MooncakeLoadStoreSpec(keys), CPULoadStoreSpec(host_ids))`` gets
  each object into its host block (and header slot), then checks it there: the size, the
  header, the key, the namespace digest, the CRC32C of the key and the payload. A
  missing object (evicted, or lost to a master restart) fails the load
  (``missing_values``); one that fails a check or does not fit its block fails it too, is
  removed from the store and is counted (``corrupt_values``): it never reaches the engine.
  (Mooncake answers a get into a buffer smaller than the object with ``-600``, one into a
  larger buffer with the object's size, which the size check refuses, and a multi-buffer
  get into larger buffers with a transfer failure, ``-800``, told from a lost segment
  holder by asking the object's size.)
  A failed load leaves its host rows unspecified (they may hold a bad object's bytes: the
  rows of a load are reserved, not loadable, and a failed load never makes them so).

``submit`` validates first (``TypeError``, ``ValueError`` naming the bad value,
``RuntimeError`` after ``close``) and never calls the client. Every call goes through the
``MooncakeStore`` (breaker; refuses after close): while the master is down jobs fail at
once, never raise, and ``close`` lets queued jobs finish before it closes the client.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from kvoffload.counters import Counters
from kvoffload.specs import MEDIUM_CPU, MEDIUM_MOONCAKE, LoadStoreSpec
from kvoffload.tiers.mooncake.names import MooncakeLoadStoreSpec, object_names
from kvoffload.tiers.mooncake.objects import MAX_KEY_BYTES, OneBuffer, layout_for
from kvoffload.tiers.mooncake.store import (
    INVALID_PARAMS,
    NO_AVAILABLE_HANDLE,
    OBJECT_NOT_FOUND,
    TRANSFER_FAIL,
    MooncakeStore,
    is_outage,
    split_codes,
)
from kvoffload.tiers.redis.format import KeyNames
from kvoffload.tiers.shared_store_jobs import check_job
from kvoffload.validation import positive_int
from kvoffload.worker import JobBook, OffloadingWorker, Route, TransferResult

STORE = "mooncake_store"  # host -> Mooncake
LOAD = "mooncake_load"  # Mooncake -> host
_DIRECTIONS: dict[Route, str] = {(MEDIUM_CPU, MEDIUM_MOONCAKE): STORE, (MEDIUM_MOONCAKE, MEDIUM_CPU): LOAD}


@dataclass
class MooncakeWorkerCounters(Counters):
    stores: int = 0  # store jobs that succeeded
    stores_dropped: int = 0  # store jobs failed (master down, store full, refused)
    loads: int = 0
    loads_failed: int = 0
    blocks_written: int = 0  # puts answered success (new, or kept: stored already)
    store_full: int = 0  # blocks the store had no room for (-200)
    blocks_read: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    missing_values: int = 0  # a loaded key the store no longer had
    corrupt_values: int = 0  # failed a check on read, or did not fit; removed from the store
    outages: int = 0


class _JobFailed(Exception):
    pass


def _why(exc: BaseException) -> str:
    """A failed job's error text."""
    return str(exc) if isinstance(exc, _JobFailed) else f"{type(exc).__name__}: {exc}"


class MooncakeWorker(OffloadingWorker):
    """Moves blocks between ``host_pool`` and the store behind ``store`` (which it owns
    from now on: ``close`` closes it)."""

    routes = frozenset(_DIRECTIONS)

    def __init__(
        self,
        host_pool,
        store: MooncakeStore,
        names: KeyNames,
        *,
        io_threads: int = 2,
        batch_blocks: int = 256,
    ) -> None:
        threads = positive_int("io_threads", io_threads)
        self._batch = positive_int("batch_blocks", batch_blocks)
        self.host_pool = host_pool
        self.store = store
        self._names = names
        self._objects = layout_for(host_pool, names.digest, store.register, threads, self._batch)
        self.block_bytes = self._objects.size
        self.one_buffer = isinstance(self._objects, OneBuffer)  # each object one buffer of the pool
        self._thread = threading.local()
        order = itertools.count()

        def assign_row() -> None:
            self._thread.row = next(order)

        self._pool = ThreadPoolExecutor(threads, "kvoffload-mooncake-io", initializer=assign_row)
        self._jobs = JobBook()
        self._lock = self._jobs.lock  # also guards the counters
        self._counters = MooncakeWorkerCounters()

    # -- submission ----------------------------------------------------------------------

    def submit(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        direction, host_ids, keys = check_job(
            "MooncakeWorker",
            _DIRECTIONS,
            MooncakeLoadStoreSpec,
            job_id,
            src_spec,
            dst_spec,
            self.host_pool.num_blocks,
        )
        long = [k for k in keys if len(k) > MAX_KEY_BYTES]
        if long:
            raise ValueError(f"key of {len(long[0])} bytes is longer than {MAX_KEY_BYTES}: {long[0].hex()}")
        self._jobs.begin(job_id)
        self._pool.submit(self._run, job_id, direction, host_ids, keys)
        return True

    # -- the jobs ------------------------------------------------------------------------

    def _run(self, job_id: int, direction: str, host_ids: list[int], keys: list[bytes]) -> None:
        """A job on one I/O thread: headers, calls and checks, batch after batch."""
        start = time.perf_counter()
        error = None
        try:
            row, step = self._thread.row, self._batch
            for i in range(0, len(keys), step):
                h, k = host_ids[i : i + step], keys[i : i + step]
                if direction == STORE:
                    self._put(k, self._objects.put(row, h, k))
                else:
                    self._check(row, h, k, *self._get(row, h, k))
        except Exception as exc:  # noqa: BLE001 - a job never raises into the engine
            error = _why(exc)
        self._finish(job_id, direction, start, error, len(keys))

    def _finish(self, job_id: int, direction: str, start: float, error: str | None, blocks: int) -> None:
        moved = self.block_bytes * blocks if error is None else 0
        with self._lock:
            counters = self._counters
            if direction == STORE:
                counters.stores += error is None
                counters.stores_dropped += error is not None
                counters.bytes_written += moved
            else:
                counters.loads += error is None
                counters.loads_failed += error is not None
                counters.bytes_read += moved
            self._jobs.finish(
                TransferResult(job_id, error is None, moved, time.perf_counter() - start, direction, error)
            )

    def _put(self, keys: list[bytes], call) -> None:
        method, ptrs, sizes = call
        codes = split_codes(self.store.call(method, object_names(self._names, keys), ptrs, sizes), len(keys))
        failed = len(codes) - codes.count(0)
        full = codes.count(NO_AVAILABLE_HANDLE) if failed else 0
        with self._lock:
            self._counters.blocks_written += len(codes) - failed
            self._counters.store_full += full
        if failed:
            bad = next(c for c in codes if c != 0)
            why = (
                "the store is full"
                if bad == NO_AVAILABLE_HANDLE
                else "the master is down"
                if is_outage(bad)
                else ""
            )
            raise _JobFailed(
                f"store failed: {failed} of {len(codes)} puts returned an error ({bad}) {why}".rstrip()
            )

    def _get(self, row: int, host_ids: list[int], keys: list[bytes]) -> tuple[list[int], list[str], list]:
        """The get of one batch: Mooncake's codes, the object names and sizes."""
        method, ptrs, sizes = self._objects.get(row, host_ids, keys)
        names = object_names(self._names, keys)
        return split_codes(self.store.call(method, names, ptrs, sizes), len(keys)), names, sizes

    def _check(self, row: int, host_ids: list[int], keys: list[bytes], codes, names, sizes) -> None:
        """Fails (``_JobFailed``) unless every object of a got batch is its block's."""
        objects = self._objects
        corrupt: dict[int, str] = {}
        failure = None
        missing = 0
        for j, code in enumerate(codes):
            if code >= 0:
                continue
            if code == OBJECT_NOT_FOUND:
                missing += 1
                failure = failure or f"block {keys[j].hex()} is no longer in the store"
            elif code == INVALID_PARAMS:  # larger than its buffers: not this block
                corrupt[j] = "the object is larger than the block"
            elif (
                code == TRANSFER_FAIL and objects.short_is_transfer_fail and self._shorter(names[j], sizes[j])
            ):
                corrupt[j] = f"the object is not {sum(sizes[j])} bytes"
            else:
                failure = failure or f"load failed: get returned {code}"
        for j, exc in objects.check(row, host_ids, keys, codes):
            corrupt[j] = str(exc)
        with self._lock:
            self._counters.missing_values += missing
            self._counters.corrupt_values += len(corrupt)
        if corrupt:
            self.store.call("batch_remove", [names[j] for j in corrupt], True)
            j, why = next(iter(corrupt.items()))
            failure = failure or f"block {keys[j].hex()} is corrupt: {why}"
        if failure:
            raise _JobFailed(failure)
        with self._lock:
            self._counters.blocks_read += len(keys)

    def _shorter(self, name: str, sizes: list[int]) -> bool:
        """Whether the object the store holds is not of ``sizes``' total (a multi-buffer get
        into larger buffers fails as a lost holder does)."""
        held = self.store.call("get_size", name)
        return isinstance(held, int) and held >= 0 and held != sum(sizes)

    # -- results -------------------------------------------------------------------------

    def poll(self) -> list[TransferResult]:
        return self._jobs.poll()

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> None:
        self._jobs.wait(job_ids, timeout)

    def counters(self) -> MooncakeWorkerCounters:
        with self._lock:
            return self._counters.snapshot(outages=self.store.breaker.outages)

    def close(self) -> None:
        """Let queued jobs finish (each bounded by Mooncake's own timeouts), then close the
        client (which unregisters the pool and any staging array)."""
        if self._jobs.close():
            self._pool.shutdown(wait=True)
            self.store.close()
