"""The worker-side contract: move the bytes of transfer jobs, asynchronously.

A job is a job id and a (source, destination) pair of specs (``kvoffload.specs``) handed
out by the scheduler side. An ``OffloadingWorker`` moves the jobs of the medium pairs it
lists in ``routes`` (``(source medium, destination medium)``, e.g. ``("GPU", "CPU")`` for a
store from the device to host memory):

* ``submit(job_id, src_spec, dst_spec)`` validates the job and queues it; it returns
  ``True`` when queued and raises ``ValueError`` naming the bad value (a bad spec, a job id
  already in flight), ``TypeError`` for a medium pair it does not move, ``RuntimeError``
  after ``close``. It never waits for a copy.
* ``poll()`` returns the ``TransferResult``s finished since the last poll. A failed job
  (``success=False``) leaves its destination blocks unspecified: the scheduler side must
  not mark them loadable.
* ``wait(job_ids, timeout=None)`` blocks until those jobs finished (their results stay for
  ``poll``); unknown ids count as finished; ``TimeoutError`` when the timeout passes.
* ``close()`` lets queued jobs finish and releases the worker; idempotent.

``WorkerRouter`` is the one worker an engine talks to: it routes each job by its medium
pair to the worker registered for that pair, so movers of different media (device⇄host,
host⇄disk, host⇄remote) are peers behind one interface, and it orders a job that reads
host blocks after the promotion still writing them (a load chained on a promotion, see
the class). Torch-free.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvoffload.specs import MEDIUM_CPU, MEDIUM_DEVICE, LoadStoreSpec

Route = tuple[str, str]  # (source medium, destination medium)


@dataclass(frozen=True)
class TransferResult:
    """Outcome of one job: ``bytes`` moved (0 when it failed), ``seconds`` spent copying
    (not queued), ``direction`` (the worker's name for the job's route, e.g. ``"store"``)."""

    job_id: int
    success: bool
    bytes: int
    seconds: float
    direction: str
    error: str | None = None


class OffloadingWorker(ABC):
    """Moves the bytes of the jobs whose medium pair is in ``routes``."""

    routes: frozenset[Route] = frozenset()

    @abstractmethod
    def submit(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        """Queue a job; see the module docstring for the errors."""

    @abstractmethod
    def poll(self) -> list[TransferResult]:
        """Results finished since the last poll."""

    @abstractmethod
    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> None:
        """Block until ``job_ids`` finished; ``TimeoutError`` after ``timeout`` seconds."""

    @abstractmethod
    def close(self) -> None:
        """Finish queued jobs and release the worker; idempotent."""

    def __enter__(self) -> OffloadingWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class JobBook:
    """The bookkeeping a worker's ``submit``, copy threads, ``poll``, ``wait`` and ``close``
    share: job ids in flight (each with a tag the worker chooses, e.g. its direction),
    results not yet polled, whether it is closed. ``lock`` (a re-entrant condition) guards
    them; a worker may take it for its own counters too, or to make a submit atomic with
    queueing the job."""

    def __init__(self) -> None:
        self.lock = threading.Condition()
        self.closed = False
        self._pending: dict[int, object] = {}
        self._results: list[TransferResult] = []

    def begin(self, job_id: int, tag: object = None) -> None:
        """Record ``job_id`` in flight; ``RuntimeError`` after ``close``, ``ValueError`` if
        it is in flight already."""
        with self.lock:
            if self.closed:
                raise RuntimeError(f"submit({job_id}) after close()")
            if job_id in self._pending:
                raise ValueError(f"job id {job_id} is already in flight")
            self._pending[job_id] = tag

    def finish(self, result: TransferResult) -> bool:
        """Post ``result``; call with ``lock`` held. A job with a result already (failed by
        a timed-out ``close``) or never begun is ignored: ``False``."""
        if result.job_id not in self._pending:
            return False
        del self._pending[result.job_id]
        self._results.append(result)
        self.lock.notify_all()
        return True

    def in_flight(self) -> list[tuple[int, object]]:
        """``(job id, tag)`` of every job without a result yet, by job id."""
        with self.lock:
            return sorted(self._pending.items(), key=lambda item: item[0])

    def poll(self) -> list[TransferResult]:
        with self.lock:
            results, self._results = self._results, []
        return results

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> None:
        wanted = set(job_ids)
        with self.lock:
            if not self.lock.wait_for(lambda: not (wanted & self._pending.keys()), timeout):
                raise TimeoutError(f"jobs {sorted(wanted & self._pending.keys())} still running")

    def close(self) -> bool:
        """Mark closed; ``True`` the first time only."""
        with self.lock:
            first, self.closed = not self.closed, True
        return first


@dataclass
class _Held:
    """A job waiting for the promotions (``writers``) that fill the host blocks it reads."""

    worker: OffloadingWorker
    src_spec: LoadStoreSpec
    dst_spec: LoadStoreSpec
    writers: set[int]
    error: str | None = None  # a writer failed: the job fails without running


class WorkerRouter(OffloadingWorker):
    """Routes jobs to ``workers`` by ``(src_spec.medium, dst_spec.medium)``.

    Each route belongs to exactly one worker. Job ids are unique across all of them while
    in flight. ``poll`` gathers every worker's results; ``close`` closes every worker.

    Reads after writes: a *promotion* (a job into host memory from a lower tier: source
    neither ``CPU`` nor the device) writes its destination host blocks. A job submitted
    while a promotion is in flight that reads one of those blocks (the scheduler planned a
    load on blocks still being promoted) is *held*, not queued: it starts once every
    promotion it reads from has finished, and if one of them failed it does not run and
    fails (``success=False``, ``error`` naming the promotion). So no job ever reads a host
    block before its bytes arrived. A held job is started on the thread that calls
    ``poll`` or ``wait`` (the engine's: on CUDA a load is ordered after the work queued on
    the caller's stream), as soon as one of them sees its last promotion finish; ``wait``
    for a held job waits for its promotions, starts it, then waits for it. Its worker
    checks its specs when it starts: a refusal then is a failed result, not an exception.
    """

    def __init__(self, workers: Sequence[OffloadingWorker]) -> None:
        self.workers = list(workers)
        self._by_route: dict[Route, OffloadingWorker] = {}
        for worker in self.workers:
            for route in sorted(worker.routes):
                if route in self._by_route:
                    raise ValueError(
                        f"route {route[0]}->{route[1]} is served by both "
                        f"{type(self._by_route[route]).__name__} and {type(worker).__name__}"
                    )
                self._by_route[route] = worker
        self.routes = frozenset(self._by_route)
        self._owner: dict[int, OffloadingWorker] = {}  # job id -> worker, until polled
        self._closed = False
        self._writer_of: dict[int, int] = {}  # host block -> promotion in flight writing it
        self._writes: dict[int, list[int]] = {}  # promotion in flight -> its host blocks
        self._held: dict[int, _Held] = {}  # job id -> job waiting for promotions
        self._readers: dict[int, list[int]] = {}  # promotion -> held jobs reading its blocks
        self._results: list[TransferResult] = []  # gathered by wait, or held jobs failed

    def worker_for(self, route: Route) -> OffloadingWorker:
        """The worker serving ``route``; ``TypeError`` naming it when none does."""
        worker = self._by_route.get(route)
        if worker is None:
            known = ", ".join(f"{s}->{d}" for s, d in sorted(self._by_route))
            raise TypeError(f"no worker moves {route[0]}->{route[1]} jobs; routes: {known}")
        return worker

    def submit(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        if self._closed:
            raise RuntimeError(f"submit({job_id}) after close()")
        worker = self.worker_for((src_spec.medium, dst_spec.medium))
        if job_id in self._owner or job_id in self._held:
            raise ValueError(f"job id {job_id} is already in flight")
        if self._writer_of and src_spec.medium == MEDIUM_CPU:
            writer_of = self._writer_of
            writers = {writer_of[b] for b in map(int, src_spec.block_ids) if b in writer_of}
            if writers:
                self._held[job_id] = _Held(worker, src_spec, dst_spec, writers)
                for writer in writers:
                    self._readers.setdefault(writer, []).append(job_id)
                return True
        queued = worker.submit(job_id, src_spec, dst_spec)
        if queued:
            self._owner[job_id] = worker
            if dst_spec.medium == MEDIUM_CPU and src_spec.medium != MEDIUM_DEVICE:
                blocks = list(map(int, dst_spec.block_ids))
                self._writes[job_id] = blocks
                self._writer_of.update(dict.fromkeys(blocks, job_id))
        return queued

    def poll(self) -> list[TransferResult]:
        self._gather(self.workers)
        results, self._results = self._results, []
        return results

    def _gather(self, workers: Iterable[OffloadingWorker]) -> None:
        """Poll ``workers`` into ``_results``; a finished promotion releases its readers."""
        for worker in workers:
            for result in worker.poll():
                self._owner.pop(result.job_id, None)
                self._results.append(result)
                if result.job_id in self._writes:
                    self._written(result)

    def _written(self, result: TransferResult) -> None:
        writer = result.job_id
        for block in self._writes.pop(writer):
            if self._writer_of.get(block) == writer:
                del self._writer_of[block]
        for job_id in self._readers.pop(writer, ()):
            held = self._held[job_id]
            held.writers.discard(writer)
            if not result.success and held.error is None:
                held.error = f"promotion {writer} of its source blocks failed: {result.error}"
            if not held.writers:
                del self._held[job_id]
                self._start(job_id, held)

    def _start(self, job_id: int, held: _Held) -> None:
        error = held.error
        if error is None:
            try:
                if held.worker.submit(job_id, held.src_spec, held.dst_spec):
                    self._owner[job_id] = held.worker
                    return
                error = "its worker did not queue it"
            except Exception as exc:  # noqa: BLE001 - accepted already: it must yield a result
                error = f"{type(exc).__name__}: {exc}"
        route = f"{held.src_spec.medium}->{held.dst_spec.medium}"
        self._results.append(TransferResult(job_id, False, 0, 0.0, route, error))

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> None:
        job_ids = list(job_ids)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            held = [job_id for job_id in job_ids if job_id in self._held]
            if not held:
                break
            writers = {writer for job_id in held for writer in self._held[job_id].writers}
            try:
                self._wait_owned(writers, deadline)
            except TimeoutError:
                raise TimeoutError(
                    f"jobs {sorted(held)} still wait for promotions {sorted(writers)}"
                ) from None
            self._gather({id(self._owner[w]): self._owner[w] for w in writers if w in self._owner}.values())
            for writer in writers & self._writes.keys():  # its worker said finished, gave no result
                self._written(TransferResult(writer, False, 0, 0.0, "", "finished without a result"))
        self._wait_owned(job_ids, deadline)

    def _wait_owned(self, job_ids: Iterable[int], deadline: float | None) -> None:
        by_worker: dict[int, list[int]] = {}
        for job_id in job_ids:
            worker = self._owner.get(job_id)
            if worker is not None:
                by_worker.setdefault(id(worker), []).append(job_id)
        for worker in self.workers:
            ids = by_worker.get(id(worker))
            if ids:
                worker.wait(ids, None if deadline is None else max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for worker in self.workers:
            worker.close()
        for job_id, held in self._held.items():  # their workers are closed: they cannot start
            held.error = held.error or "the router closed before the promotions it reads from finished"
            self._start(job_id, held)
        self._held.clear()
        self._readers.clear()
