"""Loads chained on promotions (``chain_promotions``, the default): a prefix found below the
CPU tier is promoted and loaded from one step's plan, the load reading exactly the CPU
slots the promotion fills; those slots cannot be evicted in between; a failed promotion
fails the load and leaves nothing pinned; an aborted request leaks no pin."""

from __future__ import annotations

import pytest

from kvoffload.cpu import CPUOffloadingManager
from kvoffload.events.types import BlockStored
from kvoffload.scheduler import KVGroup, OffloadingScheduler, StepRequest
from kvoffload.tiers.tiered import TieredOffloadingManager
from scheduler_requests import Req, run_prefill
from shelf_tier import Shelf


class DiskShelf(Shelf):
    medium = "DISK"  # the local-disk tier's medium (load sources name it)


def make(cpu=4, shelf=16):
    primary = CPUOffloadingManager(cpu, "lru", enable_events=True)
    secondary = DiskShelf(shelf, "lru", enable_events=True)
    sched = OffloadingScheduler(
        TieredOffloadingManager(primary, [secondary]), [KVGroup(4)], hash_block_size=4
    )
    assert sched.chain_promotions  # the default
    return primary, secondary, sched


def complete(sched, jobs, success=True):
    sched.complete_jobs([(job.job_id, success) for job in jobs])


def evicted_prefix(cpu=3, blocks=3):
    """A scheduler whose request "a" (``blocks`` full blocks) was stored, written through
    and evicted from the CPU tier by request "b"."""
    primary, secondary, sched = make(cpu=cpu)
    a = list(range(4 * blocks + 1))
    run_prefill(sched, Req("a", a), [list(range(1, blocks + 2))])
    complete(sched, sched.build_step([]).transfers)
    run_prefill(sched, Req("b", list(range(100, 100 + 4 * blocks + 1))), [list(range(50, blocks + 51))])
    complete(sched, sched.build_step([]).transfers)
    assert primary.stats().used == cpu and secondary.stats().used == 2 * blocks
    return primary, secondary, sched, a


def keys_of(sched, req_id):
    return sched._requests[req_id].keys[0]


def test_the_load_is_planned_in_the_step_that_plans_the_promotion_and_reads_its_slots():
    primary, secondary, sched, tokens = evicted_prefix()
    assert sched.match(Req("a2", tokens), 0) == 12  # at once: no step waiting for the promotion
    sched.on_allocated("a2", [[20, 21, 22, 23]], 12)
    plan = sched.build_step([StepRequest("a2", None, 13)])
    (promotion,) = plan.transfers
    (load,) = plan.loads
    assert (promotion.src_spec.medium, promotion.dst_spec.medium) == ("SHELF", "CPU")
    assert load.src_spec.block_ids.tolist() == promotion.dst_spec.block_ids.tolist()
    assert load.dst_spec.block_ids.tolist() == [20, 21, 22]
    keys = keys_of(sched, "a2")[:3]
    assert [primary.state(k) for k in keys] == [-1, -1, -1]  # being written: not evictable
    # the load's report may come first in one call (workers report in any order)
    sched.complete_jobs([(load.job_id, True), (promotion.job_id, True)])
    assert sched.stats.blocks_loaded == 3 and sched.stats.failed_loads == 0
    assert [primary.state(k) for k in keys] == [0, 0, 0]  # loadable, unpinned
    assert sched.load_sources("a2") == {"DISK": 12}  # said while being promoted
    assert sched.match(Req("a3", tokens), 0) == 12  # now plain CPU hits


def test_promoted_slots_stay_pinned_until_their_load_completes():
    primary, _, sched, tokens = evicted_prefix()
    assert sched.match(Req("a2", tokens), 0) == 12
    sched.on_allocated("a2", [[20, 21, 22, 23]], 12)
    plan = sched.build_step([StepRequest("a2", None, 13)])
    complete(sched, plan.transfers)  # promoted; the load still copying
    keys = keys_of(sched, "a2")[:3]
    assert [primary.state(k) for k in keys] == [1, 1, 1]
    # a store needing the whole tier cannot evict them
    run_prefill(sched, Req("c", list(range(200, 213))), [[60, 61, 62, 63]])
    assert sched.stats.declined_stores == 3
    assert [primary.state(k) for k in keys] == [1, 1, 1]
    complete(sched, plan.loads)
    assert [primary.state(k) for k in keys] == [0, 0, 0] and primary.stats().pinned == 0


