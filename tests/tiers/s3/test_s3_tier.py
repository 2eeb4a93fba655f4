"""The object-storage tier against a real S3 server (SeaweedFS's ``weed mini``) on
loopback: byte-exact stores and loads through the worker and the manager, two replicas
sharing a bucket (first writer wins), write-through from the CPU tier, budgets, tensor
parallel ranks. No mocks."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import obstore
import pytest
import torch

from kvoffload.cpu import CPUOffloadingManager
from kvoffload.manager import LookupResult
from kvoffload.specs import CPULoadStoreSpec, DeviceLoadStoreSpec
from kvoffload.tiers.factory import TierConfig, build_worker
from kvoffload.tiers.mooncake.objects import SLOT_BYTES
from kvoffload.tiers.redis.format import HEADER_BYTES, decode
from kvoffload.tiers.s3.names import S3LoadStoreSpec
from kvoffload.tiers.secondary import TierContext, parse_secondary_tiers
from kvoffload.tiers.tiered import TieredOffloadingManager
from kvoffload.transfer.layout import KVLayout
from redis_replica import IDENTITY, k, until
from s3_replica import POOLS
from transfer_oracle import host_block, make_pool, three_group_layer_caches
from worker_jobs import run_job

HIT, MISS, RETRY, PENDING = LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY, LookupResult.PENDING
LAYOUTS = pytest.mark.parametrize("layout", list(POOLS))


@LAYOUTS
def test_blocks_round_trip_byte_exact_and_a_second_replica_finds_them(s3_replicas, s3_server, layout):
    a, b = s3_replicas(layout), s3_replicas(layout)
    assert a.worker.one_buffer is (layout == "one buffer")
    keys = [k(i) for i in range(6)]
    assert a.store(keys, list(range(6))).success
    events = a.manager.take_events()
    assert [(e.removed, e.medium, len(e.keys)) for e in events] == [(False, "OBJECT", 6)]
    assert all(a.manager.lookup(key) is HIT for key in keys)  # its own stores: no probe
    assert s3_server.names("kvoffload") == sorted(a.name(key) for key in keys)

    assert b.manager.lookup(keys[0]) is RETRY  # unknown: asked in the background
    assert [b.settle(key) for key in keys] == [HIT] * 6
    assert b.settle(k(99)) is MISS
    others = {i: host_block(b.pool, i) for i in range(b.pool.num_blocks) if not 10 <= i < 16}
    result = b.load(keys, list(range(10, 16)))
    assert result.success and result.bytes == 6 * b.block_bytes, result
    for i in range(6):
        assert host_block(b.pool, 10 + i) == host_block(a.pool, i)
    assert {i: host_block(b.pool, i) for i in others} == others  # no byte outside the loaded blocks
    assert b.manager.take_events() == []  # b did not store them: it does not announce them
    assert b.manager.counters().found == 6
    counters = b.worker.counters()
    assert (counters.loads, counters.blocks_read, counters.bytes_read) == (1, 6, 6 * b.block_bytes)


def test_each_object_is_the_checked_value_format_under_the_layouts_namespace(s3_replicas, s3_server):
    a = s3_replicas()
    assert a.store([k(3)], [5]).success
    (name,) = s3_server.names("kvoffload")
    assert name == a.name(k(3)) and name.startswith("kvoffload/kvr-") and name.endswith(k(3).hex())
    value = obstore.get(s3_server.client(), name).bytes()
    assert len(value) == HEADER_BYTES + len(k(3)) + a.block_bytes
    assert bytes(decode(value, k(3), a.names.digest, a.block_bytes)) == host_block(a.pool, 5)


def test_objects_put_from_the_pool_and_joined_ones_are_the_same_bytes(s3_replicas):
    one, joined = s3_replicas("one buffer"), s3_replicas("joined")
    for writer, reader, base in ((one, joined, 0), (joined, one, 10)):
        keys = [k(base + i) for i in range(3)]
        assert writer.store(keys, [4, 5, 6]).success
        assert [reader.settle(key) for key in keys] == [HIT] * 3
        assert reader.load(keys, [7, 8, 9]).success
        assert [host_block(reader.pool, i) for i in (7, 8, 9)] == [
            host_block(writer.pool, i) for i in (4, 5, 6)
        ]


@LAYOUTS
def test_the_first_writer_wins_and_a_later_store_keeps_its_object(s3_replicas, layout):
    a, b = s3_replicas(layout), s3_replicas(layout)
    assert a.store([k(0)], [0]).success
    assert b.store([k(0)], [3]).success  # b's block 3 differs from a's block 0: 412, counted present
    assert (b.worker.counters().blocks_written, b.worker.counters().already_present) == (0, 1)
    b.manager.reset()
    assert b.settle(k(0)) is HIT
    assert b.load([k(0)], [5]).success
    assert host_block(b.pool, 5) == host_block(a.pool, 0) != host_block(b.pool, 3)


def test_replicas_racing_to_store_the_same_blocks_leave_one_intact_object_each(s3_replicas, s3_server):
    """Four replicas store the same 8 keys from different bytes at once: every store
    succeeds, exactly 8 objects are created over all of them, and each object is one
    writer's block whole."""
    replicas = [s3_replicas() for _ in range(4)]
    keys = [k(50 + i) for i in range(8)]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda r: r.store(keys, list(range(8))), replicas))
    assert all(r.success for r in results), results
    assert sum(r.worker.counters().blocks_written for r in replicas) == 8
    assert sum(r.worker.counters().already_present for r in replicas) == 3 * 8
    reader = replicas[0]
    reader.manager.reset()
    for i, key in enumerate(keys):
        assert reader.settle(key) is HIT
        assert reader.load([key], [15]).success
        assert host_block(reader.pool, 15) in {host_block(r.pool, i) for r in replicas}


