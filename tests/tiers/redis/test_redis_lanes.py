"""Queued jobs back to back on one connection (``lanes``, ``_pipelines.JobQueue``), against
a real redis-server: a job queued behind a batch on the wire waits for it in C and goes out
as soon as it is answered; a missing or corrupt value fails its own job only; a batch
whose connection dies, and the job queued behind it, run again on a fresh connection, as
does one on a connection the server closed while it was idle; a batch that times out fails
its job and opens the breaker; many jobs of both directions at once on one connection all
land byte-exact.

A gate proxy between worker and server holds the server's replies back, so that a batch
stays on the wire while the test queues others behind it (no timing involved)."""

from __future__ import annotations

import contextlib
import gc
import socket
import threading
import time

import pytest
import torch

from free_ports import free_port
from kvoffload.keys import make_offload_key
from kvoffload.specs import CPULoadStoreSpec, RemoteLoadStoreSpec
from kvoffload.tiers.redis import lanes
from kvoffload.tiers.redis.calls import NodeCalls
from kvoffload.tiers.redis.client import ServerSettings, connect
from kvoffload.tiers.redis.format import KeyNames
from kvoffload.tiers.redis.worker import RedisWorker
from kvoffload.transfer import HostBlockPool, KVLayout
from redis_server import redis_server  # noqa: F401 - fixture

pytestmark = pytest.mark.skipif(not lanes.AVAILABLE, reason="kvoffload.tiers.redis._pipelines not built")
NAMES = KeyNames("kvoffload", "kvr-lanes")
HANG_GUARD = 30.0
WIDTH = 128 * 1024  # a batch of 4 takes several reads: what C left unread is read in Python


class GateProxy:
    """Forwards 127.0.0.1:``port`` to the server; while ``gate`` is closed the server's
    replies are held back; ``cut()`` closes every connection made so far."""

    def __init__(self, server_port: int) -> None:
        self.gate = threading.Event()
        self.gate.set()
        self._server_port = server_port
        self._listener = socket.create_server(("127.0.0.1", free_port()))
        self.port = self._listener.getsockname()[1]
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self._server_port))
            self._socks += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, gated: bool) -> None:
        try:
            while data := src.recv(1 << 16):
                if gated and not self.gate.wait(HANG_GUARD):
                    return
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        for sock in list(self._socks):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._listener.close()
        self.cut()


def make_pool(width: int, blocks: int, seed: int) -> HostBlockPool:
    pool = HostBlockPool(
        KVLayout.from_layer_tensors({"l0": torch.zeros((blocks, width), dtype=torch.uint8)}), blocks
    )
    pool.tensors[0].copy_(
        torch.randint(
            0, 256, (blocks, width), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
        )
    )
    return pool


def k(i: int) -> bytes:
    return make_offload_key(i.to_bytes(32, "big"), 0)


def worker_on(url: str, pool: HostBlockPool, timeout: float = HANG_GUARD) -> RedisWorker:
    settings = ServerSettings(url, connect_timeout=2.0, timeout=timeout)
    return RedisWorker(pool, NodeCalls(lambda: connect(settings), "test"), NAMES, io_threads=1)


def finish(worker: RedisWorker, job_ids: list[int]) -> dict[int, object]:
    worker.wait(job_ids, HANG_GUARD)
    return {r.job_id: r for r in worker.poll()}


def until(condition, what: str) -> None:
    """Wait for ``condition`` (polled; the deadline is only a hang guard)."""
    deadline = time.monotonic() + HANG_GUARD
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.002)


@pytest.fixture
def stored(redis_server):  # noqa: F811 - the blocks 0..11 of a writer's pool, on the server
    writer_pool = make_pool(WIDTH, 12, seed=1)
    writer = worker_on(redis_server.url, writer_pool)
    writer.submit(1, CPULoadStoreSpec(list(range(12))), RemoteLoadStoreSpec([k(i) for i in range(12)]))
    assert finish(writer, [1])[1].success
    writer.close()
    return writer_pool


