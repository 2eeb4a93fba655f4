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
host⇄disk, host⇄remote) are peers behind one interface. Torch-free.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvoffload.specs import LoadStoreSpec

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


class WorkerRouter(OffloadingWorker):
    """Routes jobs to ``workers`` by ``(src_spec.medium, dst_spec.medium)``.

    Each route belongs to exactly one worker. Job ids are unique across all of them while
    in flight. ``poll`` gathers every worker's results; ``close`` closes every worker.
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
        if job_id in self._owner:
            raise ValueError(f"job id {job_id} is already in flight")
        queued = worker.submit(job_id, src_spec, dst_spec)
        if queued:
            self._owner[job_id] = worker
        return queued

    def poll(self) -> list[TransferResult]:
        results = [result for worker in self.workers for result in worker.poll()]
        for result in results:
            self._owner.pop(result.job_id, None)
        return results

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> None:
        by_worker: dict[int, list[int]] = {}
        for job_id in job_ids:
            worker = self._owner.get(job_id)
            if worker is not None:
                by_worker.setdefault(id(worker), []).append(job_id)
        deadline = None if timeout is None else time.monotonic() + timeout
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
