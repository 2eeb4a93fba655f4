"""The shared tier against a real redis-server on loopback: byte-exact stores and loads,
the lookup protocol (RETRY, then HIT or MISS), two replicas sharing blocks, server-side
eviction, corrupt values, and a server killed and restarted. No mocks."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvoffload.cpu import CPUOffloadingManager
from kvoffload.manager import LookupResult
from kvoffload.specs import CPULoadStoreSpec, RemoteLoadStoreSpec
from kvoffload.tiers.redis.format import KeyNames, redis_namespace, value_bytes
from kvoffload.tiers.secondary import TierContext, parse_secondary_tiers
from kvoffload.tiers.tiered import TieredOffloadingManager
from redis_replica import IDENTITY, Replica, k, until
from redis_server import RedisServer, redis_server  # noqa: F401 - fixture
from transfer_oracle import host_block, make_pool
from worker_jobs import run_job

HIT, MISS, RETRY, PENDING = LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY, LookupResult.PENDING


@pytest.fixture
def replicas(redis_server):  # noqa: F811
    made = []

    def make(**options):
        made.append(Replica(redis_server.url, seed=len(made), **options))
        return made[-1]

    yield make
    for replica in made:
        replica.close()


def test_blocks_round_trip_byte_exact_and_a_second_replica_finds_them(replicas, redis_server):  # noqa: F811
    a, b = replicas(), replicas()
    keys = [k(i) for i in range(6)]
    assert a.store(keys, list(range(6))).success
    events = a.manager.take_events()
    assert [(e.removed, len(e.keys)) for e in events] == [(False, 6)]
    assert all(a.manager.lookup(key) is HIT for key in keys)  # its own stores: no probe

    assert b.manager.lookup(keys[0]) is RETRY  # unknown: asked in the background
    assert [b.settle(key) for key in keys] == [HIT] * 6
    assert b.settle(k(99)) is MISS
    spec = b.manager.prepare_load(keys)
    result = b.run(spec, CPULoadStoreSpec(range(10, 16)))
    b.manager.complete_load(keys)
    assert result.success and result.bytes == 6 * b.block_bytes
    for i in range(6):
        assert host_block(b.pool, 10 + i) == host_block(a.pool, i)
    assert b.manager.take_events() == []  # b did not store them: it does not announce them
    assert b.manager.counters().found == 6

    # SET NX: b storing the same blocks leaves a's values as they are
    b.manager.reset()
    out = b.manager.prepare_store(keys[:2])
    assert b.run(CPULoadStoreSpec([0, 1]), out.store_spec).success
    assert b.worker.counters().already_present == 2
    written_by_a = host_block(a.pool, 0)
    assert redis_server.client().get(b.names.name(keys[0]))[-len(written_by_a) :] == written_by_a


def test_a_corrupt_value_is_a_failed_load_deleted_and_never_loadable(replicas, redis_server):  # noqa: F811
    """The worker receives a value straight into its host rows and checks it there: a bad
    one leaves garbage in rows that are being written, so the promotion fails and the CPU
    tier never offers the block (the engine never gets it); the value is deleted and counted.
    The three keys are promoted in one job, which fails as a whole."""
    a, b = replicas(), replicas()
    keys = [k(i) for i in range(3)]
    assert a.store(keys, [0, 1, 2]).success
    client = redis_server.client()
    value = bytearray(client.get(a.names.name(keys[1])))
    value[-5] ^= 0x40
    client.set(a.names.name(keys[1]), bytes(value))
    cpu = CPUOffloadingManager(8, enable_events=True)
    tiered = TieredOffloadingManager(cpu, [b.manager])
    assert [tiered.lookup(key) for key in keys] == [RETRY] * 3
    assert [until(lambda key=key: (r := tiered.lookup(key)) is not RETRY and r) for key in keys] == [
        PENDING
    ] * 3
    transfers = tiered.take_transfers()
    results = [b.run(t.src_spec, t.dst_spec) for t in transfers]
    for transfer, result in zip(transfers, results):
        tiered.complete_transfer(transfer.token, result.success)
    failed = [r for r in results if not r.success]
    assert len(failed) == 1 and "CRC32C" in failed[0].error
    assert all(cpu.lookup(key) is not HIT for key in keys)  # the failed promotion's blocks: none loadable
    assert tiered.lookup(keys[1]) is MISS  # dropped from the shared tier's index too
    assert client.exists(a.names.name(keys[1])) == 0  # deleted on the server
    assert b.worker.counters().corrupt_values == 1


def test_server_eviction_is_announced_removed_and_never_a_wrong_load(tmp_path):
    server = RedisServer(tmp_path, maxmemory="3mb").start()
    try:
        a = Replica(server.url)
        a.wait_listening()
        block = a.block_bytes
        n = (6 * 2**20) // block  # twice what the server may hold
        ids = list(range(16))
        for start in range(0, n, 16):
            keys = [k(i) for i in range(start, min(n, start + 16))]
            assert a.store(keys, ids[: len(keys)]).success
        events = a.manager.take_events()
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:  # notifications arrive one by one
            events += a.manager.take_events()
            time.sleep(0.05)
        stored = {key for e in events if not e.removed for key in e.keys}
        gone = {key for e in events if e.removed for key in e.keys}
        assert len(stored) == n
        client = server.client()
        on_server = {key for key in stored if client.exists(a.names.name(key))}
        assert gone and gone <= stored and not gone & on_server
        assert len(on_server) < n
        # whatever the index still claims loads byte-exact or fails: never wrong bytes. A
        # notification applied by a later lookup may drop a key claimed before it (then
        # prepare_load refuses, pinning nothing): claim again.
        for _ in range(10):
            claimed = [k(i) for i in range(n) if a.manager.lookup(k(i)) is HIT][:16]
            try:
                spec = a.manager.prepare_load(claimed)
                break
            except KeyError:
                time.sleep(0.1)
        result = a.run(spec, CPULoadStoreSpec(range(len(claimed))))
        a.manager.complete_load(claimed)
        assert result.success or "no longer on the server" in result.error
        a.close()
    finally:
        server.stop()


def test_budget_evictions_delete_what_this_engine_wrote(replicas, redis_server):  # noqa: F811
    probe = replicas()
    per_block = probe.block_bytes + 80
    a = replicas(bytes_to_use=4 * per_block)
    assert a.manager.stats().capacity == 4
    for i in range(0, 8, 2):
        assert a.store([k(i), k(i + 1)], [0, 1]).success
    client = redis_server.client()
    until(lambda: sum(client.exists(a.names.name(k(i))) for i in range(8)) == 4)
    assert a.manager.counters().deleted == 4


def test_server_down_answers_misses_fast_and_the_tier_recovers(replicas, redis_server):  # noqa: F811
    a = replicas()
    assert a.store([k(1)], [0]).success
    # Subscribed before the kill: the listener sees the connection drop and, once the
    # server is back, resubscribes and asks for a resync, which probes through the lookups'
    # breaker. Without it (a listener not yet scheduled under load) the breaker waited for
    # the next reconciliation (reconcile_interval_s, 30 s: the whole `until` budget below).
    a.wait_listening()
    redis_server.kill()
    # stores fail as results, never as exceptions
    out = a.manager.prepare_store([k(2)])
    result = a.run(CPULoadStoreSpec([1]), out.store_spec)
    a.manager.complete_store(out.keys_to_store, result.success)
    assert not result.success
    # unknown keys: RETRY until the probe fails, then MISS at once while the server is down
    assert a.settle(k(3)) is MISS
    started = time.perf_counter()
    answers = [a.manager.lookup(k(100 + i)) for i in range(1000)]
    per_lookup = (time.perf_counter() - started) / 1000
    assert set(answers) == {MISS}
    assert per_lookup < 1e-3  # no network on the scheduler thread (a loose bound, not a benchmark)
    redis_server.start()

    # the worker's breaker lets a call through after its backoff: stores succeed again
    def stored_again():
        out = a.manager.prepare_store([k(4)])
        if out is None or not out.keys_to_store:
            return False
        result = a.run(CPULoadStoreSpec([2]), out.store_spec)
        a.manager.complete_store(out.keys_to_store, result.success)
        return result.success

    until(stored_again, timeout=30)
    # and the lookups' breaker too: a key another writer stored is found again
    assert Replica(redis_server.url).store([k(5)], [3]).success
    assert until(lambda: a.manager.lookup(k(5)) is HIT, timeout=30)
    assert a.worker.counters().outages >= 1


def test_unreachable_at_start_is_a_logged_degraded_start(tmp_path, caplog):
    port = RedisServer(tmp_path).port  # free, nothing listens
    started = time.perf_counter()
    a = Replica(f"redis://127.0.0.1:{port}/0")
    assert time.perf_counter() - started < 5
    assert "unreachable at start-up" in caplog.text
    assert a.settle(k(1)) is MISS
    a.close()


def test_rejected_credentials_fail_the_start(tmp_path):
    server = RedisServer(tmp_path).start(extra=("--requirepass", "right"))
    try:
        with pytest.raises(ValueError, match="rejected the credentials") as info:
            Replica(f"redis://:wrong@127.0.0.1:{server.port}/0")
        assert "wrong" not in str(info.value)
        ok = Replica(f"redis://:right@127.0.0.1:{server.port}/0")
        assert ok.store([k(1)], [0]).success
        ok.close()
    finally:
        server.stop()


def test_tiered_promotion_from_the_shared_tier(replicas):
    a, b = replicas(), replicas()
    keys = [k(i) for i in range(4)]
    assert a.store(keys, [0, 1, 2, 3]).success
    tiered = TieredOffloadingManager(CPUOffloadingManager(8, enable_events=True), [b.manager])
    assert tiered.lookup(keys[0]) is RETRY
    assert until(lambda: (r := tiered.lookup(keys[0])) is not RETRY and r) is PENDING
    (transfer,) = tiered.take_transfers()
    assert isinstance(transfer.src_spec, RemoteLoadStoreSpec)
    result = b.run(transfer.src_spec, transfer.dst_spec)
    tiered.complete_transfer(transfer.token, result.success)
    assert result.success and tiered.lookup(keys[0]) is HIT
    host_id = int(tiered.prepare_load([keys[0]]).block_ids[0])
    assert host_block(b.pool, host_id) == host_block(a.pool, 0)
    assert np.array_equal(
        np.frombuffer(host_block(b.pool, host_id), np.uint8), np.frombuffer(host_block(a.pool, 0), np.uint8)
    )


def test_removals_are_found_by_reconciliation_when_the_server_sends_no_notifications(tmp_path):
    server = RedisServer(tmp_path, notifications=False).start()
    try:
        a = Replica(server.url, reconcile_interval_s=0.2)
        keys = [k(i) for i in range(4)]
        assert a.store(keys, [0, 1, 2, 3]).success
        assert [(e.removed, len(e.keys)) for e in a.manager.take_events()] == [(False, 4)]
        server.client().delete(a.names.name(keys[1]), a.names.name(keys[3]))
        removed = until(lambda: [key for e in a.manager.take_events() if e.removed for key in e.keys])
        assert sorted(removed) == sorted([keys[1], keys[3]])
        assert [a.manager.lookup(key) for key in keys] == [HIT, RETRY, HIT, RETRY]  # asked again
        assert a.manager.counters().gone == 2 and a.manager.counters().reconciliations >= 1
        a.close()
    finally:
        server.stop()


def test_the_namespace_key_prefixes_every_key_name(replicas, redis_server):  # noqa: F811
    a = replicas(namespace="team-a")
    assert a.tier.prefix == "team-a"
    a.names = KeyNames("team-a", redis_namespace({**IDENTITY, "rank": 0}))
    assert a.store([k(1)], [0]).success
    names = redis_server.client().keys("*")
    assert names == [a.names.name(k(1))] and names[0].startswith(b"team-a:kvr-")


def test_a_unix_socket_url(tmp_path):
    socket_path = tmp_path / "redis.sock"
    server = RedisServer(tmp_path).start(extra=("--unixsocket", str(socket_path), "--unixsocketperm", "700"))
    try:
        a = Replica(f"unix://{socket_path}?db=0")
        b = Replica(f"unix://{socket_path}?db=0", seed=1)
        assert a.store([k(1)], [0]).success
        assert b.settle(k(1)) is HIT
        assert b.run(b.manager.prepare_load([k(1)]), CPULoadStoreSpec([5])).success
        assert host_block(b.pool, 5) == host_block(a.pool, 0)
        for calls in (a.worker.calls, b.worker.calls):  # the worker's own RESP path, on a unix socket
            assert calls.streamed_batches and calls.command_batches == 0
        a.close()
        b.close()
    finally:
        server.stop()


def test_a_tls_url(tmp_path):
    """``rediss://`` to a TLS-only server (a CA and a server certificate made here with
    ``openssl``); the CA is given in the URL's query, as redis-py reads it."""
    import shutil
    import subprocess

    from free_ports import free_port
    from redis_server import require_redis_server

    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl is not installed: no certificates for a TLS server")
    run = lambda *args: subprocess.run([openssl, *args], cwd=tmp_path, check=True, capture_output=True)  # noqa: E731
    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "1",
        "-subj", "/CN=kvoffload-test-ca")  # fmt: skip
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "srv.key", "-out", "srv.csr",
        "-subj", "/CN=127.0.0.1")  # fmt: skip
    (tmp_path / "ext").write_text("subjectAltName=IP:127.0.0.1\n")
    run("x509", "-req", "-in", "srv.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "srv.crt", "-days", "1", "-extfile", "ext")  # fmt: skip
    port = free_port()
    proc = subprocess.Popen(
        [require_redis_server(), "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--dir", str(tmp_path), "--tls-cert-file", "srv.crt", "--tls-key-file", "srv.key",
         "--tls-ca-cert-file", "ca.crt", "--tls-auth-clients", "no"],
        cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        import redis

        url = f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={tmp_path / 'ca.crt'}"

        def answers() -> bool:
            try:
                return redis.Redis.from_url(url, socket_timeout=1).ping()
            except redis.ConnectionError:
                return False

        until(answers)
        a = Replica(url)
        assert a.store([k(1)], [0]).success
        b = Replica(url, seed=1)
        assert b.settle(k(1)) is HIT
        assert b.run(b.manager.prepare_load([k(1)]), CPULoadStoreSpec([5])).success
        assert host_block(b.pool, 5) == host_block(a.pool, 0)
        for calls in (a.worker.calls, b.worker.calls):  # the worker's own RESP path, over TLS
            assert calls.streamed_batches and calls.command_batches == 0
        # the same server without TLS is unreachable: a degraded start, misses, no hang
        plain = Replica(f"redis://127.0.0.1:{port}/0")
        assert plain.settle(k(1)) is MISS
        for replica in (a, b, plain):
            replica.close()
    finally:
        proc.terminate()
        proc.wait(10)


def test_tensor_parallel_ranks_store_their_shares_and_a_block_counts_only_when_all_are_there(redis_server):  # noqa: F811
    """Two ranks (world size 2): each worker stores its share under its own name; a new
    engine's manager finds a block only while both shares exist; ``bytes_to_use`` counts
    both; an eviction deletes both."""
    (tier,) = parse_secondary_tiers([{"type": "redis", "url": redis_server.url, "timeout_s": 1.0}])
    pools = [make_pool(seed=rank) for rank in range(2)]
    block_bytes = sum(int(t.shape[1]) for t in pools[0].tensors)
    contexts = [TierContext(block_bytes, IDENTITY, rank, 2) for rank in range(2)]
    manager = tier.build_manager(contexts[0], "lru")
    workers = [tier.build_worker(context, pool) for context, pool in zip(contexts, pools)]
    try:
        keys = [k(i) for i in range(4)]
        out = manager.prepare_store(keys)
        for job, worker in enumerate(workers):
            assert run_job(worker, job, CPULoadStoreSpec(range(4)), out.store_spec, 10.0).success
        manager.complete_store(out.keys_to_store)
        client = redis_server.client()
        names = [KeyNames("kvoffload", redis_namespace({**IDENTITY, "rank": rank})) for rank in range(2)]
        assert sorted(client.keys("*")) == sorted(n.name(key) for n in names for key in keys)
        # rank 1's share of block 2 is lost
        assert client.delete(names[1].name(keys[2])) == 1
        fresh = tier.build_manager(contexts[0], "lru")
        try:
            assert [until(lambda key=key: (r := fresh.lookup(key)) is not RETRY and r) for key in keys] == [
                HIT, HIT, MISS, HIT,
            ]  # fmt: skip
        finally:
            fresh.close()
    finally:
        for worker in workers:
            worker.close()
        manager.close()
    (budgeted,) = parse_secondary_tiers(
        [{"type": "redis", "url": redis_server.url, "bytes_to_use": 3 * value_bytes(block_bytes)}]
    )
    one, two = (budgeted.build_manager(TierContext(block_bytes, IDENTITY, 0, n), "lru") for n in (1, 2))
    try:
        assert (one.stats().capacity, two.stats().capacity) == (3, 1)  # every rank's share counted
        client = redis_server.client()
        client.flushall()
        out = two.prepare_store([k(10)])
        client.mset({n.name(k(10)): b"x" for n in names})  # as the two workers would
        two.complete_store(out.keys_to_store)
        two.complete_store(two.prepare_store([k(11)]).keys_to_store)  # evicts k(10): both shares go
        until(lambda: client.exists(*[n.name(k(10)) for n in names]) == 0)
    finally:
        one.close()
        two.close()


@pytest.mark.parametrize("command", ["DEL", "UNLINK"])
def test_a_block_deleted_on_the_server_is_announced_removed_within_seconds(replicas, redis_server, command):  # noqa: F811
    """Keyspace notifications on (the test server's): another replica or an operator
    deleting a block is heard at once, long before the next reconciliation (30 s)."""
    a = replicas()
    a.wait_listening()
    keys = [k(1), k(2)]
    assert a.store(keys, [0, 1]).success
    a.manager.take_events()
    redis_server.client().execute_command(command, a.names.name(k(1)))
    removed = []
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not removed:
        removed = [key for e in a.manager.take_events() if e.removed for key in e.keys]
        time.sleep(0.02)
    assert removed == [k(1)]
    assert a.manager.lookup(k(1)) is not HIT and a.manager.lookup(k(2)) is HIT


def test_without_notifications_the_lookups_notice_the_server_back_without_traffic(
    replicas,
    redis_server,  # noqa: F811
):
    """No keyspace notifications (a Cluster, or a server without them) and no
    reconciliation due: while the server is down the manager asks nothing, so only the
    lookups' own heartbeat can tell that it answers again."""
    redis_server.client().config_set("notify-keyspace-events", "")
    a = replicas(reconcile_interval_s=3600.0)
    assert a.settle(k(1)) is MISS  # connected, nothing stored
    redis_server.kill()
    assert a.settle(k(2)) is MISS  # its probe failed: the lookups' breaker is open
    assert a.manager._remote.down
    redis_server.start()
    assert Replica(redis_server.url).store([k(3)], [0]).success
    assert until(lambda: a.settle(k(3)) is HIT, timeout=30)
