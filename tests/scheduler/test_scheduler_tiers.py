"""The scheduler over a tiered manager: transfers between tiers ride in the step plan,
their outcomes reach the manager, and a prefix below the CPU tier is promoted in one batch
and then loaded as usual (here the two-step path, ``chain_promotions`` off; loads chained
on their promotion: ``test_scheduler_chained.py``)."""

from __future__ import annotations

from kvoffload.cpu import CPUOffloadingManager
from kvoffload.events.types import BlockRemoved, BlockStored
from kvoffload.scheduler import KVGroup, OffloadingScheduler, StepRequest
from kvoffload.tiers.tiered import TieredOffloadingManager
from scheduler_requests import Req, run_prefill
from shelf_tier import Shelf


def make(cpu=4, shelf=16, chain=False):
    primary = CPUOffloadingManager(cpu, "lru", enable_events=True)
    secondary = Shelf(shelf, "lru", enable_events=True)
    tiered = TieredOffloadingManager(primary, [secondary])
    sched = OffloadingScheduler(tiered, [KVGroup(4)], hash_block_size=4)
    sched.chain_promotions = chain
    return primary, secondary, sched


def complete(sched, jobs, success=True):
    sched.complete_jobs([(job.job_id, success) for job in jobs])


def test_stores_are_written_through_in_the_next_plan():
    primary, secondary, sched = make()
    run_prefill(sched, Req("a", list(range(9))), [[10, 11, 12]])  # two full blocks stored
    plan = sched.build_step([])
    (write,) = plan.transfers
    assert write.req_id == "" and (write.src_spec.medium, write.dst_spec.medium) == ("CPU", "SHELF")
    assert plan.loads == [] and plan.stores == []
    complete(sched, [write])
    assert secondary.stats().used == 2 and secondary.stats().in_flight == 0
    assert primary.stats().pinned == 0
    assert sched.build_step([]).transfers == []


def test_a_prefix_evicted_from_the_cpu_tier_is_promoted_in_one_batch_then_loaded():
    primary, secondary, sched = make(cpu=3)
    a = Req("a", list(range(13)))  # three full blocks
    run_prefill(sched, a, [[1, 2, 3, 4]])
    complete(sched, sched.build_step([]).transfers)
    b = Req("b", list(range(100, 113)))
    run_prefill(sched, b, [[5, 6, 7, 8]])  # evicts a's blocks from the CPU tier
    complete(sched, sched.build_step([]).transfers)
    again = Req("a2", list(range(13)))
    assert sched.match(again, 0) is None  # below the CPU tier: ask again
    (promotion,) = sched.build_step([]).transfers
    assert (promotion.src_spec.medium, promotion.dst_spec.medium) == ("SHELF", "CPU")
    assert len(promotion.dst_spec.block_ids) == 3  # the whole prefix in one transfer
    assert sched.match(again, 0) is None  # still being copied
    complete(sched, [promotion])
    assert sched.match(again, 0) == 12
    sched.on_allocated("a2", [[20, 21, 22, 23]], 12)
    (load,) = sched.build_step([StepRequest("a2", None, 13)]).loads
    assert load.dst_spec.block_ids.tolist() == [20, 21, 22]
    complete(sched, [load])
    assert sched.stats.blocks_loaded == 3


def test_a_failed_promotion_is_a_miss_afterwards():
    primary, secondary, sched = make(cpu=1)
    run_prefill(sched, Req("a", list(range(5))), [[1, 2]])
    complete(sched, sched.build_step([]).transfers)
    run_prefill(sched, Req("b", list(range(50, 55))), [[3, 4]])
    complete(sched, sched.build_step([]).transfers)
    again = Req("a2", list(range(5)))
    assert sched.match(again, 0) is None
    complete(sched, sched.build_step([]).transfers, success=False)  # e.g. a bad checksum
    assert sched.stats.failed_tier_transfers == 1
    assert sched.match(again, 0) == 0  # dropped below, not in the CPU tier: recompute


