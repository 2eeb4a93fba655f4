"""The Mooncake tier against a real mooncake_master and segment holder on loopback:
byte-exact stores and loads through the registered host pool, two clients sharing blocks,
corrupt objects, a full store, the master killed and restarted, use after close. No mocks."""

from __future__ import annotations

import pytest
import torch

from conftest import POOLS, Replica, big_pool, close_all
from kvoffload.cpu import CPUOffloadingManager
from kvoffload.manager import LookupResult
from kvoffload.specs import CPULoadStoreSpec, DeviceLoadStoreSpec
from kvoffload.tiers.factory import TierConfig, build_worker
from kvoffload.tiers.mooncake.names import MooncakeLoadStoreSpec
from kvoffload.tiers.mooncake.objects import SLOT_BYTES
from kvoffload.tiers.mooncake.store import StoreClosed
from kvoffload.tiers.redis.format import HEADER_BYTES, encode
from kvoffload.tiers.secondary import TierContext, parse_secondary_tiers
from kvoffload.tiers.tiered import TieredOffloadingManager
from kvoffload.transfer.layout import KVLayout
from mooncake_server import MooncakeServer
from redis_replica import IDENTITY, k, until
from transfer_oracle import host_block, make_pool, three_group_layer_caches
from worker_jobs import run_job

HIT, MISS, RETRY, PENDING = LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY, LookupResult.PENDING


LAYOUTS = pytest.mark.parametrize("layout", list(POOLS))


@LAYOUTS
def test_blocks_round_trip_byte_exact_and_a_second_client_finds_them(mooncake_replicas, layout):
    a, b = mooncake_replicas(layout), mooncake_replicas(layout)
    keys = [k(i) for i in range(6)]
    assert a.store(keys, list(range(6))).success
    events = a.manager.take_events()
    assert [(e.removed, e.medium, len(e.keys)) for e in events] == [(False, "MOONCAKE", 6)]
    assert all(a.manager.lookup(key) is HIT for key in keys)  # its own stores: no probe

    assert b.manager.lookup(keys[0]) is RETRY  # unknown: asked in the background
    assert [b.settle(key) for key in keys] == [HIT] * 6
    assert b.settle(k(99)) is MISS
    others = {i: host_block(b.pool, i) for i in range(b.pool.num_blocks) if not 10 <= i < 16}
    spec = b.manager.prepare_load(keys)
    result = b.run(spec, CPULoadStoreSpec(range(10, 16)))
    b.manager.complete_load(keys)
    assert result.success and result.bytes == 6 * b.block_bytes, result
    for i in range(6):
        assert host_block(b.pool, 10 + i) == host_block(a.pool, i)
    assert {i: host_block(b.pool, i) for i in others} == others  # no byte outside the loaded blocks
    assert b.manager.take_events() == []  # b did not store them: it does not announce them
    assert b.manager.counters().found == 6


def test_one_buffer_and_split_buffer_objects_are_the_same_bytes(mooncake_replicas):
    """An engine whose pool has a row prefix (one buffer per object) and one without
    (header slot and rows: a tensor-major pool) read each other's blocks byte-exact."""
    one, split = mooncake_replicas("one buffer"), mooncake_replicas("split buffers")
    assert one.worker.one_buffer and not split.worker.one_buffer
    for writer, reader, base in ((one, split, 0), (split, one, 10)):
        keys = [k(base + i) for i in range(3)]
        assert writer.store(keys, [4, 5, 6]).success
        assert [reader.settle(key) for key in keys] == [HIT] * 3
        spec = reader.manager.prepare_load(keys)
        assert reader.run(spec, CPULoadStoreSpec([7, 8, 9])).success
        reader.manager.complete_load(keys)
        assert [host_block(reader.pool, i) for i in (7, 8, 9)] == [
            host_block(writer.pool, i) for i in (4, 5, 6)
        ]