def _promote(replica, keys):
    """Promote ``keys`` from the replica's object tier into a fresh CPU tier, as the
    tiered manager does; the CPU tier, the tiered manager and the job results."""
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


def test_blocks_completed_in_the_cpu_tier_are_written_through_promoted_and_announced(s3_replicas):
    a, b = s3_replicas(), s3_replicas()
    cpu = CPUOffloadingManager(8, enable_events=True)
    tiered = TieredOffloadingManager(cpu, [a.manager])
    keys = [k(i) for i in range(3)]
    out = tiered.prepare_store(keys)
    host_ids = out.store_spec.block_ids.tolist()  # as if the device->host copy just wrote them
    tiered.complete_store(keys)
    (write,) = tiered.take_transfers()
    assert (write.src_spec.medium, write.dst_spec.medium) == ("CPU", "OBJECT")
    result = a.run(write.src_spec, write.dst_spec)
    tiered.complete_transfer(write.token, result.success)
    assert result.success
    media = [(e.medium, e.removed, len(e.keys)) for e in tiered.take_events()]
    assert media == [("CPU", False, 3), ("OBJECT", False, 3)]

    cpu_b, tiered_b, results = _promote(b, keys)
    assert all(r.success for r in results)
    assert [tiered_b.lookup(key) for key in keys] == [HIT] * 3
    spec = cpu_b.prepare_load(keys)
    assert [host_block(b.pool, h) for h in spec.block_ids.tolist()] == [
        host_block(a.pool, h) for h in host_ids
    ]


def test_budget_evictions_delete_what_this_engine_wrote(s3_replicas, s3_server):
    probe = s3_replicas()
    per_block = probe.block_bytes + HEADER_BYTES + 36
    a = s3_replicas(bytes_to_use=4 * per_block)
    assert a.manager.stats().capacity == 4
    for i in range(0, 8, 2):
        assert a.store([k(i), k(i + 1)], [0, 1]).success
    assert until(lambda: s3_server.names("kvoffload") == sorted(a.name(k(i)) for i in range(4, 8)))
    assert a.manager.counters().deleted == 4
    removed = [key for e in a.manager.take_events() if e.removed for key in e.keys]
    assert removed == [k(i) for i in range(4)]


def test_objects_another_writer_deleted_are_found_by_reconciliation_and_announced_removed(
    s3_replicas, s3_server
):
    a = s3_replicas(reconcile_interval_s=0.2)
    keys = [k(i) for i in range(4)]
    assert a.store(keys, [0, 1, 2, 3]).success
    a.manager.take_events()
    obstore.delete(s3_server.client(), [a.name(keys[1]), a.name(keys[3])])
    removed: list[bytes] = []

    def heard():
        removed.extend(key for e in a.manager.take_events() if e.removed for key in e.keys)
        return sorted(removed) == sorted([keys[1], keys[3]])

    assert until(heard)
    assert a.manager.counters().gone == 2
    assert [a.manager.lookup(key) for key in (keys[0], keys[2])] == [HIT, HIT]


def test_objects_past_their_lifetime_are_misses_and_deleted(s3_replicas, s3_server):
    a = s3_replicas()
    assert a.store([k(1)], [1]).success
    b = s3_replicas(lifetime_s=0.5)
    import time

    time.sleep(1.2)  # Last-Modified has one-second resolution
    assert b.settle(k(1)) is MISS
    assert until(lambda: s3_server.names("kvoffload") == [])
    assert b.manager._remote.expired_found == 1