class DiskShelf(Shelf):
    medium = "DISK"  # the local-disk tier's medium: its wire events say STORAGE, LOCAL


def test_secondary_tier_events_are_self_described_with_vllm_storage_fields():
    primary = CPUOffloadingManager(2, "lru", enable_events=True)
    disk = DiskShelf(8, "lru", enable_events=True)
    sched = OffloadingScheduler(TieredOffloadingManager(primary, [disk]), [KVGroup(4)], hash_block_size=4)
    sched.chain_promotions = False
    a = Req("a", list(range(9)))
    run_prefill(sched, a, [[1, 2, 3]])
    (cpu_stored,) = sched.take_events()
    assert (cpu_stored.medium, cpu_stored.locality, cpu_stored.ownership) == ("CPU", None, None)
    complete(sched, sched.build_step([]).transfers)
    (disk_stored,) = sched.take_events()
    assert isinstance(disk_stored, BlockStored)
    assert (disk_stored.medium, disk_stored.locality, disk_stored.ownership) == ("STORAGE", "LOCAL", None)
    # the same self-describing content as the CPU tier's announcement
    assert disk_stored.token_ids == list(range(8)) == cpu_stored.token_ids
    assert disk_stored.block_hashes == cpu_stored.block_hashes and disk_stored.block_size == 4
    # evicted from the CPU tier (its record went with the CPU copy), then promoted back:
    # the request that asked for it says again what it holds, so the promoted block is
    # announced self-described too (routers that index by tokens, as Dynamo's does, see it)
    run_prefill(sched, Req("b", list(range(50, 59))), [[4, 5, 6]])
    complete(sched, sched.build_step([]).transfers)
    sched.take_events()
    assert sched.match(Req("a2", list(range(9))), 0) is None
    complete(sched, sched.build_step([]).transfers)
    events = sched.take_events()
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    (promoted,) = [e for e in events if isinstance(e, BlockStored)]
    assert {e.medium for e in removed} == {"CPU"}  # room made for the promotion
    assert promoted.medium == "CPU" and promoted.block_hashes == cpu_stored.block_hashes
    assert (promoted.token_ids, promoted.block_size) == (list(range(8)), 4)
    assert promoted.parent_block_hash == cpu_stored.parent_block_hash


class RemoteShelf(Shelf):
    medium = "REMOTE"  # the shared Redis tier's medium: STORAGE, REMOTE, redis on the wire


def test_shared_tier_events_say_storage_remote_redis_and_the_index_reads_them_as_shared():
    from kvoffload.index.tiers import SHARED, tier_of

    primary = CPUOffloadingManager(2, "lru", enable_events=True)
    sched = OffloadingScheduler(
        TieredOffloadingManager(primary, [RemoteShelf(8, "lru", enable_events=True)]),
        [KVGroup(4)],
        hash_block_size=4,
    )
    run_prefill(sched, Req("a", list(range(9))), [[1, 2, 3]])
    (cpu_stored,) = sched.take_events()
    complete(sched, sched.build_step([]).transfers)
    (remote_stored,) = sched.take_events()
    assert (remote_stored.medium, remote_stored.locality, remote_stored.ownership) == (
        "STORAGE",
        "REMOTE",
        "redis",
    )
    assert remote_stored.block_hashes == cpu_stored.block_hashes and remote_stored.token_ids == list(range(8))
    assert tier_of(remote_stored.medium, remote_stored.locality) == SHARED


def test_a_store_larger_than_the_room_left_keeps_its_leading_blocks():
    primary = CPUOffloadingManager(3, "lru", enable_events=True)
    sched = OffloadingScheduler(primary, [KVGroup(4)], hash_block_size=4)
    run_prefill(sched, Req("a", list(range(21))), [[1, 2, 3, 4, 5, 6]])  # five full blocks, room for 3
    assert sched.stats.blocks_stored == 2 and sched.stats.declined_stores == 3  # halved: 5 -> 2
    assert sched.match(Req("a2", list(range(21))), 0) == 8  # the leading two are loadable