@LAYOUTS
def test_a_second_store_of_a_block_keeps_the_first_object(mooncake_replicas, mooncake_server, layout):
    """A put of a name the store holds answers success and keeps the old object (as SET NX)."""
    a, b = mooncake_replicas(layout), mooncake_replicas(layout)
    assert a.store([k(0)], [0]).success
    assert b.store([k(0)], [3]).success  # b's host block 3 differs from a's block 0
    assert b.worker.counters().blocks_written == 1
    b.manager.reset()
    assert b.settle(k(0)) is HIT
    spec = b.manager.prepare_load([k(0)])
    assert b.run(spec, CPULoadStoreSpec([5])).success
    assert host_block(b.pool, 5) == host_block(a.pool, 0) != host_block(b.pool, 3)


def _promote(replica, keys):
    """Promote ``keys`` from the replica's Mooncake tier into a fresh CPU tier, as the
    tiered manager does; the CPU tier and the job results."""
    cpu = CPUOffloadingManager(8, enable_events=True)
    tiered = TieredOffloadingManager(cpu, [replica.manager])
    assert [tiered.lookup(key) for key in keys] == [RETRY] * len(keys)
    assert [until(lambda key=key: (r := tiered.lookup(key)) is not RETRY and r) for key in keys] == [
        PENDING
    ] * len(keys)
    transfers = tiered.take_transfers()
    results = [replica.run(t.src_spec, t.dst_spec) for t in transfers]
    for transfer, result in zip(transfers, results):
        tiered.complete_transfer(transfer.token, result.success)
    return cpu, tiered, results


DAMAGES = ("flipped payload byte", "flipped key byte", "other namespace", "longer", "shorter")


@LAYOUTS
def test_a_corrupt_object_is_a_counted_miss_removed_and_never_loadable(
    mooncake_replicas, mooncake_server, layout
):
    """Wrong bytes under a block's name (written with a raw client) land in host rows that
    are being written; the load fails, the CPU tier never offers the block, the object is
    removed from the store and counted. One block per kind of damage, each promoted alone."""
    a = mooncake_replicas(layout)
    raw = mooncake_server.client()
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
        assert raw.put(a.name(key), bytes(value)) == 0
        cpu, tiered, results = _promote(a, [key])
        (result,) = results
        assert not result.success and "corrupt" in result.error, (damage, result)
        assert cpu.lookup(key) is not HIT and tiered.lookup(key) is MISS, damage
        assert a.worker.counters().corrupt_values == n, damage
        assert until(lambda key=key: raw.batch_is_exist([a.name(key)]) == [0]), damage  # removed


def test_use_after_close_is_refused_with_a_clear_error(mooncake_replicas):
    a = mooncake_replicas()
    store = a.worker.store
    a.worker.close()
    with pytest.raises(RuntimeError, match="after close"):
        a.worker.submit(99, CPULoadStoreSpec([0]), MooncakeLoadStoreSpec([k(0)]))
    with pytest.raises(StoreClosed, match="closed; batch_is_exist refused"):
        store.call("batch_is_exist", ["x"])
    with pytest.raises(StoreClosed):
        store.register(0, 1)
    a.manager.close()
    assert a.manager.lookup(k(5)) is MISS  # nothing left to ask: a miss, no call
    a.worker.close()  # idempotent
    a.manager.close()


