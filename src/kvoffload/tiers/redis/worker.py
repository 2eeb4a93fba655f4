"""``RedisWorker``: moves blocks between the host pool and the shared Redis/Valkey tier.

It is the ``kvoffload.worker.OffloadingWorker`` of routes ``CPU -> REMOTE`` (a store) and
``REMOTE -> CPU`` (a load), a peer of the device<->host engine behind a ``WorkerRouter``:

* store: ``submit(job_id, CPULoadStoreSpec(host_ids), RemoteLoadStoreSpec(keys))`` writes
  host block ``host_ids[i]`` (its row of every pool tensor, in tensor order) as the value
  of ``keys[i]`` (``kvoffload.tiers.redis.format``), all in one pipeline of ``SET NX``
  (with ``EX ttl`` when configured): a block another replica stored already is left as
  it is (counted in ``already_present``). The payload is sent from the host rows
  themselves (``pipelines.set_nx``), not joined into a value first.
* load: ``submit(job_id, RemoteLoadStoreSpec(keys), CPULoadStoreSpec(host_ids))`` reads
  the values in one pipeline of ``GET`` (``pipelines.get_into``): on a plain socket, where
  the C module ``_pipelines`` was built, each payload is received straight into its host
  block's rows and checked there (header, key and namespace digest first, CRC32C as it
  comes in); otherwise (TLS, or no C module) each value is checked in a receive buffer
  and copied into the rows once it passed. Where redis-py's connection offers no socket,
  both go through redis-py's commands (copies more each).

Contract, beyond ``kvoffload.worker``:

* ``submit`` validates first (``TypeError`` for another medium pair or spec class,
  ``ValueError`` naming the bad value: counts that differ, a host id out of range, a job
  id in flight; ``RuntimeError`` after ``close``) and never touches the network.
* Jobs run on ``io_threads`` connections, concurrently; a job succeeds or fails as a whole.
  Where the C module was built, each connection of a standalone server is a ``Lane``
  (``lanes``): ``submit`` plans the job's batch and queues it into C, where the lane's
  thread sends it the moment the batch before it is answered, without the GIL; a job whose
  batch C answered in full is finished by the next ``poll`` or ``wait`` (or ``close``). A job
  whose batch C could not run as planned is finished on the lane's thread, or on a pool
  thread where that needs the network (a corrupt value's ``UNLINK``); a batch whose
  connection was found closed (it may have gone stale while idle), or that never went out
  (no connection, the breaker open), runs again on a pool thread as below. On a cluster (or
  with ``back_to_back=False``), each job runs on a pool thread, its batch on a connection
  taken from the client's pool.
  A failed load leaves its host rows unspecified (they may hold a bad value's bytes: the
  rows of a load are reserved, not loadable, and a failed load never makes them so). A
  value that is missing (evicted or expired since the lookup) fails the load; a value
  whose header, key, namespace digest or CRC does not match fails it too, is deleted from
  the server (``UNLINK``) and is counted in ``corrupt_values``: it never reaches the engine.
* Every call is bounded by the client's timeouts and goes through ``NodeCalls``: one
  pipeline per node, a circuit breaker per node that fails a job's keys of a down node at
  once (``stores_dropped``, ``loads_failed``) and lets a call through now and then to
  notice its return. On a cluster a job's keys on healthy nodes are still written (a
  failed store leaves them as harmless extra copies). Nothing raises out of
  ``submit``/``poll`` for network errors.
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from kvoffload.counters import Counters
from kvoffload.specs import MEDIUM_CPU, MEDIUM_REMOTE, LoadStoreSpec, RemoteLoadStoreSpec
from kvoffload.tiers.host_rows import HostRows
from kvoffload.tiers.redis import pipelines
from kvoffload.tiers.redis.calls import NodeCalls, NodeDown, refused
from kvoffload.tiers.redis.format import CorruptValue, KeyNames, decode, encode
from kvoffload.tiers.redis.lanes import AVAILABLE as LANES_AVAILABLE
from kvoffload.tiers.redis.lanes import Completions, Lane
from kvoffload.tiers.redis.pipelines import get_into, set_nx
from kvoffload.tiers.redis.resp import RespStream
from kvoffload.tiers.shared_store_jobs import check_job
from kvoffload.validation import positive_int
from kvoffload.worker import JobBook, OffloadingWorker, Route, TransferResult

STORE = "remote_store"  # host -> remote
LOAD = "remote_load"  # remote -> host
_DIRECTIONS: dict[Route, str] = {(MEDIUM_CPU, MEDIUM_REMOTE): STORE, (MEDIUM_REMOTE, MEDIUM_CPU): LOAD}


@dataclass
class RedisWorkerCounters(Counters):
    stores: int = 0  # store jobs that succeeded
    stores_dropped: int = 0  # store jobs failed (server down, slow, refused)
    loads: int = 0
    loads_failed: int = 0
    blocks_written: int = 0
    already_present: int = 0  # SET NX found the block stored already (another replica)
    blocks_read: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    missing_values: int = 0  # a loaded key the server no longer had
    corrupt_values: int = 0  # failed a check on read; deleted from the server
    outages: int = 0
    back_to_back: int = 0  # batches queued in C behind another on their connection, sent as it was answered


@dataclass
class _Job:
    """A job queued on a lane: what finishing it needs."""

    job_id: int
    direction: str
    host_ids: list[int]
    keys: list[bytes]
    names: list[bytes]
    start: float
    plan: list | None = None  # a load's plan (pipelines.planned_get)


class _JobFailed(Exception):
    pass


def _raise(exc: BaseException) -> int:
    raise exc


class RedisWorker(OffloadingWorker):
    """Moves blocks between ``host_pool`` and the server behind ``connect``."""

    routes = frozenset(_DIRECTIONS)

    def __init__(
        self,
        host_pool,
        calls: NodeCalls,
        names: KeyNames,
        *,
        io_threads: int = 2,
        ttl: int | None = None,
        back_to_back: bool = True,
    ) -> None:
        self.host_pool = host_pool
        # a block's rows as the fewest byte views (one for an interleaved pool): what
        # sendmsg sends from and recvmsg_into receives into
        self._host = HostRows(host_pool)
        self.block_bytes = self._host.block_bytes
        self.calls = calls
        self._names = names
        self._ttl = ttl
        connections = positive_int("io_threads", io_threads)
        use_lanes = back_to_back and LANES_AVAILABLE and not calls.cluster
        self._completions = Completions() if use_lanes else None
        self._lanes = (
            [
                Lane(calls, self._completions, self._settle, self._failed, self._unsent)
                for _ in range(connections)
            ]
            if use_lanes
            else []
        )
        self._next_lane = itertools.cycle(self._lanes)
        # jobs that do not run on a lane, and the slow ends of those that did
        self._pool = ThreadPoolExecutor(connections, "kvoffload-redis-io")
        self._jobs = JobBook()
        self._lock = self._jobs.lock  # also guards the counters
        self._counters = RedisWorkerCounters()

    # -- submission ----------------------------------------------------------------------

    def submit(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        direction, host_ids, keys = check_job(
            "RedisWorker",
            _DIRECTIONS,
            RemoteLoadStoreSpec,
            job_id,
            src_spec,
            dst_spec,
            self.host_pool.num_blocks,
        )
        self._jobs.begin(job_id)
        lane = next(self._next_lane) if self._lanes else None
        if lane is None or not lane.usable or self.calls.breaker("server").is_open:
            self._pool.submit(self._run, job_id, direction, host_ids, keys)
            return True
        job = _Job(job_id, direction, host_ids, keys, self._names.names(keys), time.perf_counter())
        items = [(name, key, self._host.block(i)) for name, key, i in zip(job.names, keys, host_ids)]
        digest = self._names.digest
        try:
            if direction == STORE:
                buffers, checksums = pipelines.planned_set_nx(items, digest, self._ttl, native=True)
                lane.push_set(job, buffers, len(keys), checksums)
            else:
                request, job.plan = pipelines.planned_get(items, digest)
                lane.push_get(job, request, job.plan)
        except Exception:  # noqa: BLE001 - the lane is closing: the job runs as if it had none
            self._unsent(job)
        return True

    # -- the jobs ------------------------------------------------------------------------

    def _run(self, job_id: int, direction: str, host_ids: list[int], keys: list[bytes]) -> None:
        start = time.perf_counter()
        self._finish(
            job_id,
            direction,
            start,
            lambda: (self._store if direction == STORE else self._load)(host_ids, keys),
        )

    def _finish(self, job_id: int, direction: str, start: float, job) -> None:
        """Post the result of ``job()`` (the bytes moved, or an exception: failed)."""
        try:
            moved = job()
            error = None
        except _JobFailed as exc:
            moved, error = 0, str(exc)
        except Exception as exc:  # noqa: BLE001 - a job never raises into the engine
            moved, error = 0, f"{type(exc).__name__}: {exc}"
        with self._lock:
            counters = self._counters
            if direction == STORE:
                counters.stores += error is None
                counters.stores_dropped += error is not None
            else:
                counters.loads += error is None
                counters.loads_failed += error is not None
            self._jobs.finish(
                TransferResult(job_id, error is None, moved, time.perf_counter() - start, direction, error)
            )
        if self._completions is not None:
            self._completions.bump()

    # -- jobs on lanes -------------------------------------------------------------------

    def _collect(self) -> None:
        """Finish the jobs whose batches C answered in full."""
        for lane in self._lanes:
            done = lane.collect()
            if done:
                self.calls.answered(len(done))
            for job, result in done:
                try:
                    self._settle(job, None, result)
                except Exception as exc:  # noqa: BLE001 - poll never raises; the job fails
                    self._finish(job.job_id, job.direction, job.start, functools.partial(_raise, exc))

    def _settle(self, job: _Job, stream: RespStream | None, result: tuple) -> None:
        """Finish ``job`` from what C gave (``result``), its batch's other replies read on
        ``stream`` (``None``: C answered every one); a load that needs the network to
        finish (a corrupt value to delete) is finished on a pool thread."""
        indices = list(range(len(job.keys)))
        if stream is not None:
            self.calls.answered()
        if job.direction == STORE:
            replies = refused(pipelines.set_replies(stream, *result, len(job.keys)), indices)
            self._finish(job.job_id, STORE, job.start, lambda: self._stored(replies, len(job.keys)))
            return
        values = refused(pipelines.get_replies(stream, *result, job.plan, self._names.digest), indices)
        finish = lambda: self._loaded(job.host_ids, job.keys, job.names, values)  # noqa: E731
        if all(value is True for value in values):
            self._finish(job.job_id, LOAD, job.start, finish)
        else:
            self._pool.submit(self._finish, job.job_id, LOAD, job.start, finish)

    def _failed(self, job: _Job, exc: BaseException) -> None:
        """``job``'s batch failed on its lane: run again on a pool thread if the connection
        was found closed (it may have gone stale while idle), else failed and counted."""
        if isinstance(exc, ConnectionError):
            self._unsent(job)
            return
        self.calls.failed(exc)
        values = [NodeDown(f"{type(exc).__name__}: {exc}")] * len(job.keys)
        if job.direction == STORE:
            self._finish(job.job_id, STORE, job.start, lambda: self._stored(values, len(job.keys)))
        else:
            self._finish(
                job.job_id, LOAD, job.start, lambda: self._loaded(job.host_ids, job.keys, job.names, values)
            )

    def _unsent(self, job: _Job) -> None:
        self._pool.submit(self._run, job.job_id, job.direction, job.host_ids, job.keys)

    # -- a job's batches -----------------------------------------------------------------

    def _store(self, host_ids: list[int], keys: list[bytes]) -> int:
        digest, ttl, payload = self._names.digest, self._ttl, self._host.block
        names = self._names.names(keys)
        expiry = () if ttl is None else ("EX", ttl)

        def command(name: bytes, i: int) -> tuple:
            return ("SET", name, encode(keys[i], payload(host_ids[i]), digest), "NX", *expiry)

        def streamed(stream, indices: list[int]) -> list:
            return set_nx(stream, [(names[i], keys[i], payload(host_ids[i])) for i in indices], digest, ttl)

        return self._stored(self.calls.run(names, command, streamed), len(keys))

    def _stored(self, replies: list, count: int) -> int:
        down = next((r for r in replies if isinstance(r, NodeDown)), None)
        with self._lock:
            self._counters.blocks_written += sum(1 for r in replies if r == b"OK")
            self._counters.already_present += sum(1 for r in replies if r is None)
        if down is not None:
            raise _JobFailed(f"store failed: {down.reason}")
        with self._lock:
            self._counters.bytes_written += self.block_bytes * count
        return self.block_bytes * count

    def _load(self, host_ids: list[int], keys: list[bytes]) -> int:
        names = self._names.names(keys)
        digest, payload = self._names.digest, self._host.block

        def streamed(stream, indices: list[int]) -> list:
            items = [(names[i], keys[i], payload(host_ids[i])) for i in indices]
            return get_into(stream, items, digest)

        values = self.calls.run(names, lambda name, _: ("GET", name), streamed)
        return self._loaded(host_ids, keys, names, values)

    def _loaded(self, host_ids: list[int], keys: list[bytes], names: list[bytes], values: list) -> int:
        digest, size, payload = self._names.digest, self.block_bytes, self._host.block
        corrupt: list[bytes] = []
        failure = None
        for host_id, key, name, value in zip(host_ids, keys, names, values):
            if value is True:  # read into the rows and checked
                continue
            if isinstance(value, NodeDown):
                failure = failure or f"load failed: {value.reason}"
                continue
            if value is None:
                failure = failure or f"block {key.hex()} is no longer on the server"
                with self._lock:
                    self._counters.missing_values += 1
                continue
            try:
                if isinstance(value, CorruptValue):
                    raise value
                data = memoryview(decode(value, key, digest, size)).cast("B")
            except CorruptValue as exc:
                corrupt.append(name)
                failure = failure or f"block {key.hex()} is corrupt: {exc}"
                continue
            offset = 0
            for view in payload(host_id):
                view[:] = data[offset : offset + len(view)]
                offset += len(view)
        if corrupt:
            with self._lock:
                self._counters.corrupt_values += len(corrupt)
            self.calls.run(corrupt, lambda name, _: ("UNLINK", name))
        if failure:
            raise _JobFailed(failure)
        with self._lock:
            self._counters.blocks_read += len(keys)
            self._counters.bytes_read += size * len(keys)
        return size * len(keys)

    # -- results -------------------------------------------------------------------------

    def poll(self) -> list[TransferResult]:
        self._collect()
        return self._jobs.poll()

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> None:
        if self._completions is None:
            self._jobs.wait(job_ids, timeout)
            return
        wanted = set(job_ids)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            seen = self._completions.count  # before collecting: a completion after it wakes the wait
            self._collect()
            running = wanted.intersection(job_id for job_id, _ in self._jobs.in_flight())
            if not running:
                return
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(f"jobs {sorted(running)} still running")
            self._completions.wait(seen, left)

    def counters(self) -> RedisWorkerCounters:
        with self._lock:
            return self._counters.snapshot(
                outages=self.calls.outages, back_to_back=sum(lane.back_to_back for lane in self._lanes)
            )

    def close(self) -> None:
        """Let queued jobs finish (each bounded by the client's timeouts), then release."""
        if self._jobs.close():
            for lane in self._lanes:
                lane.close()  # its queued batches run first
            self._collect()
            self._pool.shutdown(wait=True)
