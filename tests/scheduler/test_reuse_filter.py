"""The reuse filter (``store_threshold``): a block is stored only once that many requests
asked for it; the counts are bounded; skipped stores are counted; the vLLM extra-config
key reaches it."""

import pytest

from kvoffload.cpu import CPUOffloadingManager
from kvoffload.integrations.vllm.config import parse_extra_config
from kvoffload.keys import make_offload_key
from kvoffload.manager import LookupResult
from kvoffload.scheduler import KVGroup, OffloadingScheduler, StepRequest
from kvoffload.scheduler.reuse import ReuseFilter
from scheduler_requests import HASHER, Req

HIT = LookupResult.HIT


def make(threshold, memory=1 << 17):
    manager = CPUOffloadingManager(16, "lru")
    sched = OffloadingScheduler(
        manager, [KVGroup(4)], hash_block_size=4, store_threshold=threshold, store_threshold_memory=memory
    )
    return manager, sched


def run(sched, req, computed=None):
    n = sched.match(req, 0)
    sched.on_allocated(req.request_id, [list(range(len(req.all_token_ids) // 4 + 1))], n)
    plan = sched.build_step([StepRequest(req.request_id, None, computed or len(req.all_token_ids))])
    sched.complete_jobs([(job.job_id, True) for job in plan.loads + plan.stores])
    sched.request_finished(req.request_id)
    return n


def held(manager, req, n):
    return [manager.lookup(make_offload_key(h, 0)) is HIT for h in req.block_hashes[:n]]


def test_a_block_is_stored_once_enough_requests_asked_for_it():
    manager, sched = make(2)
    run(sched, Req("a", list(range(9))))
    assert held(manager, Req("x", list(range(9))), 2) == [False, False]
    assert (sched.stats.skipped_stores, sched.stats.blocks_stored) == (2, 0)
    assert run(sched, Req("b", list(range(9)))) == 0  # asked twice now: stored
    assert sched.stats.blocks_stored == 2 and sched.stats.skipped_stores == 2
    assert run(sched, Req("c", list(range(9)))) == 8


def test_threshold_one_stores_everything_and_remembers_nothing():
    manager, sched = make(1)
    run(sched, Req("a", list(range(9))))
    assert sched.stats.blocks_stored == 2 and sched.stats.skipped_stores == 0
    assert len(sched._reuse) == 0


def test_a_generated_block_is_asked_for_once_when_offered():
    # a: 8 prompt tokens + 4 generated: the generated block counts once (at its offer);
    # b's prompt holds it (counts again): b stores all three
    manager, sched = make(2)
    a = Req("a", list(range(8)))
    sched.match(a, 0)  # the match sees the prompt only
    sched.on_allocated("a", [[0, 1, 2]], 0)
    a.all_token_ids += range(8, 12)  # decoding adds a whole block
    a.block_hashes = HASHER.hash_request(a.all_token_ids, 4)
    sched.build_step([StepRequest("a", None, 12)])
    sched.request_finished("a")
    assert sched.stats.skipped_stores == 3
    run(sched, Req("b", list(range(13))))
    assert held(manager, a, 3) == [True, True, True]
    assert sched.stats.skipped_stores == 3


def test_the_counts_are_bounded():
    f = ReuseFilter(2, memory=2)
    a, b, c = (make_offload_key(bytes([i]) * 8, 0) for i in range(3))
    f.count([a, b])
    f.count([c])  # a is the oldest: forgotten
    f.count([a, b, c])
    assert len(f) == 2 and not f.allows(a) and f.allows(b) and f.allows(c)


def test_a_bounded_memory_forgets_a_block_asked_for_long_ago():
    manager, sched = make(2, memory=2)
    run(sched, Req("a", list(range(9))))
    run(sched, Req("x", list(range(100, 109))))  # two other blocks push a's out
    run(sched, Req("b", list(range(9))))  # asked "once" again
    assert held(manager, Req("a", list(range(9))), 2) == [False, False]


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2", True])
def test_bad_thresholds_are_named(bad):
    with pytest.raises(ValueError, match=rf"store_threshold must be a positive int, got {bad!r}"):
        ReuseFilter(bad)
    with pytest.raises(ValueError, match=r"\['store_threshold'\] must be a positive int, got"):
        parse_extra_config({"cpu_bytes_to_use": 1 << 20, "store_threshold": bad}, 16)


def test_the_extra_config_key():
    assert parse_extra_config({"cpu_bytes_to_use": 1 << 20}, 16).store_threshold == 1
    assert parse_extra_config({"cpu_bytes_to_use": 1 << 20, "store_threshold": 3}, 16).store_threshold == 3
