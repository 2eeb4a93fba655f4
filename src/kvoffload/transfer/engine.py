"""``TransferEngine``: asynchronous store and load jobs between device KV and the host pool.

It is the host-memory ``kvoffload.worker.OffloadingWorker``: its routes are ``GPU -> CPU``
(a store) and ``CPU -> GPU`` (a load), told apart by the specs' media.

Calling convention (one job = one spec pair, all KV-cache groups of the layout at once):

* store (device -> host): ``submit(job_id, DeviceLoadStoreSpec(...), CPULoadStoreSpec(host_ids))``
* load (host -> device): ``submit(job_id, CPULoadStoreSpec(host_ids), DeviceLoadStoreSpec(...))``

The device spec lists the device blocks of every group concatenated in group order, with
``group_sizes`` (one entry per layout group, zero for a group not in the job) and
``block_indices`` (each group's logical index of its first block). The host spec lists the
host blocks of every group concatenated in the same order; group ``g`` spans
``ceil((block_indices[g] % F + group_sizes[g]) / F)`` of them (see
``kvoffload.transfer.mapping``). For example, with F=4, a full-attention group storing
device blocks 10..17 at logical positions 8..15 and a sliding-window group storing 2
blocks at positions 14..15 (entering its host block part-way)::

    DeviceLoadStoreSpec([10..17, 40, 41], group_sizes=[8, 2], block_indices=[8, 14])
    CPULoadStoreSpec([h0, h1, h2])    # h0, h1 for group 0; h2 for group 1

Contract:

* ``submit`` validates everything before queueing and raises ``ValueError`` naming the
  bad value (ids out of range, wrong counts, a group count that is not the layout's,
  duplicate destinations, a job id already in flight), ``TypeError`` for a medium pair
  that is neither a store nor a load or for specs of the wrong class for their medium,
  and ``RuntimeError`` after ``close``. It returns ``True`` when the job is queued.
* Stores and loads have their own queue and worker; within a direction jobs run and
  complete in submission order (an executor may have a few launched at once, see
  ``kvoffload.transfer.executor``; a job whose launch fails is reported at once, ahead of
  an earlier one still copying), and the two directions overlap.
* Every job ``submit`` accepted (returned ``True``) yields exactly one result. An error
  after validation (e.g. recording the executor's ready event failed) does not raise: the
  job completes at once as failed (ahead of jobs queued before it).
* ``poll()`` returns the results finished since the last poll, in completion order.
  ``TransferResult.bytes`` counts the bytes the job moves (0 when it fails);
  ``seconds`` is the copy time, not the time spent queued.
* A job that fails while copying reports ``success=False`` with ``error`` set. Its
  destination blocks are then unspecified (possibly partly written): the caller must not
  mark them loadable, and nothing else in the pools is touched. Later jobs still run.
* A failed job is reported only after the executor made sure none of its copies still
  runs (see the executors).
* ``wait(job_ids)`` blocks until those jobs have finished (their results stay for
  ``poll``); unknown ids count as finished. ``close()`` lets queued jobs finish, stops
  the workers, and is idempotent; results remain pollable. It is bounded by
  ``close_timeout``: jobs still unfinished then (a hung device) are reported failed
  without that guarantee, which is safe only because nothing uses the engine afterwards.

CPU tensors use ``CPUExecutor`` (``kvoffload.transfer.cpu_executor``), CUDA tensors
``CUDAExecutor`` (``kvoffload.transfer.cuda_executor``); both follow
``kvoffload.transfer.executor``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvoffload.specs import MEDIUM_CPU, MEDIUM_DEVICE, CPULoadStoreSpec, DeviceLoadStoreSpec, LoadStoreSpec
from kvoffload.transfer.cpu_executor import CPUExecutor
from kvoffload.transfer.cuda_executor import DEFAULT_STAGING_BYTES, CUDAExecutor
from kvoffload.transfer.executor import Executor, Piece
from kvoffload.transfer.host_pool import HostBlockPool
from kvoffload.transfer.layout import KVLayout
from kvoffload.transfer.mapping import map_sub_blocks
from kvoffload.worker import JobBook, OffloadingWorker, Route, TransferResult

logger = logging.getLogger(__name__)

STORE = "store"  # device -> host
LOAD = "load"  # host -> device
_DIRECTIONS: dict[Route, str] = {(MEDIUM_DEVICE, MEDIUM_CPU): STORE, (MEDIUM_CPU, MEDIUM_DEVICE): LOAD}


@dataclass
class _Job:
    job_id: int
    store: bool
    pieces: list[Piece]
    nbytes: int
    ready: object = None  # the executor's ready_event() taken at submit


def _check_range(ids: np.ndarray, limit: int, what: str) -> None:
    bad = ids[(ids < 0) | (ids >= limit)]
    if len(bad):
        raise ValueError(f"{what} {int(bad[0])} out of range [0, {limit})")


class TransferEngine(OffloadingWorker):
    """Moves KV pages between ``layout``'s tensors and ``host_pool``, asynchronously."""

    routes = frozenset(_DIRECTIONS)

    def __init__(
        self,
        layout: KVLayout,
        host_pool: HostBlockPool,
        *,
        chunk_bytes: int = 1 << 20,
        copy_threads: int | None = None,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        executor: Executor | None = None,
        close_timeout: float | None = 60.0,
    ) -> None:
        """``chunk_bytes`` (the work one copy thread takes at a time, at least one row)
        and ``copy_threads`` (threads copying one job, default: CPU count, at most 8)
        tune the CPU executor; ``staging_bytes`` caps the CUDA executor's device staging
        per direction. ``executor`` replaces the one chosen by device (tests).
        ``close_timeout``: seconds ``close`` waits for the workers (``None``: for ever)."""
        if host_pool.layout is not layout:
            raise ValueError("host_pool was built for a different layout")
        self.layout = layout
        self.host_pool = host_pool
        self.close_timeout = close_timeout
        if executor is not None:
            self._executor: Executor = executor
        elif layout.device.type == "cuda":
            self._executor = CUDAExecutor(layout, host_pool, staging_bytes=staging_bytes)
        elif layout.device.type == "cpu":
            self._executor = CPUExecutor(layout, host_pool, chunk_bytes, copy_threads)
        else:
            raise ValueError(f"unsupported device {layout.device} (cpu and cuda are)")
        self._jobs = JobBook()  # job id -> direction while in flight
        self._queues = {STORE: queue.Queue(), LOAD: queue.Queue()}
        self._threads = [
            threading.Thread(target=self._worker, args=(d,), name=f"kvoffload-{d}", daemon=True)
            for d in (STORE, LOAD)
        ]
        for thread in self._threads:
            thread.start()

    # -- submission ---------------------------------------------------------------------

    def submit(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        if self._jobs.closed:
            raise RuntimeError(f"submit({job_id}) after close()")
        direction = _DIRECTIONS.get((src_spec.medium, dst_spec.medium))
        if direction is None:
            raise TypeError(
                "TransferEngine moves GPU->CPU stores (DeviceLoadStoreSpec, CPULoadStoreSpec) and "
                f"CPU->GPU loads (the reverse), got {src_spec.medium or '?'}->{dst_spec.medium or '?'} "
                f"({type(src_spec).__name__}, {type(dst_spec).__name__})"
            )
        store = direction == STORE
        device_spec, host_spec = (src_spec, dst_spec) if store else (dst_spec, src_spec)
        if not (isinstance(device_spec, DeviceLoadStoreSpec) and isinstance(host_spec, CPULoadStoreSpec)):
            raise TypeError(
                f"a {direction} job needs a DeviceLoadStoreSpec and a CPULoadStoreSpec, got "
                f"({type(src_spec).__name__}, {type(dst_spec).__name__})"
            )
        job = self._plan(job_id, store, device_spec, host_spec)
        with self._jobs.lock:
            self._jobs.begin(job_id, direction)
            # Under the lock: close() cannot queue its stop marker ahead of this job.
            try:
                job.ready = self._executor.ready_event()
                self._queues[direction].put(job)
            except Exception as exc:  # registered already: it must complete, here and now
                logger.error("kvoffload: %s job %d failed at submit: %s", direction, job_id, exc)
                error = f"{type(exc).__name__}: {exc}"
                self._complete(TransferResult(job_id, False, 0, 0.0, direction, error))
        return True

    def _plan(
        self, job_id: int, store: bool, device_spec: DeviceLoadStoreSpec, host_spec: CPULoadStoreSpec
    ) -> _Job:
        layout = self.layout
        if device_spec.num_groups != layout.num_groups:
            raise ValueError(
                f"device spec has {device_spec.num_groups} groups, the layout has {layout.num_groups}"
            )
        host_ids = np.asarray(host_spec.block_ids, dtype=np.int64)
        _check_range(host_ids, self.host_pool.num_blocks, "host block id")
        mappings = map_sub_blocks(
            device_spec.block_ids,
            device_spec.group_sizes,
            device_spec.block_indices,
            host_ids,
            self.host_pool.blocks_per_offload_block,
        )
        pieces: list[Piece] = []
        nbytes = 0
        for m in mappings:
            if not len(m.device_rows):
                continue
            _check_range(
                m.device_rows, layout.group_num_blocks(m.group), f"device block id of group {m.group}"
            )
            destination = m.host_rows if store else m.device_rows
            if len(np.unique(destination)) != len(destination):
                what = "host sub-block" if store else "device block"
                raise ValueError(f"group {m.group} writes a {what} twice in job {job_id}")
            nbytes += len(m.device_rows) * layout.group_page_bytes(m.group)
            pieces.extend((t, m.device_rows, m.host_rows) for t in layout.groups[m.group])
        return _Job(job_id, store, pieces, nbytes)

    # -- completion ---------------------------------------------------------------------

    def _worker(self, direction: str) -> None:
        """Launch queued jobs, at most ``jobs_in_flight`` ahead, and finish them in order."""
        jobs = self._queues[direction]
        depth = max(1, self._executor.jobs_in_flight)
        state = None
        in_flight: deque[tuple[_Job, Any]] = deque()
        stopping = False
        while not (stopping and not in_flight):
            job = None
            if not stopping and len(in_flight) < depth:
                try:
                    # Block only when nothing is in flight; else take what is queued now.
                    job = jobs.get(block=not in_flight)
                except queue.Empty:
                    pass
                else:
                    stopping = job is None
            if job is not None:
                try:
                    if state is None:
                        state = self._executor.new_state()
                    in_flight.append((job, self._executor.launch(job.store, job.pieces, state, job.ready)))
                except BaseException as exc:  # noqa: BLE001 - any error fails this job only
                    self._complete(self._failed(job, direction, exc))
                continue
            if in_flight:
                job, handle = in_flight.popleft()
                try:
                    seconds = self._executor.finish(handle)
                    result = TransferResult(job.job_id, True, job.nbytes, seconds, direction)
                except BaseException as exc:  # noqa: BLE001 - any error fails this job only
                    result = self._failed(job, direction, exc)
                self._complete(result)

    @staticmethod
    def _failed(job: _Job, direction: str, exc: BaseException) -> TransferResult:
        return TransferResult(job.job_id, False, 0, 0.0, direction, f"{type(exc).__name__}: {exc}")

    def _complete(self, result: TransferResult) -> None:
        """Post ``result`` unless its job already has one (failed by a timed-out close)."""
        with self._jobs.lock:
            self._jobs.finish(result)

    def poll(self) -> list[TransferResult]:
        return self._jobs.poll()

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> None:
        """Block until every job in ``job_ids`` has finished; ``TimeoutError`` otherwise."""
        self._jobs.wait(job_ids, timeout)

    def close(self) -> None:
        if not self._jobs.close():
            return
        for direction in (STORE, LOAD):
            self._queues[direction].put(None)
        deadline = None if self.close_timeout is None else time.monotonic() + self.close_timeout
        for thread in self._threads:
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if any(thread.is_alive() for thread in self._threads):
            stuck = self._jobs.in_flight()
            logger.error("kvoffload: close() gave up on jobs %s after %ss", stuck, self.close_timeout)
            for job_id, direction in stuck:
                self._complete(
                    TransferResult(job_id, False, 0, 0.0, direction, "engine closed before the job finished")
                )
            return  # the stuck worker still uses the executor: leave it be
        self._executor.close()