def test_the_master_killed_mid_run_costs_misses_and_the_tier_recovers_after_a_restart(
    mooncake_replicas, mooncake_server
):
    a, b = mooncake_replicas(), mooncake_replicas()
    keys = [k(i) for i in range(4)]
    assert a.store(keys, [0, 1, 2, 3]).success
    a.manager.take_events()
    mooncake_server.kill()

    assert b.manager.lookup(k(0)) is RETRY
    assert b.settle(k(0)) is MISS  # the probe failed: a miss, no exception
    assert b.manager.counters().probe_failures >= 1
    failed = [a.store([k(10 + i)], [i]) for i in range(3)]  # the first pays Mooncake's retries
    assert all(not r.success and "master is down" in r.error for r in failed), failed
    assert a.worker.counters().outages == 1 and a.worker.counters().stores_dropped == 3
    load = a.run(a.manager.prepare_load(keys[:1]), CPULoadStoreSpec([9]))
    a.manager.complete_load(keys[:1])
    assert not load.success
    assert a.manager.lookup(k(20)) is RETRY and a.settle(k(20)) is MISS  # a's lookups see it down too
    assert until(lambda: a.manager.lookup(k(21)) is MISS)  # breaker open: MISS at once, no probe
    # indexed blocks too: a load from a master that is down would only fail, after seconds
    assert all(a.manager.lookup(key) is MISS for key in keys)

    mooncake_server.start()  # same port; the master starts empty
    # a's lookups notice the return by themselves, reconcile, and announce what was lost
    removed: set[bytes] = set()

    def all_removed():
        removed.update(key for e in a.manager.take_events() if e.removed for key in e.keys)
        return removed == set(keys)

    assert until(all_removed)
    assert all(a.manager.lookup(key) is not HIT for key in keys)
    assert a.manager.counters().gone == 4
    assert b.settle(k(0)) is MISS or b.settle(k(0)) is MISS  # gone after the restart
    # stores serve again (the breaker lets a call through after its delay)
    assert until(lambda: a.store([k(30)], [0]).success)
    assert b.manager.lookup(k(30)) in (RETRY, MISS)
    assert until(lambda: b.manager.lookup(k(30)) is HIT)

    def load():  # b's first call after the restart may still answer -900: a failed load
        result = b.run(b.manager.prepare_load([k(30)]), CPULoadStoreSpec([12]))
        b.manager.complete_load([k(30)])
        return result.success

    assert until(load)
    assert host_block(b.pool, 12) == host_block(a.pool, 0)


@pytest.mark.parametrize("prefix", [SLOT_BYTES, 0], ids=["one buffer", "split buffers"])
def test_a_full_store_fails_puts_counted_and_nothing_unwritten_is_loadable(tmp_path, prefix):
    server = MooncakeServer(tmp_path, segment=16 << 20).start()  # Mooncake's smallest segment
    made = []
    try:
        a = Replica(server, pool=big_pool(64, 64 << 10, seed=0, prefix=prefix))
        b = Replica(server, pool=big_pool(64, 64 << 10, seed=1, prefix=prefix))
        made += [a, b]
        ids = list(range(64))
        results, stored = [], []
        for job in range(6):  # 6 x 64 blocks of 64 KiB: 24 MiB into a 16 MiB store
            keys = [k(job * 64 + i) for i in ids]
            results.append(a.store(keys, ids))
            if results[-1].success:
                stored += keys
        failed = [r for r in results if not r.success]
        assert failed and all("store is full" in r.error for r in failed), results
        assert a.worker.counters().store_full > 0
        announced = {key for e in a.manager.take_events() if not e.removed for key in e.keys}
        assert announced == set(stored)  # a failed job's blocks are never announced
        loaded = 0
        for i in range(0, 6 * 64, 7):  # whatever another client finds loads byte-exact
            key = k(i)
            if b.settle(key) is not HIT:
                continue
            result = b.run(b.manager.prepare_load([key]), CPULoadStoreSpec([0]))
            b.manager.complete_load([key])
            assert not result.success or host_block(b.pool, 0) == host_block(a.pool, i % 64)
            loaded += result.success
        assert loaded > 0
    finally:
        close_all(made)
        server.stop()


def test_a_master_down_at_start_up_is_a_degraded_start_that_serves_once_it_answers(tmp_path):
    server = MooncakeServer(tmp_path)  # ports chosen, nothing started
    (tier,) = parse_secondary_tiers([server.tier_config(connect_timeout_s=0.2)])
    pool = make_pool()
    context = TierContext(sum(int(t.shape[1]) for t in pool.tensors), IDENTITY)
    manager = tier.build_manager(context, "lru")  # returns at once
    worker = tier.build_worker(context, pool)
    try:
        assert manager.lookup(k(0)) is MISS  # not set up: a miss, no call
        out = manager.prepare_store([k(0)])
        result = run_job(worker, 1, CPULoadStoreSpec([0]), out.store_spec, 10)
        manager.complete_store(out.keys_to_store, result.success)
        assert not result.success and manager.take_events() == []
        server.start()
        assert worker.store.wait_ready(30) and manager._remote.store.wait_ready(30)
        out = manager.prepare_store([k(0)])
        assert run_job(worker, 2, CPULoadStoreSpec([0]), out.store_spec, 30).success
    finally:
        worker.close()
        manager.close()
        server.stop()