def queued_loads(redis_server, stored, jobs: dict[int, list[int]]):  # noqa: F811
    """A reader behind a closed gate: job ``j`` loads blocks ``jobs[j]`` into the same host
    ids; returns once a batch waits in C behind another one on the wire."""
    proxy = GateProxy(redis_server.port)
    reader = worker_on(proxy.url, make_pool(WIDTH, 12, seed=2))
    reader.submit(99, RemoteLoadStoreSpec([k(0)]), CPULoadStoreSpec([0]))  # connects the lane
    assert finish(reader, [99])[99].success
    proxy.gate.clear()
    for job, blocks in jobs.items():
        reader.submit(job, RemoteLoadStoreSpec([k(i) for i in blocks]), CPULoadStoreSpec(blocks))
    until(lambda: reader.counters().back_to_back >= 1, "a batch queued in C behind the one on the wire")
    return proxy, reader


def same(pool_a: HostBlockPool, pool_b: HostBlockPool, blocks: list[int]) -> bool:
    return all(torch.equal(pool_a.tensors[0][b], pool_b.tensors[0][b]) for b in blocks)


def test_a_job_queued_behind_a_batch_on_the_wire_goes_out_when_it_is_answered(redis_server, stored):  # noqa: F811
    jobs = {1: [0, 1, 2, 3], 2: [4, 5, 6, 7], 3: [8, 9, 10, 11]}
    proxy, reader = queued_loads(redis_server, stored, jobs)
    proxy.gate.set()
    results = finish(reader, list(jobs))
    assert all(results[j].success for j in jobs), results
    assert same(stored, reader.host_pool, list(range(12)))
    assert reader.counters().back_to_back >= 1 and reader.counters().blocks_read == 13
    reader.close()
    proxy.close()


def test_a_missing_value_fails_its_own_job_only(redis_server, stored):  # noqa: F811
    redis_server.client().delete(NAMES.name(k(4)))  # the first reply of job 2: the rest read in Python
    jobs = {1: [0, 1, 2, 3], 2: [4, 5, 6, 7], 3: [8, 9, 10, 11]}
    proxy, reader = queued_loads(redis_server, stored, jobs)
    proxy.gate.set()
    results = finish(reader, list(jobs))
    assert results[1].success and results[3].success
    assert not results[2].success and k(4).hex() in results[2].error
    assert same(stored, reader.host_pool, [0, 1, 2, 3, 8, 9, 10, 11])
    assert reader.counters().missing_values == 1 and reader.counters().loads_failed == 1
    reader.close()
    proxy.close()


def test_a_corrupt_value_fails_its_own_job_only_and_is_deleted(redis_server, stored):  # noqa: F811
    client = redis_server.client()
    name = NAMES.name(k(6))
    value = bytearray(client.get(name))
    value[-100] ^= 0xFF  # a payload byte: only the CRC32C can tell
    client.set(name, bytes(value))
    jobs = {1: [0, 1, 2, 3], 2: [4, 5, 6, 7], 3: [8, 9, 10, 11]}
    proxy, reader = queued_loads(redis_server, stored, jobs)
    proxy.gate.set()
    results = finish(reader, list(jobs))
    assert results[1].success and results[3].success
    assert not results[2].success and "CRC32C" in results[2].error
    assert same(stored, reader.host_pool, [0, 1, 2, 3, 8, 9, 10, 11])
    assert reader.counters().corrupt_values == 1
    assert client.exists(name) == 0  # deleted: the next lookup is a miss
    reader.close()
    proxy.close()


def test_a_batch_whose_connection_dies_and_the_one_queued_behind_it_run_again_on_a_fresh_one(
    redis_server,  # noqa: F811
    stored,
):
    jobs = {1: [0, 1, 2, 3], 2: [4, 5, 6, 7]}
    proxy, reader = queued_loads(redis_server, stored, jobs)
    proxy.cut()  # the batch on the wire loses its connection; the one queued was never sent
    proxy.gate.set()
    results = finish(reader, list(jobs))
    assert all(results[j].success for j in jobs), results
    assert same(stored, reader.host_pool, list(range(8)))
    assert reader.counters().outages == 0  # nothing counted against the breaker
    reader.close()
    proxy.close()


