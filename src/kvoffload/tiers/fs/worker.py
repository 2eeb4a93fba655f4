"""``FSWorker``: moves blocks between the host pool and the local-disk tier.

It is the ``kvoffload.worker.OffloadingWorker`` of routes ``CPU -> DISK`` (a store) and
``DISK -> CPU`` (a load), a peer of the device<->host ``TransferEngine`` behind a
``WorkerRouter``:

* store: ``submit(job_id, CPULoadStoreSpec(host_ids), DiskLoadStoreSpec(slots, keys))``
  writes host block ``host_ids[i]`` (its row in every pool tensor, concatenated in
  tensor order) to ``slots[i]`` under ``keys[i]``;
* load: ``submit(job_id, DiskLoadStoreSpec(slots, keys), CPULoadStoreSpec(host_ids))``
  reads ``slots[i]`` straight into host block ``host_ids[i]``'s rows (``os.preadv`` into
  the pool's memory) after checking the record and the key, then checks the payload CRC.

Contract, beyond ``kvoffload.worker``:

* ``submit`` validates everything first: ``TypeError`` for another medium pair or spec
  class; ``ValueError`` naming the bad value (host id or slot out of range, counts that
  differ, a key too long, a slot written twice or a host block loaded twice in one job, a
  job id already in flight); ``RuntimeError`` after ``close``.
* Jobs of one direction complete in submission order. The blocks of a job are taken in
  slot order (the order in a job does not matter; a full tier's manager hands out evicted
  slots last-freed first, i.e. descending) and cut into runs of consecutive slots, up to
  ~1 MiB each (a load's ~4 MiB with native reads), that move in one batch each
  (``BlockFiles.write_run``/``read_run``: three syscalls per run, not per block). The
  direction's threads (``load_threads``/``store_threads``) take runs from one queue in
  submission order, so the next job's runs start while a job's last ones finish: no
  thread waits at a job's end. Loads and stores overlap.
* A job fails as a whole (``success=False``, ``bytes=0``, ``error`` naming the first
  failing key or the condition); the caller must not make its blocks loadable. A failed
  store leaves each slot either empty or intact. A failed load leaves its host rows
  unspecified; a block whose record, key or CRC does not check out is invalidated on disk
  and counted (``corrupt_blocks``), so it is never read as good again.
* Space: the data file is reserved ahead of the writes in chunks of slots
  (``kvoffload.tiers.fs.space``): a store writes into allocated space, never past the
  tier's ``bytes_to_use``. Host rows are handed to the kernel as byte views of the pool
  (``kvoffload.tiers.host_rows``).
* Stores are declined (failed, counted as ``floor_declines``) by the free-space floor
  (``kvoffload.tiers.fs.floor``); ``free_floor`` (bytes, an attribute) may be changed
  while running. ``ENOSPC``/``EDQUOT``, ``EIO`` and ``EROFS`` fail the job and are counted;
  nothing raises out of ``submit`` or ``poll`` for them, and later jobs are tried as usual
  (the worker recovers when the file system does).
* Progress (``reports_progress``): each run of a load whose blocks were all read and
  checked (records, keys, CRCs) is reported with its host blocks as it finishes, and the
  job once its result can be polled. A failed run is never reported; the job's runs not
  started then are skipped (running ones may still be reported: each is checked whole).
* ``counters()`` snapshots ``FSWorkerCounters``. ``close()`` lets queued jobs finish, then
  closes the files; idempotent.
"""

from __future__ import annotations

import errno
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from kvoffload.counters import Counters
from kvoffload.specs import MEDIUM_CPU, MEDIUM_DISK, CPULoadStoreSpec, DiskLoadStoreSpec, LoadStoreSpec
from kvoffload.tiers.fs.block_io import BlockFiles, CorruptBlock, consecutive_runs, native_reads
from kvoffload.tiers.fs.direct import DIRECT_ALIGN
from kvoffload.tiers.fs.floor import FloorDeclined, check_floor, check_floor_settings, floor_bytes
from kvoffload.tiers.fs.format import MAX_KEY_BYTES, Geometry
from kvoffload.tiers.fs.namespace import namespace_digest, open_namespace_dir
from kvoffload.tiers.fs.space import SlotSpace
from kvoffload.tiers.host_rows import HostRows
from kvoffload.validation import positive_int
from kvoffload.worker import JobBook, OffloadingWorker, Route, TransferResult

