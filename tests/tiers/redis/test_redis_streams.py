"""The worker's own RESP path against a real redis-server (and valkey-server where present):
byte-exact round trips at several sizes over RESP2 and RESP3, values byte-identical to
``format.encode`` (readable by any reader of the format), SET NX and EX, error replies in
the middle of a batch, corrupt values, a proxy that splits everything into small pieces
through tiny buffers, and the server killed mid-batch."""

from __future__ import annotations

import contextlib
import random
import socket
import threading
import time

import pytest
import torch

from kvoffload.keys import make_offload_key
from kvoffload.specs import CPULoadStoreSpec, RemoteLoadStoreSpec
from kvoffload.tiers.redis.calls import NodeCalls
from kvoffload.tiers.redis.client import ServerSettings, connect
from kvoffload.tiers.redis.format import KeyNames, encode
from kvoffload.tiers.redis.worker import RedisWorker
from kvoffload.transfer import HostBlockPool, KVLayout
from redis_server import RedisServer, redis_server  # noqa: F401 - fixture
from worker_jobs import run_job

NAMES = KeyNames("kvoffload", "kvr-streams")


@pytest.fixture(params=["c", "python"])
def batches(request, monkeypatch):
    """Batches on a plain socket run by ``_pipelines`` (C, no GIL) or by the Python fallback
    (as without the C module: each value read into the stream's buffer, checked, copied)."""
    from kvoffload.tiers.redis import pipelines

    if request.param == "c" and pipelines._pipelines is None:
        pytest.skip("could not import kvoffload.tiers.redis._pipelines (not built: no C compiler at install)")
    if request.param == "python":
        monkeypatch.setattr(pipelines, "_pipelines", None)
    return request.param


def make_pool(widths, blocks: int = 8, seed: int = 0) -> HostBlockPool:
    caches = {f"l{i}": torch.zeros((blocks, w), dtype=torch.uint8) for i, w in enumerate(widths)}
    pool = HostBlockPool(KVLayout.from_layer_tensors(caches), blocks)
    gen = torch.Generator().manual_seed(seed)
    for t in pool.tensors:
        t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=gen))
    return pool


def rows_of(pool: HostBlockPool, host_id: int) -> list[bytes]:
    return [t[host_id].numpy().tobytes() for t in pool.tensors]


def k(i: int) -> bytes:
    return make_offload_key(i.to_bytes(32, "big"), 0)


class Worker:
    def __init__(self, url: str, pool: HostBlockPool, timeout: float = 2.0, ttl: int | None = None):
        settings = ServerSettings(url, connect_timeout=1.0, timeout=timeout)
        self.calls = NodeCalls(lambda: connect(settings), "test")
        self.worker = RedisWorker(pool, self.calls, NAMES, ttl=ttl)
        self.pool, self.job = pool, 0

    def run(self, src, dst, timeout: float = 30.0):
        self.job += 1
        return run_job(self.worker, self.job, src, dst, timeout)

    def store(self, keys, host_ids):
        return self.run(CPULoadStoreSpec(host_ids), RemoteLoadStoreSpec(keys))

    def load(self, keys, host_ids):
        return self.run(RemoteLoadStoreSpec(keys), CPULoadStoreSpec(host_ids))

    def close(self):
        self.worker.close()


@pytest.mark.parametrize("protocol", [2, 3])
@pytest.mark.parametrize("widths", [(1,), (4097, 3), (65536,), (262147, 1000), (2 * 1024 * 1024 + 5,)])
def test_round_trips_are_byte_exact_and_values_are_the_format(redis_server, widths, protocol, batches):  # noqa: F811
    url = f"{redis_server.url}?protocol={protocol}"
    a, b = Worker(url, make_pool(widths, seed=1)), Worker(url, make_pool(widths, seed=2))
    keys = [k(i) for i in range(5)]
    assert a.store(keys, [0, 1, 2, 3, 4]).success
    client = redis_server.client()
    for i, key in enumerate(keys):
        assert client.get(NAMES.name(key)) == encode(key, rows_of(a.pool, i), NAMES.digest)
    assert b.load(keys[::-1], [7, 6, 5, 4, 3]).success
    for i in range(5):
        assert rows_of(b.pool, 7 - i) == rows_of(a.pool, 4 - i)
    assert a.calls.streamed_batches and b.calls.streamed_batches  # the path under test ran
    assert a.calls.command_batches == b.calls.command_batches == 0
    counters = b.worker.counters()
    assert counters.blocks_read == 5 and counters.corrupt_values == counters.missing_values == 0
    a.close()
    b.close()


