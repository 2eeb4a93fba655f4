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
  driven by two threads: while one job's batch is on the wire, the next job queued is
  planned on the other thread and waits in C for its turn, so queued jobs run back to
  back, each batch sent when the one before it is answered (``lanes``). A job that an
  earlier job's failure kept from being sent runs again on a fresh connection. On a
  cluster (or with ``back_to_back=False``: one thread per connection, each batch sent
  after the Python of the job before it), each batch takes a connection from the
  client's pool.
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

import itertools
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from kvoffload.counters import Counters
from kvoffload.specs import MEDIUM_CPU, MEDIUM_REMOTE, LoadStoreSpec, RemoteLoadStoreSpec
from kvoffload.tiers.host_rows import HostRows
from kvoffload.tiers.redis.calls import NodeCalls, NodeDown
from kvoffload.tiers.redis.format import CorruptValue, KeyNames, decode, encode
from kvoffload.tiers.redis.lanes import AVAILABLE as LANES_AVAILABLE
from kvoffload.tiers.redis.lanes import Lane
from kvoffload.tiers.redis.pipelines import get_into, set_nx
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


class _JobFailed(Exception):
    pass


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
        # a lane per connection, two threads each (see lanes): thread k drives lane k // 2
        use_lanes = back_to_back and LANES_AVAILABLE and not calls.cluster
        self._lanes = [Lane() for _ in range(connections)] if use_lanes else []
        self._thread_lane = threading.local()
        order = itertools.count()

        def assign_lane() -> None:
            self._thread_lane.lane = self._lanes[next(order) // 2] if self._lanes else None

        threads = 2 * connections if self._lanes else connections
        self._pool = ThreadPoolExecutor(threads, "kvoffload-redis-io", initializer=assign_lane)
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
        self._pool.submit(self._run, job_id, direction, host_ids, keys)
        return True

    # -- the jobs ------------------------------------------------------------------------

    def _run(self, job_id: int, direction: str, host_ids: list[int], keys: list[bytes]) -> None:
        start = time.perf_counter()
        try:
            moved = (self._store if direction == STORE else self._load)(host_ids, keys)
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

    def _store(self, host_ids: list[int], keys: list[bytes]) -> int:
        digest, ttl, payload = self._names.digest, self._ttl, self._host.block
        names = self._names.names(keys)
        expiry = () if ttl is None else ("EX", ttl)

        def command(name: bytes, i: int) -> tuple:
            return ("SET", name, encode(keys[i], payload(host_ids[i]), digest), "NX", *expiry)

        def streamed(stream, indices: list[int]) -> list:
            return set_nx(stream, [(names[i], keys[i], payload(host_ids[i])) for i in indices], digest, ttl)

        replies = self.calls.run(names, command, streamed, getattr(self._thread_lane, "lane", None))
        down = next((r for r in replies if isinstance(r, NodeDown)), None)
        with self._lock:
            self._counters.blocks_written += sum(1 for r in replies if r == b"OK")
            self._counters.already_present += sum(1 for r in replies if r is None)
        if down is not None:
            raise _JobFailed(f"store failed: {down.reason}")
        with self._lock:
            self._counters.bytes_written += self.block_bytes * len(keys)
        return self.block_bytes * len(keys)

    def _load(self, host_ids: list[int], keys: list[bytes]) -> int:
        names = self._names.names(keys)
        digest, size, payload = self._names.digest, self.block_bytes, self._host.block

        def streamed(stream, indices: list[int]) -> list:
            items = [(names[i], keys[i], payload(host_ids[i])) for i in indices]
            return get_into(stream, items, digest)

        values = self.calls.run(
            names, lambda name, _: ("GET", name), streamed, getattr(self._thread_lane, "lane", None)
        )
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
        return self._jobs.poll()

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> None:
        self._jobs.wait(job_ids, timeout)

    def counters(self) -> RedisWorkerCounters:
        with self._lock:
            return self._counters.snapshot(
                outages=self.calls.outages, back_to_back=sum(lane.back_to_back for lane in self._lanes)
            )

    def close(self) -> None:
        """Let queued jobs finish (each bounded by the client's timeouts), then release."""
        if self._jobs.close():
            self._pool.shutdown(wait=True)
            for lane in self._lanes:
                lane.close()
