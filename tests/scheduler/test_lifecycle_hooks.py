"""The request lifecycle in the manager contract: when the scheduler calls
``on_new_request`` and ``on_request_finished``, on every path a request takes, and what
the finish says (``kvoffload.manager``'s module docstring is the contract).

A real ``CPUOffloadingManager`` under a policy that records the hooks it is passed (so
every test also checks that the CPU tier forwards them), and a real tiered manager.
"""

import pytest

from kvoffload.cpu import CPUOffloadingManager
from kvoffload.keys import make_offload_key
from kvoffload.manager import RequestContext, prefix_order
from kvoffload.policies import LRUPolicy
from kvoffload.scheduler import KVGroup, OffloadingScheduler, StepRequest
from kvoffload.tiers.tiered import TieredOffloadingManager
from scheduler_requests import Req


class Recording(LRUPolicy):
    """LRU that logs the hooks (and its clears) in one list shared by the instance."""

    def __init__(self, capacity):
        super().__init__(capacity)
        self.log = []

    def on_new_request(self, request):
        self.log.append(("new", request.request_id))
        super().on_new_request(request)

    def on_request_finished(self, request, key_groups, inserted, reused):
        self.log.append(("finished", request.request_id, [list(g) for g in key_groups], inserted, reused))
        super().on_request_finished(request, key_groups, inserted, reused)

    def clear(self):
        self.log.append(("clear",))
        super().clear()


ONE_GROUP = (KVGroup(4),)


def make(num_blocks=16, groups=ONE_GROUP):
    manager = CPUOffloadingManager(num_blocks, Recording)
    return manager, OffloadingScheduler(manager, groups, hash_block_size=4), manager.policy.log


def keys(req, n, group=0, per=1):
    return [make_offload_key(req.block_hashes[(j + 1) * per - 1], group) for j in range(n)]


def prefill(sched, req, block_ids, finish=True):
    n = sched.match(req, 0)
    sched.on_allocated(req.request_id, block_ids, n)
    plan = sched.build_step([StepRequest(req.request_id, None, req.num_prompt_tokens)])
    sched.complete_jobs([(job.job_id, True) for job in plan.loads + plan.stores])
    if finish:
        sched.request_finished(req.request_id)
    return plan


def finishes(log):
    return [entry for entry in log if entry[0] == "finished"]


def test_announced_once_at_the_first_match_with_the_engines_hints():
    manager, sched, log = make()
    a = Req("a", list(range(10)))
    seen = []
    manager.policy.on_new_request = lambda request: seen.append(request)
    assert sched.match(a, 0, {"max_load_tokens": 8}) == 0
    sched.match(a, 0, {"ignored": True})  # asked again while it waits: not a new request
    (ctx,) = seen
    assert (ctx.request_id, dict(ctx.hints), ctx.group_tokens) == ("a", {"max_load_tokens": 8}, (4,))
    b = Req("b", list(range(100, 104)))
    sched.match(b, 0)  # no hints: an empty mapping
    assert [c.request_id for c in seen] == ["a", "b"] and dict(seen[1].hints) == {}


def test_a_finished_request_says_its_keys_and_what_it_inserted():
    # 10 tokens: 2 whole blocks (the partial third is never a key); both stored by it
    manager, sched, log = make()
    a = Req("a", list(range(10)))
    prefill(sched, a, [[0, 1, 2]])
    assert log[0] == ("new", "a")
    ((_, rid, key_groups, inserted, reused),) = finishes(log)
    assert (rid, key_groups, inserted, reused) == ("a", [keys(a, 2)], set(keys(a, 2)), set())
    assert sched.request_finished("a") is False and len(finishes(log)) == 1  # said once


def test_the_finish_waits_for_the_jobs_still_in_flight():
    manager, sched, log = make()
    a = Req("a", list(range(8)))
    sched.match(a, 0)
    sched.on_allocated("a", [[0, 1]], 0)
    (store,) = sched.build_step([StepRequest("a", None, 8)]).stores
    assert sched.request_finished("a") is True  # the engine holds its blocks
    assert finishes(log) == []  # its store may still change the tier: not yet
    sched.complete_jobs([(store.job_id, True)])
    ((_, _, key_groups, inserted, _),) = finishes(log)
    assert key_groups == [keys(a, 2)] and inserted == set(keys(a, 2))