def test_a_failed_promotion_fails_the_load_and_pins_nothing():
    primary, secondary, sched, tokens = evicted_prefix()
    assert sched.match(Req("a2", tokens), 0) == 12
    sched.on_allocated("a2", [[20, 21, 22, 23]], 12)
    plan = sched.build_step([StepRequest("a2", None, 13)])
    # the worker fails the load unrun; both reported in one call, the load first
    sched.complete_jobs([(plan.loads[0].job_id, False), (plan.transfers[0].job_id, False)])
    assert sched.stats.failed_tier_transfers == 1
    assert (sched.stats.failed_loads, sched.stats.failed_load_tokens) == (1, 12)
    assert primary.stats().pinned == 0 and primary.stats().in_flight == 0
    assert all(primary.state(k) is None for k in keys_of(sched, "a2")[:3])  # never loadable
    assert sched.match(Req("a2", tokens), 0) == 0  # that request recomputes
    assert sched.match(Req("a3", tokens), 0) == 0  # dropped below: a miss everywhere


def test_a_prefix_partly_in_the_cpu_tier_pins_that_part_at_once():
    primary, _, sched, tokens = evicted_prefix(cpu=4, blocks=3)
    # the CPU tier kept one of a's blocks (4 slots, b took 3)
    first = Req("a2", tokens)
    assert sched.match(first, 0) == 12
    keys = keys_of(sched, "a2")[:3]
    kept = [k for k in keys if primary.state(k) == 0]
    assert len(kept) == 1
    sched.on_allocated("a2", [[20, 21, 22, 23]], 12)
    plan = sched.build_step([StepRequest("a2", None, 13)])
    assert primary.state(kept[0]) == 1  # pinned for the load now
    (promotion,) = plan.transfers
    assert len(promotion.dst_spec.block_ids) == 2
    sched.complete_jobs([(promotion.job_id, False), (plan.loads[0].job_id, False)])
    assert primary.stats().pinned == 0 and primary.state(kept[0]) == 0


@pytest.mark.parametrize("sent", [False, True])
def test_an_aborted_request_leaks_no_pin(sent):
    primary, _, sched, tokens = evicted_prefix()
    assert sched.match(Req("a2", tokens), 0) == 12
    sched.on_allocated("a2", [[20, 21, 22, 23]], 12)
    if not sent:  # aborted before its load was handed out: cancelled
        assert sched.request_finished("a2") is False
        plan = sched.build_step([])
        assert plan.loads == [] and len(plan.transfers) == 1  # the promotion still runs
        complete(sched, plan.transfers)
    else:  # its device blocks are held until the load completes
        plan = sched.build_step([StepRequest("a2", None, 13)])
        assert sched.request_finished("a2") is True
        complete(sched, plan.transfers)
        complete(sched, plan.loads)
        assert sched.take_freeable() == {"a2"}
    assert primary.stats().pinned == 0 and primary.stats().in_flight == 0
    assert sched.match(Req("a3", tokens), 0) == 12  # the promoted blocks stay, loadable


def test_room_for_part_of_the_prefix_loads_that_part():
    primary, _, sched, tokens = evicted_prefix(cpu=3, blocks=3)
    pin = Req("p", list(range(100, 113)))  # b's blocks: pin two of the three CPU slots
    assert sched.match(pin, 0) == 12
    sched.on_allocated("p", [[30, 31, 32, 33]], 8)
    sched.build_step([StepRequest("p", None, 9)])
    assert sched.match(Req("a2", tokens), 0) == 4  # one slot free to promote into
    sched.on_allocated("a2", [[20, 21, 22, 23]], 4)
    plan = sched.build_step([StepRequest("a2", None, 13)])
    (promotion,) = plan.transfers
    load = next(job for job in plan.loads if job.req_id == "a2")
    assert load.src_spec.block_ids.tolist() == promotion.dst_spec.block_ids.tolist()
    assert len(load.dst_spec.block_ids) == 1


def test_off_it_takes_two_steps_as_before():
    _, _, sched, tokens = evicted_prefix()
    sched.chain_promotions = False
    assert sched.match(Req("a2", tokens), 0) is None
    (promotion,) = sched.build_step([]).transfers
    complete(sched, [promotion])
    assert sched.match(Req("a2", tokens), 0) == 12


def test_the_promoted_blocks_are_announced_by_the_cpu_tier_when_they_land():
    _, _, sched, tokens = evicted_prefix()
    sched.take_events()
    assert sched.match(Req("a2", tokens), 0) == 12
    sched.on_allocated("a2", [[20, 21, 22, 23]], 12)
    plan = sched.build_step([StepRequest("a2", None, 13)])
    assert not [e for e in sched.take_events() if isinstance(e, BlockStored)]  # not before
    complete(sched, plan.transfers)
    (stored,) = [e for e in sched.take_events() if isinstance(e, BlockStored)]
    assert stored.medium == "CPU" and stored.token_ids == tokens[:12]