def test_a_batch_that_times_out_on_its_lane_fails_its_job_and_opens_the_breaker(redis_server, stored):  # noqa: F811
    proxy = GateProxy(redis_server.port)
    reader = worker_on(proxy.url, make_pool(WIDTH, 12, seed=2), timeout=0.5)  # the fault: replies held back
    reader.submit(99, RemoteLoadStoreSpec([k(0)]), CPULoadStoreSpec([0]))  # connects the lane
    assert finish(reader, [99])[99].success
    proxy.gate.clear()
    reader.submit(1, RemoteLoadStoreSpec([k(i) for i in range(4)]), CPULoadStoreSpec(list(range(4))))
    result = finish(reader, [1])[1]
    assert not result.success and "TimeoutError" in result.error
    assert reader.counters().outages == 1  # its failure alone opened the breaker
    reader.submit(2, RemoteLoadStoreSpec([k(i) for i in range(4, 8)]), CPULoadStoreSpec(list(range(4, 8))))
    assert not finish(reader, [2])[2].success  # at once with the circuit open (or timed out probing)
    counters = reader.counters()
    assert counters.loads_failed == 2 and counters.blocks_read == 1
    proxy.gate.set()
    reader.close()
    proxy.close()


def test_a_connection_the_server_closed_while_idle_is_replaced_without_a_failed_job(redis_server):  # noqa: F811
    pool = make_pool(WIDTH, 4, seed=5)
    writer = worker_on(redis_server.url, pool)
    writer.submit(1, CPULoadStoreSpec([0, 1]), RemoteLoadStoreSpec([k(0), k(1)]))
    assert finish(writer, [1])[1].success
    redis_server.stop()  # the lane's kept connection is closed by the server
    redis_server.start()
    writer.submit(2, CPULoadStoreSpec([2, 3]), RemoteLoadStoreSpec([k(2), k(3)]))
    result = finish(writer, [2])[2]
    assert result.success, result.error
    assert redis_server.client().exists(NAMES.name(k(2)), NAMES.name(k(3))) == 2
    assert writer.counters().stores_dropped == 0 and writer.counters().outages == 0
    writer.close()


def test_many_jobs_of_both_directions_on_one_connection_land_byte_exact(redis_server):  # noqa: F811
    source, target = make_pool(3001, 64, seed=3), make_pool(3001, 64, seed=4)
    writer, reader = worker_on(redis_server.url, source), worker_on(redis_server.url, target)
    for j in range(16):  # 16 store jobs at once: 4 blocks each
        writer.submit(
            j,
            CPULoadStoreSpec(list(range(4 * j, 4 * j + 4))),
            RemoteLoadStoreSpec([k(i) for i in range(4 * j, 4 * j + 4)]),
        )
    assert all(r.success for r in finish(writer, list(range(16))).values())
    for j in range(32):  # 32 load jobs at once, each block twice, and more stores beside them
        blocks = [(4 * j + i) % 64 for i in range(4)]
        reader.submit(j, RemoteLoadStoreSpec([k(b) for b in blocks]), CPULoadStoreSpec(blocks))
        writer.submit(
            100 + j, CPULoadStoreSpec(blocks), RemoteLoadStoreSpec([k(1000 + 4 * j + i) for i in range(4)])
        )
    assert all(r.success for r in finish(reader, list(range(32))).values())
    assert all(r.success for r in finish(writer, [100 + j for j in range(32)]).values())
    assert same(source, target, list(range(64)))
    assert redis_server.client().dbsize() == 64 + 128
    writer.close()
    reader.close()


def test_a_client_dropped_after_another_path_failed_leaves_the_lanes_connection_open(redis_server):  # noqa: F811
    """One path's failure makes the calls drop their client (the next call makes a new one);
    collecting it must not close the connection a lane holds: its C code writes to that
    descriptor, which, closed, fails the next job (or, reused, reaches another socket)."""
    pool = make_pool(WIDTH, 4, seed=6)
    calls = NodeCalls(
        lambda: connect(ServerSettings(redis_server.url, connect_timeout=2.0, timeout=HANG_GUARD)), "t"
    )
    writer = RedisWorker(pool, calls, NAMES, io_threads=1)
    writer.submit(1, CPULoadStoreSpec([0, 1]), RemoteLoadStoreSpec([k(0), k(1)]))  # connects the lane
    assert finish(writer, [1])[1].success
    calls.failed(ConnectionError("another path's connection failed"))
    calls.breaker("server").success()  # the server answers again (a probe elsewhere went through)
    gc.collect()  # the dropped client is collected
    writer.submit(2, CPULoadStoreSpec([2, 3]), RemoteLoadStoreSpec([k(2), k(3)]))
    result = finish(writer, [2])[2]
    assert result.success, result.error
    assert redis_server.client().exists(NAMES.name(k(2)), NAMES.name(k(3))) == 2
    writer.close()