def test_reused_names_the_loaded_keys_and_a_failed_store_inserts_nothing():
    manager, sched, log = make()
    a = Req("a", list(range(8)))
    prefill(sched, a, [[0, 1]])
    b = Req("b", list(range(16)))  # a's 2 blocks + 2 new ones
    assert sched.match(b, 0) == 8
    sched.on_allocated("b", [[4, 5, 6, 7]], 8)
    plan = sched.build_step([StepRequest("b", None, 16)])
    (load,), (store,) = plan.loads, plan.stores
    sched.complete_jobs([(load.job_id, True), (store.job_id, False)])
    sched.request_finished("b")
    (_, (_, rid, key_groups, inserted, reused)) = finishes(log)
    assert (rid, key_groups, inserted, reused) == ("b", [keys(b, 4)], set(), set(keys(a, 2)))


def test_a_failed_load_is_not_an_end_and_its_keys_are_not_reused():
    manager, sched, log = make()
    a = Req("a", list(range(8)))
    prefill(sched, a, [[0, 1]])
    b = Req("b", list(range(12)))
    sched.match(b, 0)
    sched.on_allocated("b", [[4, 5, 6]], 8)
    (load,) = sched.build_step([]).loads
    sched.complete_jobs([(load.job_id, False)])
    assert len(finishes(log)) == 1  # only a's: b goes on and recomputes
    assert sched.match(b, 0) == 0
    plan = sched.build_step([StepRequest("b", None, 12)])  # recomputed; a's blocks already held
    sched.complete_jobs([(job.job_id, True) for job in plan.stores])
    sched.request_finished("b")
    (_, (_, _, key_groups, inserted, reused)) = finishes(log)
    assert (key_groups, reused) == ([keys(b, 3)], set())
    assert inserted == {keys(b, 3)[2]}


def test_an_aborted_request_that_never_ran_still_ends():
    manager, sched, log = make()
    sched.match(Req("a", list(range(8))), 0)  # waiting, never allocated, then aborted
    assert sched.request_finished("a") is False
    assert log == [("new", "a"), ("finished", "a", [[]], set(), set())]
    assert sched.num_requests == 0


def test_a_load_cancelled_before_it_was_sent_is_not_reused():
    manager, sched, log = make()
    a = Req("a", list(range(8)))
    prefill(sched, a, [[0, 1]])
    b = Req("b", list(range(12)))
    sched.match(b, 0)
    sched.on_allocated("b", [[4, 5, 6]], 8)
    assert sched.request_finished("b") is False  # aborted before the step sent the load
    (_, (_, rid, key_groups, inserted, reused)) = finishes(log)
    assert (rid, inserted, reused) == ("b", set(), set())
    assert key_groups == [keys(b, 2)]  # the 8 tokens it had been given


def test_key_groups_hold_every_block_a_load_gave_it():
    # b's prompt is a's 8 tokens: it may load 7 (one is left to compute), in 2 whole
    # blocks; aborted once the load is done, before computing anything
    manager, sched, log = make()
    a = Req("a", list(range(8)))
    prefill(sched, a, [[0, 1]])
    b = Req("b", list(range(8)))
    assert sched.match(b, 0) == 7
    sched.on_allocated("b", [[4, 5]], 7)
    (load,) = sched.build_step([]).loads
    sched.complete_jobs([(load.job_id, True)])
    sched.request_finished("b")
    (_, (_, _, key_groups, inserted, reused)) = finishes(log)
    assert key_groups == [keys(b, 2)] and reused == set(keys(b, 2)) and inserted == set()


def test_preemption_is_not_an_end():
    manager, sched, log = make()
    a = Req("a", list(range(16)))
    sched.match(a, 0)
    sched.on_allocated("a", [[0, 1, 2, 3]], 0)
    (store,) = sched.build_step([StepRequest("a", None, 8)]).stores
    sched.complete_jobs([(store.job_id, True)])
    sched.build_step([], preempted=["a"])
    assert sched.match(a, 0) == 8  # resumed: matched again (its own blocks), same request
    sched.on_allocated("a", [[4, 5, 6, 7]], 8)
    plan = sched.build_step([StepRequest("a", [[4, 5, 6, 7]], 16, replace_block_ids=True)])
    sched.complete_jobs([(job.job_id, True) for job in plan.loads + plan.stores])
    sched.request_finished("a")
    assert [entry[:2] for entry in log] == [("new", "a"), ("finished", "a")]
    ((_, _, _, inserted, reused),) = finishes(log)
    # what it loaded back it had inserted itself: not a reuse
    assert inserted == set(keys(a, 4)) and reused == set()