# Default I/O threads. Stores: buffered writes into one file are serialised by the file
# system (ext4 takes the inode lock per write), so a second thread only overlaps one
# run's CRC32C and Python with another's write; more contend for the lock and cost CPU
# (BENCHMARKS.md, disk tier run 6: 2 threads stored 0.79 and 0.67 of the baseline where 4
# stored 0.66 and 0.63, at 0.86-0.99x their CPU). Loads: parallel direct reads keep the
# device's queue full.
STORE_THREADS = 2
LOAD_THREADS = 4

RUN_BYTES = 1 << 20
# A load's runs with native reads (one call without the GIL each, every block checked in
# cache): longer runs cost the engine's thread fewer GIL hand-backs while it prepares a
# step beside a promotion; shorter ones let a chained load copy a reported run while the
# next ones are read (bench_tier_ttft: a 62-block disk hit is then 4 runs).
NATIVE_LOAD_RUN_BYTES = 4 << 20
STORE = "disk_store"  # host -> disk
LOAD = "disk_load"  # disk -> host
_DIRECTIONS: dict[Route, str] = {(MEDIUM_CPU, MEDIUM_DISK): STORE, (MEDIUM_DISK, MEDIUM_CPU): LOAD}
_ERRNO_COUNTER = {
    errno.ENOSPC: "no_space",
    errno.EDQUOT: "no_space",
    errno.EIO: "io_errors",
    errno.EROFS: "read_only",
}


@dataclass
class FSWorkerCounters(Counters):
    stores: int = 0  # store jobs that succeeded
    stores_failed: int = 0
    loads: int = 0
    loads_failed: int = 0
    blocks_written: int = 0
    blocks_read: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    corrupt_blocks: int = 0  # failed their record, key or CRC check on read; invalidated
    floor_declines: int = 0  # store jobs declined by the free-space floor
    # block reads/writes that failed with (several blocks of one job may each count):
    no_space: int = 0  # ENOSPC / EDQUOT
    io_errors: int = 0  # EIO
    read_only: int = 0  # EROFS
    other_errors: int = 0


@dataclass
class _Job:
    job_id: int
    store: bool
    host_ids: list[int]
    slots: list[int]
    keys: list[bytes]
    # set while it runs (under the worker's lock, but for ``error``'s first write):
    start: float = 0.0
    runs_left: int = 0  # runs not finished; 0 once dispatched: the job is done
    error: str | None = None  # the first failure; the job's later runs are skipped


class _Failed(Exception):
    """Fails a job with a message; the counter it bumps is already counted."""