def test_tensor_parallel_ranks_each_store_their_share_and_a_block_is_present_only_with_all(mooncake_server):
    (tier,) = parse_secondary_tiers([mooncake_server.tier_config()])
    pools = [make_pool(seed=r) for r in range(2)]
    block = sum(int(t.shape[1]) for t in pools[0].tensors)
    contexts = [TierContext(block, IDENTITY, rank=r, world_size=2) for r in range(2)]
    workers = [tier.build_worker(c, p) for c, p in zip(contexts, pools)]
    reader = tier.build_manager(contexts[0], "lru")
    writer = tier.build_manager(contexts[0], "lru")
    try:
        out = writer.prepare_store([k(0)])
        assert until(lambda: run_job(workers[0], 1, CPULoadStoreSpec([3]), out.store_spec, 30).success)
        assert until(lambda: (r := reader.lookup(k(0))) is not RETRY and r) is MISS  # rank 1's share missing
        assert run_job(workers[1], 1, CPULoadStoreSpec([3]), out.store_spec, 30).success
        writer.complete_store(out.keys_to_store)
        reader.reset()
        assert until(lambda: reader.lookup(k(0)) is HIT)
        spec = reader.prepare_load([k(0)])
        for r, worker in enumerate(workers):
            assert run_job(worker, 2, spec, CPULoadStoreSpec([9]), 30).success
            assert host_block(pools[r], 9) == host_block(pools[r], 3)
        assert host_block(pools[0], 3) != host_block(pools[1], 3)  # each rank its own share
    finally:
        for worker in workers:
            worker.close()
        reader.close()
        writer.close()


def test_blocks_completed_in_the_cpu_tier_are_written_through_and_announced(mooncake_replicas):
    a, b = mooncake_replicas(), mooncake_replicas()
    cpu = CPUOffloadingManager(8, enable_events=True)
    tiered = TieredOffloadingManager(cpu, [a.manager])
    keys = [k(i) for i in range(3)]
    out = tiered.prepare_store(keys)
    host_ids = out.store_spec.block_ids.tolist()  # as if the device->host copy just wrote them
    tiered.complete_store(keys)
    (write,) = tiered.take_transfers()
    assert (write.src_spec.medium, write.dst_spec.medium) == ("CPU", "MOONCAKE")
    result = a.run(write.src_spec, write.dst_spec)
    tiered.complete_transfer(write.token, result.success)
    assert result.success
    media = [(e.medium, e.removed, len(e.keys)) for e in tiered.take_events()]
    assert media == [("CPU", False, 3), ("MOONCAKE", False, 3)]
    assert [b.settle(key) for key in keys] == [HIT] * 3
    assert b.run(b.manager.prepare_load(keys), CPULoadStoreSpec([4, 5, 6])).success
    b.manager.complete_load(keys)
    assert [host_block(b.pool, 4 + i) for i in range(3)] == [host_block(a.pool, h) for h in host_ids]


def test_budget_evictions_remove_what_this_engine_wrote_even_while_leased(mooncake_replicas, mooncake_server):
    """An existence check grants a lease (10 s) during which a plain remove fails; the
    tier's removals are forced, so its budget holds even for blocks others just probed."""
    probe = mooncake_replicas()
    per_block = probe.block_bytes + 80
    a = mooncake_replicas(bytes_to_use=4 * per_block)
    assert a.manager.stats().capacity == 4
    raw = mooncake_server.client()
    for i in range(0, 8, 2):
        assert a.store([k(i), k(i + 1)], [0, 1]).success
        assert raw.batch_is_exist([a.name(k(i)), a.name(k(i + 1))]) == [1, 1]  # leased now
    assert until(lambda: raw.batch_is_exist([a.name(k(i)) for i in range(8)]) == [0] * 4 + [1] * 4)
    assert a.manager.counters().deleted == 4
    removed = [key for e in a.manager.take_events() if e.removed for key in e.keys]
    assert removed == [k(i) for i in range(4)]


