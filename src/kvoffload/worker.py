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

import itertools
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvoffload.held_loads import HeldLoad
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
    """Moves the bytes of the jobs whose medium pair is in ``routes``.

    Progress (optional): a worker with ``reports_progress`` calls ``on_progress(job_id,
    host_blocks)``, when set, from any of its threads, for each part of a job into host
    memory whose bytes are all written and checked, and ``on_progress(job_id, None)`` once
    the job's result can be polled. Quick and non-blocking: it only records the news."""

    routes: frozenset[Route] = frozenset()
    reports_progress = False
    on_progress = None

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

    Reads after writes: a *promotion* (a job into host memory from a lower tier: source
    neither ``CPU`` nor the device) writes its destination host blocks. A job submitted
    while a promotion is in flight that reads one of those blocks (the scheduler planned a
    load on blocks still being promoted) is *held* (``kvoffload.held_loads``), not queued
    whole: no part of it reads a host block before its bytes arrived. A load to the device
    with one host block per device block starts in pieces: at once for the blocks already
    in host memory, then for each part a promotion whose worker ``reports_progress`` says
    written, and the rest when the promotion finished; any other held job starts whole
    when its last promotion finished. If a promotion it reads from failed, no further part
    of it starts and it fails (``success=False``, ``error`` naming the promotion) once no
    part of it still runs. Its one result comes when every part finished. Parts are
    started on the thread that calls ``submit``, ``poll`` or ``wait`` (the engine's: on
    CUDA a load is ordered after the work queued on the caller's stream); ``wait`` for a
    held job waits for news of its promotions, starts what arrived, then waits for its
    parts. Its worker checks its specs when it starts: a refusal then is a failed result,
    not an exception.
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
        self._held: dict[int, HeldLoad] = {}  # job id -> job waiting for promotions or its pieces
        self._readers: dict[int, list[int]] = {}  # promotion -> held jobs reading its blocks
        self._results: list[TransferResult] = []  # gathered by wait, or held jobs finished
        self._piece_of: dict[int, int] = {}  # piece of a held job in flight -> the job's id
        self._piece_ids = itertools.count(-1, -1)  # below every job id the scheduler hands out
        self._news: list[tuple[int, list[int] | None]] = []  # (promotion, blocks written | None: ended)
        self._news_ready = threading.Condition()
        for worker in self.workers:
            if worker.reports_progress:
                worker.on_progress = self._progress

    def _progress(self, job_id: int, blocks: list[int] | None) -> None:  # any thread
        with self._news_ready:  # applied by the next submit, poll or wait
            self._news.append((job_id, blocks))
            self._news_ready.notify_all()

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
            waiting = {b: writer_of[b] for b in map(int, src_spec.block_ids) if b in writer_of}
            if waiting:
                held = self._held[job_id] = HeldLoad(worker, src_spec, dst_spec, waiting)
                for writer in held.writers:
                    self._readers.setdefault(writer, []).append(job_id)
                # promotions that ended since the last poll count now (a failed one fails it)
                self._apply_news()
                self._gather({id(w): w for w in map(self._owner.get, held.writers) if w}.values())
                held.submitted = True
                self._advance(job_id, held)  # the blocks already in host memory
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
        self._apply_news()
        self._gather(self.workers)
        results, self._results = self._results, []
        return results

    def _gather(self, workers: Iterable[OffloadingWorker]) -> None:
        """Poll ``workers`` into ``_results``; a finished promotion releases its readers,
        a finished piece counts towards its job."""
        for worker in workers:
            for result in worker.poll():
                self._owner.pop(result.job_id, None)
                job_id = self._piece_of.pop(result.job_id, None)
                if job_id is not None:
                    held = self._held[job_id]
                    held.piece_done(result)
                    self._advance(job_id, held)
                    continue
                self._results.append(result)
                if result.job_id in self._writes:
                    self._written(result)

    def _apply_news(self) -> None:
        """Blocks that promotions reported written start the pieces that read them; a
        promotion that ended, and a held job's piece (the blocks that arrived while it ran
        go next), are gathered from their workers."""
        if not self._news:
            return
        with self._news_ready:
            news, self._news = self._news, []
        ended = {id(h.worker): h.worker for h in self._held.values() if h.pieces}
        for writer, blocks in news:
            if writer not in self._writes:
                continue  # not a promotion, or one already gathered
            if blocks is None:
                worker = self._owner.get(writer)
                if worker is not None:
                    ended[id(worker)] = worker
                continue
            for job_id in list(self._readers.get(writer, ())):
                held = self._held[job_id]
                held.written(writer, blocks)
                self._advance(job_id, held)
        self._gather(ended.values())

    def _written(self, result: TransferResult) -> None:
        writer = result.job_id
        for block in self._writes.pop(writer):
            if self._writer_of.get(block) == writer:
                del self._writer_of[block]
        for job_id in self._readers.pop(writer, ()):
            held = self._held[job_id]
            held.writer_done(writer, result.success, result.error)
            self._advance(job_id, held)

    def _advance(self, job_id: int, held: HeldLoad) -> None:
        """Start what of held job ``job_id`` can start; post its result once it ended."""
        if not held.submitted:  # its submit is still catching up with its promotions
            return
        if held.whole_ready() and not held.writers:
            del self._held[job_id]
            self._start(job_id, held)
            return
        for src_spec, dst_spec in held.ready_pieces():
            piece = next(self._piece_ids)
            try:
                queued = held.worker.submit(piece, src_spec, dst_spec)
            except Exception as exc:  # noqa: BLE001 - accepted already: it must yield a result
                queued, held.error = False, held.error or f"{type(exc).__name__}: {exc}"
            if not queued:
                held.fail("its worker did not queue a part of it")
                continue
            held.pieces.add(piece)
            self._piece_of[piece] = job_id
            self._owner[piece] = held.worker
        if held.finished():
            del self._held[job_id]
            for writer in held.writers:  # a failed load stops waiting for its other promotions
                if job_id in self._readers.get(writer, ()):
                    self._readers[writer].remove(job_id)
            self._results.append(TransferResult(job_id, *held.result_fields()))

    def _start(self, job_id: int, held: HeldLoad) -> None:
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
            self._apply_news()
            held = [job_id for job_id in job_ids if job_id in self._held]
            if not held:
                break
            writers = {writer for job_id in held for writer in self._held[job_id].writers}
            if not writers:  # all of them started: wait for their pieces
                pieces = {piece for job_id in held for piece in self._held[job_id].pieces}
                if not pieces:
                    break
                self._wait_owned(pieces, deadline)
                self._gather(
                    {id(self._owner[p]): self._owner[p] for p in pieces if p in self._owner}.values()
                )
                continue
            plain = {w for w in writers if w in self._owner and not self._owner[w].reports_progress}
            try:
                if plain:
                    self._wait_owned(plain, deadline)
                else:
                    self._wait_news(deadline)
            except TimeoutError:
                raise TimeoutError(
                    f"jobs {sorted(held)} still wait for promotions {sorted(writers)}"
                ) from None
            self._gather({id(self._owner[w]): self._owner[w] for w in plain if w in self._owner}.values())
            for writer in plain & self._writes.keys():  # its worker said finished, gave no result
                self._written(TransferResult(writer, False, 0, 0.0, "", "finished without a result"))
        self._wait_owned(job_ids, deadline)

    def _wait_news(self, deadline: float | None) -> None:  # TimeoutError past the deadline
        with self._news_ready:
            while not self._news:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError
                self._news_ready.wait(left)

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
        closed = "the router closed before the promotions it reads from finished"
        for held in [h for h in self._held.values() if h.writers]:  # their promotions cannot end now
            held.fail(closed)
        self._apply_news()
        self._gather(self.workers)  # the promotions and pieces that ended
        for job_id, held in list(self._held.items()):  # nothing of them runs any more
            held.fail(closed)
            held.writers.clear()
            held.pieces.clear()
            self._advance(job_id, held)
        self._readers.clear()
