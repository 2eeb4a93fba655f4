"""The object tier when things go wrong, against a real SeaweedFS: the server SIGKILLed
mid-run and restarted (misses and failed stores meanwhile, nothing raises or hangs, its
objects served again after), a frozen server (bounded by the timeouts), corrupt objects
(counted misses, deleted, never loadable), a full store and a read-only identity
(declined stores), and start-up errors: wrong credentials or bucket (named, never the
secret), unset variables, an endpoint down (a degraded start that serves once it answers)."""

from __future__ import annotations

import logging
import time

import obstore
import pytest

from kvoffload.cpu import CPUOffloadingManager
from kvoffload.manager import LookupResult
from kvoffload.specs import CPULoadStoreSpec
from kvoffload.tiers.redis.format import HEADER_BYTES, encode
from kvoffload.tiers.secondary import TierContext, parse_secondary_tiers
from kvoffload.tiers.tiered import TieredOffloadingManager
from redis_replica import IDENTITY, k, until
from s3_replica import Replica, big_pool
from s3_server import S3Server
from transfer_oracle import host_block, make_pool
from worker_jobs import run_job

HIT, MISS, RETRY, PENDING = LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY, LookupResult.PENDING


def test_the_server_killed_mid_run_costs_misses_and_its_objects_are_served_after_a_restart(
    s3_replicas, s3_server
):
    a, b = s3_replicas(), s3_replicas()
    keys = [k(i) for i in range(4)]
    assert a.store(keys, [0, 1, 2, 3]).success
    a.manager.take_events()
    s3_server.kill()

    started = time.monotonic()
    assert b.manager.lookup(k(0)) is RETRY
    assert b.settle(k(0)) is MISS  # the probe failed: a miss, no exception
    assert b.manager.counters().probe_failures >= 1
    failed = [a.store([k(10 + i)], [i]) for i in range(3)]
    assert all(not r.success and "endpoint is down" in r.error for r in failed), failed
    assert a.worker.counters().outages == 1 and a.worker.counters().stores_dropped == 3
    load = a.load(keys[:1], [9])
    assert not load.success
    assert until(lambda: a.manager.lookup(k(21)) is MISS)  # breaker open: MISS at once, no probe
    assert all(a.manager.lookup(key) is MISS for key in keys)  # indexed blocks too, while down
    assert time.monotonic() - started < 20  # refused connections fail at once: nothing waited out a timeout
    assert a.manager.take_events() == []  # nothing announced removed: objects persist

    s3_server.start()  # same ports and data folder
    # the tier notices by itself; the objects are still there, the index still holds them
    assert until(lambda: all(a.manager.lookup(key) is HIT for key in keys), 30)
    assert until(lambda: a.load(keys, [12, 13, 14, 15]).success, 30)
    assert [host_block(a.pool, 12 + i) for i in range(4)] == [host_block(a.pool, i) for i in range(4)]
    assert until(lambda: b.settle(k(2)) is HIT, 30)  # the other replica finds them again
    assert b.load([k(2)], [7]).success and host_block(b.pool, 7) == host_block(a.pool, 2)
    assert until(lambda: a.store([k(30)], [0]).success, 30)  # stores serve again
    assert a.manager.counters().gone == 0 and a.worker.counters().outages == 1


def test_a_frozen_server_costs_at_most_the_timeout_and_a_timed_out_store_is_not_announced(
    s3_replicas, s3_server
):
    """A PUT that times out while the server is frozen is unknown, not absent: the job
    fails (never announced), and SeaweedFS may apply it when it resumes; whatever is then
    in the bucket is either the whole block or nothing."""
    a = s3_replicas(timeout_s=1.0)
    assert a.store([k(0)], [0]).success
    a.manager.take_events()
    s3_server.freeze()
    try:
        started = time.monotonic()
        result = a.store([k(1), k(2)], [1, 2])
        assert not result.success and "endpoint is down" in result.error
        assert a.settle(k(5)) is MISS
        assert time.monotonic() - started < 10
        assert a.manager.take_events() == []
    finally:
        s3_server.thaw()
    assert until(lambda: a.load([k(0)], [8]).success, 30)
    assert host_block(a.pool, 8) == host_block(a.pool, 0)
    b = s3_replicas()
    for i in (1, 2):  # applied late or not at all; if present, it is a's block whole
        if b.settle(k(i)) is HIT:
            assert b.load([k(i)], [4]).success and host_block(b.pool, 4) == host_block(a.pool, i)