def test_a_reset_ends_every_request_and_announces_the_running_ones_again():
    manager, sched, log = make()
    prefill(sched, Req("p", list(range(100, 108))), [[8, 9]])
    a = Req("a", list(range(8)))  # finished, its store in flight at the reset
    sched.match(a, 0)
    sched.on_allocated("a", [[0, 1]], 0)
    (stale,) = sched.build_step([StepRequest("a", None, 8)]).stores
    assert sched.request_finished("a") is True
    b = Req("b", list(range(100, 116)))  # running: reused p's 2 blocks, stored a third
    sched.match(b, 0)
    sched.on_allocated("b", [[4, 5, 6, 7]], 8)
    plan = sched.build_step([StepRequest("b", None, 12)])
    sched.complete_jobs([(job.job_id, True) for job in plan.loads + plan.stores])
    del log[:]
    sched.reset()
    assert [entry[:2] for entry in log] == [("finished", "a"), ("finished", "b"), ("clear",), ("new", "b")]
    assert log[1][3:] == ({keys(b, 3)[2]}, set(keys(b, 2)))  # what b had done before the reset
    del log[:]
    sched.complete_jobs([(stale.job_id, True)])  # a is freed now, but it already ended
    sched.request_finished("b")  # aborted before it stored again
    assert sched.take_freeable() == {"a"}
    assert log == [("finished", "b", [keys(b, 3)], set(), set())]  # nothing done since the reset


def test_key_groups_follow_each_groups_block_size_and_prefix_order_merges_them():
    # group 0: 4-token blocks, group 1: 8-token blocks; 16 tokens computed
    manager, sched, log = make(groups=(KVGroup(4), KVGroup(8)))
    a = Req("a", list(range(18)))
    sched.match(a, 0)
    sched.on_allocated("a", [[0, 1, 2, 3, 4], [5, 6, 7]], 0)
    plan = sched.build_step([StepRequest("a", None, 16)])
    sched.complete_jobs([(job.job_id, True) for job in plan.stores])
    sched.request_finished("a")
    ((_, _, key_groups, inserted, _),) = finishes(log)
    g0, g1 = keys(a, 4, 0), keys(a, 2, 1, per=2)
    assert key_groups == [g0, g1] and inserted == set(g0 + g1)
    ctx = RequestContext("a", {}, (4, 8))
    assert prefix_order(ctx, key_groups) == [g0[0], g0[1], g1[0], g0[2], g0[3], g1[1]]


class Below(CPUOffloadingManager):
    medium = "BELOW"


def test_the_tiered_manager_passes_both_hooks_to_every_tier():
    primary, below = CPUOffloadingManager(4, Recording), Below(8, Recording)
    tiers = TieredOffloadingManager(primary, [below])
    ctx = RequestContext("r", {"k": 1})
    key = make_offload_key(b"\x01" * 8, 0)
    tiers.on_new_request(ctx)
    tiers.on_request_finished(ctx, [[key]], {key}, set())
    expected = [("new", "r"), ("finished", "r", [[key]], {key}, set())]
    assert primary.policy.log == expected and below.policy.log == expected


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_kv_transfer_params_become_the_request_hints():
    pytest.importorskip("vllm")
    from vllm import SamplingParams
    from vllm.v1.request import Request

    from kvoffload.integrations.vllm.scheduler_side import SchedulerSide

    params = {"max_load_tokens": 0, "tier": "cpu"}
    request = Request(
        "r1", list(range(40)), SamplingParams(max_tokens=4, extra_args={"kv_transfer_params": params}), None
    )
    side = object.__new__(SchedulerSide)  # only the scheduler half of the translation
    manager, side.scheduler, log = make()
    seen = []
    manager.policy.on_new_request = seen.append
    assert side.get_num_new_matched_tokens(request, 0) == (0, False)
    (ctx,) = seen
    assert ctx.request_id == "r1" and dict(ctx.hints) == params