def test_an_engine_pool_built_beside_a_mooncake_tier_moves_device_blocks_through_one_buffer_objects(
    mooncake_server,
):
    """``factory.build_worker`` as an engine calls it: the host pool gets the header prefix,
    the Mooncake worker puts each object as one buffer, and device blocks go device ->
    host -> store -> another host block -> other device blocks byte-exact."""
    gen = torch.Generator().manual_seed(7)
    caches, groups = three_group_layer_caches(16, gen)
    layout = KVLayout.from_layer_tensors(caches, groups)
    block = sum(layout.page_bytes(t) for t in range(len(layout.tensors)))
    tiers = parse_secondary_tiers([mooncake_server.tier_config()])
    router = build_worker(TierConfig(16 * block, secondary_tiers=tiers), layout, block, IDENTITY)
    try:
        engine, worker = router.workers
        assert engine.host_pool.row_prefix_bytes == SLOT_BYTES and worker.one_buffer
        assert worker.store.wait_ready(30)
        sizes = [2, 2, 2, 0]  # device blocks 0, 1 of each live group -> host blocks 1..6

        def move(job, src, dst, via):
            result = run_job(via, job, src, dst, 30)
            assert result.success, result.error

        dev = DeviceLoadStoreSpec([0, 1, 0, 1, 0, 1], sizes, [0, 0, 0, 0])
        move(1, dev, CPULoadStoreSpec(range(1, 7)), engine)
        remote = MooncakeLoadStoreSpec([k(i) for i in range(1, 7)])
        move(2, CPULoadStoreSpec(range(1, 7)), remote, worker)
        move(3, remote, CPULoadStoreSpec([15, 9, 12, 10, 14, 8]), worker)
        back = DeviceLoadStoreSpec([8, 9, 8, 9, 8, 9], sizes, [0, 0, 0, 0])
        move(4, CPULoadStoreSpec([15, 9, 12, 10, 14, 8]), back, engine)
        for g in range(3):
            for t in layout.groups[g]:
                assert torch.equal(layout.tensors[t][8:10], layout.tensors[t][0:2]), (g, t)
    finally:
        router.close()


@LAYOUTS
def test_jobs_of_several_batches_in_flight_at_once_are_byte_exact_and_a_bad_batch_fails_its_job_alone(
    mooncake_replicas, layout
):
    """Batches of 2 blocks, jobs queued back to back: every store and load lands
    byte-exact, and a load whose second batch names a missing object fails with it while
    the loads around it succeed."""
    a = mooncake_replicas(layout, batch_blocks=2, io_threads=1)
    stores = {1: [0, 1, 2, 3, 4], 2: [5, 6, 7], 3: [8, 9, 10, 11, 12]}
    for job, ids in stores.items():
        a.worker.submit(job, CPULoadStoreSpec(ids), MooncakeLoadStoreSpec([k(i) for i in ids]))
    a.worker.wait(list(stores), 30)
    assert all(r.success for r in a.worker.poll())
    sources = {i: host_block(a.pool, i) for i in range(13)}
    loads = {
        4: ([0, 1, 2, 3, 4], [15, 14, 13, 5, 6]),
        5: ([5, 6, 99], [7, 8, 9]),  # k(99) was never stored: the second batch misses
        6: ([8, 9, 10, 11, 12], [0, 1, 2, 3, 4]),
    }
    for job, (keys, ids) in loads.items():
        a.worker.submit(job, MooncakeLoadStoreSpec([k(i) for i in keys]), CPULoadStoreSpec(ids))
    a.worker.wait(list(loads), 30)
    results = {r.job_id: r for r in a.worker.poll()}
    assert results[4].success and results[6].success, results
    assert not results[5].success and "no longer in the store" in results[5].error
    for job in (4, 6):
        keys, ids = loads[job]
        assert [host_block(a.pool, i) for i in ids] == [sources[i] for i in keys], job
    counters = a.worker.counters()
    assert (counters.loads, counters.loads_failed, counters.missing_values) == (2, 1, 1)
    assert counters.stores == 3 and counters.blocks_written == 13