DAMAGES = (
    "flipped payload byte",
    "flipped key byte",
    "other namespace",
    "longer",
    "shorter",
    "empty",
    "huge",
)


def test_a_corrupt_object_is_a_counted_miss_deleted_and_never_loadable(s3_replicas, s3_server):
    """Wrong bytes under a block's name (written with a raw client) fail the promotion; the
    CPU tier never offers the block, the object is deleted and counted."""
    a = s3_replicas()
    raw = s3_server.client()
    for n, damage in enumerate(DAMAGES, 1):
        key = k(100 + n)
        digest = a.names.digest if damage != "other namespace" else b"\x01" * 16
        value = bytearray(encode(key, [host_block(a.pool, n)], digest))
        if damage == "flipped payload byte":
            value[-5] ^= 0x40
        elif damage == "flipped key byte":
            value[HEADER_BYTES + 3] ^= 0x01
        elif damage == "longer":
            value += b"\0" * 64
        elif damage == "shorter":
            value = value[:-64]
        elif damage == "empty":
            value = bytearray()
        elif damage == "huge":  # read no further than one byte past a block's object
            value += bytes(64 << 20)
        obstore.put(raw, a.name(key), bytes(value))
        cpu = CPUOffloadingManager(8, enable_events=True)
        tiered = TieredOffloadingManager(cpu, [a.manager])
        assert tiered.lookup(key) is RETRY
        assert until(lambda key=key, tiered=tiered: (r := tiered.lookup(key)) is not RETRY and r) is PENDING
        (transfer,) = tiered.take_transfers()
        result = a.run(transfer.src_spec, transfer.dst_spec)
        tiered.complete_transfer(transfer.token, result.success)
        assert not result.success and "corrupt" in result.error, (damage, result)
        assert cpu.lookup(key) is not HIT and tiered.lookup(key) is MISS, damage
        assert a.worker.counters().corrupt_values == n, damage
        assert a.name(key) not in s3_server.names("kvoffload"), damage  # deleted
    assert a.worker.counters().bytes_read == 0


def test_a_full_store_declines_stores_counted_and_nothing_unwritten_is_loadable(tmp_path):
    server = S3Server(tmp_path, volume_mb=4, max_volumes=2).start()  # about 8 MiB of objects
    a = b = None
    try:
        a = Replica(server, pool=big_pool(32, 256 << 10, seed=0))
        b = Replica(server, pool=big_pool(32, 256 << 10, seed=1))
        ids = list(range(32))
        results, stored = [], []
        for job in range(6):  # 6 x 32 blocks of 256 KiB: 48 MiB into about 8 MiB
            keys = [k(job * 32 + i) for i in ids]
            results.append(a.store(keys, ids))
            if results[-1].success:
                stored += keys
        failed = [r for r in results if not r.success]
        assert failed and all("rejected the put" in r.error for r in failed), results
        assert a.worker.counters().puts_rejected > 0 and a.worker.counters().outages == 0
        announced = {key for e in a.manager.take_events() if not e.removed for key in e.keys}
        assert announced == set(stored)  # a failed job's blocks are never announced
        loaded = 0
        for i in range(0, 6 * 32, 5):  # whatever another replica finds loads byte-exact
            if b.settle(k(i)) is not HIT:
                continue
            result = b.load([k(i)], [0])
            assert result.success and host_block(b.pool, 0) == host_block(a.pool, i % 32)
            loaded += 1
        assert loaded > 0
    finally:
        for replica in (a, b):
            if replica is not None:
                replica.close()
        server.stop()  # SIGKILL after STOP_S: a full SeaweedFS may hang on SIGTERM