class FSWorker(OffloadingWorker):
    """Moves blocks between ``host_pool`` and ``<root_dir>/<namespace>``."""

    routes = frozenset(_DIRECTIONS)
    reports_progress = True

    def __init__(
        self,
        host_pool,
        root_dir: str | os.PathLike,
        namespace: str,
        bytes_to_use: int,
        *,
        load_threads: int = LOAD_THREADS,
        store_threads: int = STORE_THREADS,
        min_free_fraction: float = 0.05,
        min_free_bytes: int = 0,
        fsync: bool = False,
        direct_reads: bool = True,
    ) -> None:
        """``host_pool``: a ``kvoffload.transfer.HostBlockPool`` on the CPU (its bytes per
        host block are the payload; the manager gets the same ``block_bytes``);
        ``direct_reads``: read what the page cache does not hold with ``O_DIRECT`` where the
        pool's rows and the file system allow it (``kvoffload.tiers.fs.direct``)."""
        positive_int("load_threads", load_threads)
        positive_int("store_threads", store_threads)
        check_floor_settings(min_free_fraction, min_free_bytes)
        self.host_pool = host_pool
        self._host = HostRows(host_pool)
        payload = self._host.block_bytes
        self.geometry = Geometry(payload)
        self.num_slots = self.geometry.num_slots(bytes_to_use)
        self.path = open_namespace_dir(root_dir, namespace)
        try:
            self.files = BlockFiles(
                self.path,
                self.geometry,
                namespace_digest(namespace),
                fsync,
                direct_reads and self._host.aligned(DIRECT_ALIGN),
            )
        except OSError as exc:
            raise ValueError(f"root_dir {os.fspath(root_dir)!r} cannot be written: {exc}") from None
        self.space = SlotSpace(self.files.data_fd, self.geometry.slot_stride, self.num_slots)
        self.free_floor = floor_bytes(self.path, min_free_fraction, min_free_bytes)
        # Runs of ~1 MiB: longer ones lose the cache (CRCs after a whole run; not native reads')
        load_run = NATIVE_LOAD_RUN_BYTES if native_reads() else RUN_BYTES
        self._run_blocks = {STORE: max(1, RUN_BYTES // payload), LOAD: max(1, load_run // payload)}
        self._counters = FSWorkerCounters()
        self._jobs = JobBook()
        self._lock = self._jobs.lock  # also guards the counters
        self._threads_per = {STORE: store_threads, LOAD: load_threads}
        self._queues: dict[str, queue.SimpleQueue] = {STORE: queue.SimpleQueue(), LOAD: queue.SimpleQueue()}
        self._runs: dict[str, queue.SimpleQueue] = {STORE: queue.SimpleQueue(), LOAD: queue.SimpleQueue()}
        self._order: dict[str, deque[_Job]] = {STORE: deque(), LOAD: deque()}  # dispatched, unpublished
        self._dispatchers = [
            threading.Thread(target=self._dispatch, args=(d,), name=f"kvoffload-fs-{d}", daemon=True)
            for d in (STORE, LOAD)
        ]
        self._movers = [
            threading.Thread(target=self._move, args=(d,), name=f"kvoffload-fs-{d}-{i}", daemon=True)
            for d in (STORE, LOAD)
            for i in range(self._threads_per[d])
        ]
        for thread in self._dispatchers + self._movers:
            thread.start()

    @property
    def block_bytes(self) -> int:
        return self.geometry.payload_bytes

    # -- submission ----------------------------------------------------------------------

    def submit(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        if self._jobs.closed:
            raise RuntimeError(f"submit({job_id}) after close()")
        direction = _DIRECTIONS.get((src_spec.medium, dst_spec.medium))
        if direction is None:
            raise TypeError(
                "FSWorker moves CPU->DISK stores and DISK->CPU loads, got "
                f"{src_spec.medium or '?'}->{dst_spec.medium or '?'} "
                f"({type(src_spec).__name__}, {type(dst_spec).__name__})"
            )
        store = direction == STORE
        host_spec, disk_spec = (src_spec, dst_spec) if store else (dst_spec, src_spec)
        if not (isinstance(host_spec, CPULoadStoreSpec) and isinstance(disk_spec, DiskLoadStoreSpec)):
            raise TypeError(
                f"a {direction} job needs a CPULoadStoreSpec and a DiskLoadStoreSpec, got "
                f"({type(src_spec).__name__}, {type(dst_spec).__name__})"
            )
        job = self._plan(job_id, store, host_spec, disk_spec)
        self._jobs.begin(job_id)
        self._queues[direction].put(job)
        return True

    def _plan(self, job_id: int, store: bool, host: CPULoadStoreSpec, disk: DiskLoadStoreSpec) -> _Job:
        host_ids = np.asarray(host.block_ids, dtype=np.int64)
        slots = np.asarray(disk.block_ids, dtype=np.int64)
        if len(host_ids) != len(slots):
            raise ValueError(f"job {job_id}: {len(host_ids)} host blocks but {len(slots)} disk slots")
        for ids, limit, what in ((host_ids, self.host_pool.num_blocks, "host block id"),
                                 (slots, self.num_slots, "disk slot")):  # fmt: skip
            bad = ids[(ids < 0) | (ids >= limit)]
            if len(bad):
                raise ValueError(f"job {job_id}: {what} {int(bad[0])} out of range [0, {limit})")
        for key in disk.keys:
            if not isinstance(key, (bytes, bytearray)) or not 0 < len(key) <= MAX_KEY_BYTES:
                raise ValueError(f"job {job_id}: a key must be 1..{MAX_KEY_BYTES} bytes, got {key!r}")
        destination, what = (slots, "disk slot") if store else (host_ids, "host block")
        if len(np.unique(destination)) != len(destination):
            values, counts = np.unique(destination, return_counts=True)
            raise ValueError(f"job {job_id} writes {what} {int(values[counts > 1][0])} twice")
        order = np.argsort(slots, kind="stable")
        keys = [bytes(disk.keys[i]) for i in order.tolist()]
        return _Job(job_id, store, host_ids[order].tolist(), slots[order].tolist(), keys)

    # -- running -------------------------------------------------------------------------

    def _dispatch(self, direction: str) -> None:
        """Takes the direction's jobs in order: the per-job step (the free-space floor of a
        store, the record read-ahead of a load), then its runs onto the movers' queue."""
        jobs, runs = self._queues[direction], self._runs[direction]
        while (job := jobs.get()) is not None:
            job.start = time.perf_counter()
            try:
                pieces = self._prepare(job)
            except Exception as exc:  # a job's failure never stops the worker
                pieces = []
                job.error = self._message(exc)
            with self._lock:
                job.runs_left = len(pieces)
                self._order[direction].append(job)
                if not pieces:
                    self._publish(direction)
            for run in pieces:
                runs.put((job, run))
        for _ in range(self._threads_per[direction]):
            runs.put(None)

    def _prepare(self, job: _Job) -> list[range]:
        count = len(job.slots)
        if not count:
            return []
        if job.store:
            self._check_floor(job)
        elif job.slots[-1] - job.slots[0] < 4 * count:  # dense enough to read every record
            self.files.prefetch_records(job.slots[0], job.slots[-1])
        return consecutive_runs(job.slots, self._run_blocks[STORE if job.store else LOAD])

    def _move(self, direction: str) -> None:
        """One of the direction's threads: moves runs until the dispatcher says stop."""
        runs = self._runs[direction]
        move = self._store_run if direction == STORE else self._load_run
        while (item := runs.get()) is not None:
            job, run = item
            if job.error is None:  # after a failure the job's other runs are skipped
                try:
                    move(job, run)
                    if not job.store and self.on_progress is not None:  # read and checked
                        self.on_progress(job.job_id, job.host_ids[run.start : run.stop])
                except Exception as exc:  # noqa: BLE001 - the job fails, the worker goes on
                    message = self._message(exc)
                    with self._lock:
                        job.error = job.error or message
            with self._lock:
                job.runs_left -= 1
                if not job.runs_left:
                    self._publish(direction)

    def _message(self, exc: Exception) -> str:
        if isinstance(exc, _Failed):
            return str(exc)
        self._count("other_errors")
        return f"{type(exc).__name__}: {exc}"

    def _publish(self, direction: str) -> None:
        """Post the results of the finished jobs at the head of the direction's order
        (with the lock held): jobs complete in submission order."""
        order, counters = self._order[direction], self._counters
        while order and not order[0].runs_left:
            job = order.popleft()
            ok = job.error is None
            nbytes = len(job.slots) * self.geometry.payload_bytes if ok else 0
            if job.store:
                counters.stores += ok
                counters.stores_failed += not ok
                counters.blocks_written += len(job.slots) if ok else 0
                counters.bytes_written += nbytes
            else:
                counters.loads += ok
                counters.loads_failed += not ok
                counters.blocks_read += len(job.slots) if ok else 0
                counters.bytes_read += nbytes
            seconds = time.perf_counter() - job.start if ok else 0.0
            self._jobs.finish(TransferResult(job.job_id, ok, nbytes, seconds, direction, job.error))
            if not job.store and self.on_progress is not None:
                self.on_progress(job.job_id, None)

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            setattr(self._counters, name, getattr(self._counters, name) + n)

    def _check_floor(self, job: _Job) -> None:
        try:
            check_floor(self.path, self.free_floor, self.space, job.slots)
        except FloorDeclined as exc:
            self._count("floor_declines")
            raise _Failed(f"store job {job.job_id} declined: {exc}") from None
        except OSError as exc:
            self._os_error(exc)
            raise _Failed(f"store job {job.job_id}: cannot check free space: {exc}") from None

    def _os_error(self, exc: OSError) -> None:
        self._count(_ERRNO_COUNTER.get(exc.errno, "other_errors"))

    def _store_run(self, job: _Job, run: range) -> None:
        first = job.slots[run.start]
        block = self._host.block
        try:
            self.space.reserve(first, len(run))
            self.files.write_run(first, job.keys[run.start : run.stop], [block(job.host_ids[i]) for i in run])
        except OSError as exc:
            self._os_error(exc)
            key = job.keys[run.start].hex()
            raise _Failed(f"store of {len(run)} blocks from key {key} at slot {first}: {exc}") from None

    def _load_run(self, job: _Job, run: range) -> None:
        first = job.slots[run.start]
        block = self._host.block
        try:
            self.files.read_run(first, job.keys[run.start : run.stop], [block(job.host_ids[i]) for i in run])
        except CorruptBlock as exc:
            self._count("corrupt_blocks")
            try:
                self.files.invalidate(exc.slot)
            except OSError as inner:
                self._os_error(inner)
            raise _Failed(f"load failed: {exc}") from None
        except OSError as exc:
            self._os_error(exc)
            key = job.keys[run.start].hex()
            raise _Failed(f"load of {len(run)} blocks from key {key} at slot {first}: {exc}") from None

    # -- completion ----------------------------------------------------------------------

    def poll(self) -> list[TransferResult]:
        return self._jobs.poll()

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> None:
        self._jobs.wait(job_ids, timeout)

    def counters(self) -> FSWorkerCounters:
        with self._lock:
            return self._counters.snapshot()

    def close(self) -> None:
        if not self._jobs.close():
            return
        for direction in (STORE, LOAD):
            self._queues[direction].put(None)  # the dispatcher passes it on to the movers
        for thread in self._dispatchers + self._movers:
            thread.join()
        self.files.close()