def test_tensor_parallel_ranks_each_store_their_share_and_a_block_is_present_only_with_all(s3_server):
    (tier,) = parse_secondary_tiers([s3_server.tier_config()])
    pools = [make_pool(seed=r) for r in range(2)]
    block = sum(int(t.shape[1]) for t in pools[0].tensors)
    contexts = [TierContext(block, IDENTITY, rank=r, world_size=2) for r in range(2)]
    workers = [tier.build_worker(c, p) for c, p in zip(contexts, pools)]
    reader = tier.build_manager(contexts[0], "lru")
    writer = tier.build_manager(contexts[0], "lru")
    try:
        out = writer.prepare_store([k(0)])
        assert run_job(workers[0], 1, CPULoadStoreSpec([3]), out.store_spec, 30).success
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


def test_an_engine_pool_built_beside_an_object_tier_moves_device_blocks_through_the_bucket(s3_server):
    """``factory.build_worker`` as an engine calls it: the host pool gets the header prefix,
    the worker puts each object from the pool, and device blocks go device -> host ->
    bucket -> another host block -> other device blocks byte-exact."""
    gen = torch.Generator().manual_seed(7)
    caches, groups = three_group_layer_caches(16, gen)
    layout = KVLayout.from_layer_tensors(caches, groups)
    block = sum(layout.page_bytes(t) for t in range(len(layout.tensors)))
    tiers = parse_secondary_tiers([s3_server.tier_config()])
    router = build_worker(TierConfig(16 * block, secondary_tiers=tiers), layout, block, IDENTITY)
    try:
        engine, worker = router.workers
        assert engine.host_pool.row_prefix_bytes == SLOT_BYTES and worker.one_buffer
        sizes = [2, 2, 2, 0]  # device blocks 0, 1 of each live group -> host blocks 1..6

        def move(job, src, dst, via):
            result = run_job(via, job, src, dst, 30)
            assert result.success, result.error

        move(
            1,
            DeviceLoadStoreSpec([0, 1, 0, 1, 0, 1], sizes, [0, 0, 0, 0]),
            CPULoadStoreSpec(range(1, 7)),
            engine,
        )
        remote = S3LoadStoreSpec([k(i) for i in range(1, 7)])
        move(2, CPULoadStoreSpec(range(1, 7)), remote, worker)
        move(3, remote, CPULoadStoreSpec([15, 9, 12, 10, 14, 8]), worker)
        back = DeviceLoadStoreSpec([8, 9, 8, 9, 8, 9], sizes, [0, 0, 0, 0])
        move(4, CPULoadStoreSpec([15, 9, 12, 10, 14, 8]), back, engine)
        for g in range(3):
            for t in layout.groups[g]:
                assert torch.equal(layout.tensors[t][8:10], layout.tensors[t][0:2]), (g, t)
    finally:
        router.close()


def test_a_load_naming_a_missing_object_fails_alone_and_jobs_are_checked_at_submission(s3_replicas):
    a = s3_replicas(concurrency=2)
    assert a.store([k(i) for i in range(5)], list(range(5))).success
    a.worker.submit(10, S3LoadStoreSpec([k(0), k(1)]), CPULoadStoreSpec([8, 9]))
    a.worker.submit(11, S3LoadStoreSpec([k(2), k(99)]), CPULoadStoreSpec([10, 11]))
    a.worker.submit(12, S3LoadStoreSpec([k(3), k(4)]), CPULoadStoreSpec([12, 13]))
    a.worker.wait([10, 11, 12], 30)
    results = {r.job_id: r for r in a.worker.poll()}
    assert results[10].success and results[12].success, results
    assert not results[11].success and "no longer in the bucket" in results[11].error
    assert [host_block(a.pool, i) for i in (8, 9, 12, 13)] == [host_block(a.pool, i) for i in (0, 1, 3, 4)]
    assert a.worker.counters().missing_values == 1
    with pytest.raises(ValueError, match="out of range"):
        a.worker.submit(13, S3LoadStoreSpec([k(0)]), CPULoadStoreSpec([99]))
    with pytest.raises(ValueError, match="2 host blocks but 1 keys"):
        a.worker.submit(13, CPULoadStoreSpec([0, 1]), S3LoadStoreSpec([k(0)]))
    with pytest.raises(TypeError, match="does not move"):
        a.worker.submit(13, CPULoadStoreSpec([0]), CPULoadStoreSpec([1]))
    a.worker.close()
    with pytest.raises(RuntimeError, match="after close"):
        a.worker.submit(14, CPULoadStoreSpec([0]), S3LoadStoreSpec([k(0)]))