def test_a_read_only_identity_loads_but_its_stores_are_declined(s3_replicas, s3_server):
    writer = s3_replicas()
    reader = s3_replicas(identity="reader")
    assert writer.store([k(0)], [0]).success
    result = reader.store([k(1)], [1])
    assert not result.success and "refused the put" in result.error and "AccessDenied" in result.error
    assert reader.worker.counters().puts_denied == 1 and reader.worker.counters().outages == 0
    assert reader.manager.take_events() == []
    assert reader.settle(k(0)) is HIT and reader.load([k(0)], [5]).success
    assert host_block(reader.pool, 5) == host_block(writer.pool, 0)
    assert reader.settle(k(7)) is MISS  # a list-permitted identity gets 404 for a missing object


def _build(config: dict):
    (tier,) = parse_secondary_tiers([config])
    pool = make_pool()
    context = TierContext(sum(int(t.shape[1]) for t in pool.tensors), IDENTITY)
    return tier, pool, context


def test_wrong_credentials_fail_start_up_naming_the_endpoint_never_the_secret(s3_server, monkeypatch):
    monkeypatch.setenv("KVOFFLOAD_TEST_WRONG_SECRET", "not-the-secret-0123456789")
    key_env, _ = s3_server.env_names()
    tier, _, context = _build(s3_server.tier_config(secret_key_env="KVOFFLOAD_TEST_WRONG_SECRET"))
    with pytest.raises(ValueError, match="refused the credentials") as caught:
        tier.build_manager(context, "lru")
    message = str(caught.value)
    assert (
        s3_server.endpoint in message
        and "kvoffload-test" in message
        and "KVOFFLOAD_TEST_WRONG_SECRET" in message
    )
    assert "SignatureDoesNotMatch" in message
    assert "not-the-secret" not in message and s3_server.secret() not in message

    monkeypatch.setenv("KVOFFLOAD_TEST_WRONG_KEY", "KVNOSUCHKEY")
    tier, _, context = _build(s3_server.tier_config(access_key_env="KVOFFLOAD_TEST_WRONG_KEY"))
    with pytest.raises(ValueError, match="refused the credentials") as caught:
        tier.build_manager(context, "lru")
    assert s3_server.secret() not in str(caught.value)


def test_an_unset_variable_or_a_missing_bucket_fails_start_up_naming_it(s3_server, monkeypatch):
    monkeypatch.delenv("KVOFFLOAD_TEST_UNSET", raising=False)
    tier, pool, context = _build(s3_server.tier_config(secret_key_env="KVOFFLOAD_TEST_UNSET"))
    with pytest.raises(ValueError, match="KVOFFLOAD_TEST_UNSET .* is not set"):
        tier.build_manager(context, "lru")
    with pytest.raises(ValueError, match="KVOFFLOAD_TEST_UNSET .* is not set"):
        tier.build_worker(context, pool)
    tier, _, context = _build(s3_server.tier_config(bucket="no-such-bucket"))
    with pytest.raises(ValueError, match="bucket 'no-such-bucket' does not exist at http://127.0.0.1"):
        tier.build_manager(context, "lru")


def test_an_endpoint_down_at_start_up_is_a_degraded_start_that_serves_once_it_answers(tmp_path, caplog):
    server = S3Server(tmp_path)  # ports chosen, nothing started
    server.start()
    server.kill()
    tier, pool, context = _build(server.tier_config(connect_timeout_s=0.2, retry_max_s=0.5))
    with caplog.at_level(logging.WARNING, logger="kvoffload.tiers.s3"):
        manager = tier.build_manager(context, "lru")
    worker = tier.build_worker(context, pool)
    try:
        assert "does not answer at start-up" in caplog.text and server.secret() not in caplog.text
        assert until(lambda: manager.lookup(k(0)) is MISS)
        out = manager.prepare_store([k(0)])
        result = run_job(worker, 1, CPULoadStoreSpec([0]), out.store_spec, 10)
        manager.complete_store(out.keys_to_store, result.success)
        assert not result.success and manager.take_events() == []
        server.start()

        def stored() -> bool:
            out = manager.prepare_store([k(0)])
            result = run_job(worker, 2, CPULoadStoreSpec([0]), out.store_spec, 30)
            manager.complete_store(out.keys_to_store, result.success)
            return result.success

        assert until(stored, 30)
        assert [e.removed for e in manager.take_events()] == [False]
    finally:
        worker.close()
        manager.close()
        server.stop()