def test_set_nx_leaves_another_replicas_value_and_ex_sets_an_expiry(redis_server, batches):  # noqa: F811
    a = Worker(redis_server.url, make_pool((3000,), seed=1), ttl=600)
    b = Worker(redis_server.url, make_pool((3000,), seed=2))
    keys = [k(i) for i in range(4)]
    assert a.store(keys[:2], [0, 1]).success
    assert b.store(keys, [0, 1, 2, 3]).success
    assert b.worker.counters().already_present == 2 and b.worker.counters().blocks_written == 2
    client = redis_server.client()
    assert client.get(NAMES.name(keys[0])) == encode(keys[0], rows_of(a.pool, 0), NAMES.digest)
    assert client.get(NAMES.name(keys[2])) == encode(keys[2], rows_of(b.pool, 2), NAMES.digest)
    assert 0 < client.ttl(NAMES.name(keys[0])) <= 600 and client.ttl(NAMES.name(keys[2])) == -1
    a.close()
    b.close()


def test_error_replies_mid_batch_fail_the_job_but_not_the_connection(redis_server, batches):  # noqa: F811
    a = Worker(redis_server.url, make_pool((70000,)))
    keys = [k(i) for i in range(3)]
    client = redis_server.client()
    client.rpush(NAMES.name(keys[1]), b"not a string")  # a GET of it: WRONGTYPE
    assert not a.load(keys, [3, 4, 5]).success  # keys 0 and 2 are missing too
    assert a.store([keys[0], keys[2]], [0, 2]).success
    result = a.load(keys, [3, 4, 5])
    assert not result.success and "WRONGTYPE" in result.error
    assert a.load([keys[0], keys[2]], [3, 5]).success  # the stream stayed in step
    assert rows_of(a.pool, 3) == rows_of(a.pool, 0) and rows_of(a.pool, 5) == rows_of(a.pool, 2)
    assert not a.calls.down and a.calls.outages == 0  # the server answered: no outage
    a.close()


def test_out_of_memory_refusals_drop_the_store_and_keep_the_breaker_closed(tmp_path, batches):
    server = RedisServer(tmp_path).start(extra=("--maxmemory", "2mb", "--maxmemory-policy", "noeviction"))
    try:
        a = Worker(server.url, make_pool((256 * 1024,), blocks=16))
        result = a.store([k(i) for i in range(16)], list(range(16)))
        assert not result.success and "OOM" in result.error
        assert a.worker.counters().stores_dropped == 1 and a.calls.outages == 0
        assert a.load([k(0)], [15]).success  # what was written reads back
        assert rows_of(a.pool, 15) == rows_of(a.pool, 0)
        a.close()
    finally:
        server.stop()


def test_corrupt_values_in_a_batch_are_misses_deleted_and_counted(redis_server, batches):  # noqa: F811
    """Values of the expected length that fail a check (CRC, another key; in C received into
    the rows and checked there) and a value of another length (in C it ends the planned
    read) all fail the load (its rows are unspecified), are deleted and counted; the stream
    stays usable."""
    a = Worker(redis_server.url, make_pool((5000, 17)))
    keys = [k(i) for i in range(4)]
    assert a.store(keys, [0, 1, 2, 3]).success
    client = redis_server.client()
    name = NAMES.name
    flipped = bytearray(client.get(name(keys[1])))
    flipped[-100] ^= 0x10
    client.set(name(keys[1]), bytes(flipped))  # CRC
    client.set(name(keys[2]), client.get(name(keys[0])))  # another key's value
    value = client.get(name(keys[3]))
    client.set(name(keys[3]), value[:-1])  # another length
    result = a.load(keys, [4, 5, 6, 7])
    assert not result.success and "corrupt" in result.error
    assert a.worker.counters().corrupt_values == 3
    assert [client.exists(name(key)) for key in keys] == [1, 0, 0, 0]
    assert a.load(keys[:1], [4]).success and rows_of(a.pool, 4) == rows_of(a.pool, 0)
    a.close()


class ChunkyProxy:
    """TCP between the worker and a server, relayed in pieces of 1..``piece`` bytes through
    small socket buffers (the worker's sends are partial, its reads get odd pieces);
    ``hook(direction, total)`` (when set) is called as ``"request"`` and ``"reply"`` bytes
    pass. A client that arrives while the server is down is hung up on."""

    def __init__(self, port: int, piece: int = 1500) -> None:
        self.port_to, self.piece, self.hook = port, piece, None
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"redis://127.0.0.1:{self.listener.getsockname()[1]}/0"
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return  # closed
            try:
                server = socket.create_connection(("127.0.0.1", self.port_to))
            except OSError:
                client.close()
                continue
            for s in (client, server):  # small windows, and no waits for delayed ACKs
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16384)
            self.sockets += (client, server)
            threading.Thread(target=self._pump, args=(client, server, "request"), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, "reply"), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, direction: str) -> None:
        rng, total = random.Random(len(self.sockets)), 0
        try:
            while data := src.recv(rng.randint(1, self.piece)):
                dst.sendall(data)
                total += len(data)
                hook = self.hook
                if hook is not None:
                    hook(direction, total)
        except OSError:
            pass
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.listener.close()
        for s in self.sockets:
            s.close()


def test_small_pieces_through_tiny_buffers_change_nothing(redis_server, batches):  # noqa: F811
    proxy = ChunkyProxy(redis_server.port)
    widths = (300000, 77)
    a = Worker(proxy.url, make_pool(widths, seed=1))
    b = Worker(proxy.url, make_pool(widths, seed=2), timeout=10.0)  # far above the 5 s bound below
    keys = [k(i) for i in range(6)]
    assert a.store(keys[:5], [0, 1, 2, 3, 4]).success
    assert b.load(keys[:5], [3, 4, 5, 6, 7]).success
    assert [rows_of(b.pool, 3 + i) for i in range(5)] == [rows_of(a.pool, i) for i in range(5)]
    result = b.load([keys[0], keys[5], keys[1]], [0, 1, 2])  # one missing in the middle
    assert not result.success and "no longer on the server" in result.error
    assert b.load([keys[4]], [0]).success and rows_of(b.pool, 0) == rows_of(a.pool, 4)
    started = time.monotonic()  # the last reply is a null, shorter than a planned lead and
    result = b.load([keys[0], keys[5]], [0, 1])  # header: read as it is, not waited past
    assert not result.success and "no longer on the server" in result.error
    assert time.monotonic() - started < 5, "a short last reply was waited past (the timeout is 10 s)"
    assert b.load([keys[1]], [0]).success and rows_of(b.pool, 0) == rows_of(a.pool, 1)
    assert a.calls.streamed_batches and b.calls.streamed_batches
    a.close()
    b.close()
    proxy.close()


@pytest.mark.parametrize("direction", ["load", "store"])
def test_the_server_killed_mid_batch_fails_the_job_opens_the_breaker_and_recovers(
    tmp_path, direction, batches
):
    """The server is killed once 1 MiB of the batch (its replies for a load, its commands
    for a store) went through: the job fails, the breaker opens, and it closes again once
    the server is back."""
    server = RedisServer(tmp_path).start()
    killed = threading.Event()
    side = "reply" if direction == "load" else "request"

    def kill_mid_batch(passing: str, total: int) -> None:
        if passing == side and total > 1 << 20 and not killed.is_set():
            killed.set()
            server.kill()

    proxy = ChunkyProxy(server.port, piece=64 * 1024)
    a = Worker(proxy.url, make_pool((1 << 20,), blocks=16), timeout=5.0)
    if direction == "load":
        keys = [k(i) for i in range(16)]
        assert a.store(keys, list(range(16))).success
        proxy.hook = kill_mid_batch
        result = a.load(keys, list(range(16)))
    else:  # 64 MiB of commands: the kill comes after the first MiB
        proxy.hook = kill_mid_batch
        result = a.store([k(i) for i in range(100, 164)], list(range(16)) * 4)
    assert killed.is_set()
    assert not result.success, "a job cut short must fail"
    assert a.calls.down and a.calls.outages == 1
    counters = a.worker.counters()
    assert counters.loads_failed + counters.stores_dropped == 1
    proxy.hook = None
    server.start()

    def recovered() -> bool:
        return a.store([k(50)], [0]).success

    deadline = time.monotonic() + 15
    while not recovered():
        assert time.monotonic() < deadline, "the tier did not recover"
        time.sleep(0.1)
    assert not a.calls.down and a.load([k(50)], [1]).success and rows_of(a.pool, 1) == rows_of(a.pool, 0)
    a.close()
    proxy.close()
    server.stop()


def test_a_connection_without_a_plain_socket_falls_back_to_redis_py_commands(redis_server, monkeypatch):  # noqa: F811
    """Where a connection exposes no socket the RESP path can use, the same batches go
    through redis-py's commands: byte-exact, the same values, SET NX kept."""
    import types

    from kvoffload.tiers.redis import calls

    class NotASocket:  # nothing is an instance: every connection looks socket-less
        pass

    monkeypatch.setattr(calls, "socket", types.SimpleNamespace(socket=NotASocket))
    widths = (4097, 3)
    a, b = (
        Worker(redis_server.url, make_pool(widths, seed=1)),
        Worker(redis_server.url, make_pool(widths, seed=2)),
    )
    keys = [k(100 + i) for i in range(4)]
    assert a.store(keys, [0, 1, 2, 3]).success
    assert b.store(keys[:2], [0, 1]).success  # present already: left as they are
    assert b.worker.counters().already_present == 2
    client = redis_server.client()
    for i, key in enumerate(keys):
        assert client.get(NAMES.name(key)) == encode(key, rows_of(a.pool, i), NAMES.digest)
    assert b.load(keys[::-1], [7, 6, 5, 4]).success
    for i in range(4):
        assert rows_of(b.pool, 7 - i) == rows_of(a.pool, 3 - i)
    assert a.calls.command_batches and b.calls.command_batches
    assert a.calls.streamed_batches == b.calls.streamed_batches == 0
    a.close()
    b.close()
