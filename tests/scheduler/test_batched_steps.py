"""A step of many running requests: their stores reserved in one call as one job (each
request's part known: completion, finishing, preemption and failure per request), the
``RunningRequests`` form with new device blocks, matching a run of keys in C loops with the
CPU tier's counts unchanged, and loaded blocks not offered to the tier again."""

from kvoffload.cpu import CPUOffloadingManager
from kvoffload.events.types import BlockStored
from kvoffload.keys import external_hash, make_offload_key
from kvoffload.manager import LookupResult
from kvoffload.scheduler import KVGroup, OffloadingScheduler, RunningRequests, StepRequest
from scheduler_requests import HASHER, Req, run_prefill

HIT, MISS = LookupResult.HIT, LookupResult.MISS


def make(num_blocks=64, manager_class=CPUOffloadingManager):
    manager = manager_class(num_blocks, "lru", enable_events=True)
    return manager, OffloadingScheduler(manager, (KVGroup(4),), hash_block_size=4)


def decoding(sched, n, prompt=6):
    """``n`` requests of ``prompt`` tokens, prefilled (their first block stored), with
    device blocks for 12 tokens each: request i holds blocks 10i .. 10i+2."""
    reqs = []
    for i in range(n):
        req = Req(f"r{i}", [i * 100 + t for t in range(prompt)])
        run_prefill(sched, req, [[10 * i, 10 * i + 1, 10 * i + 2]])
        reqs.append(req)
    return reqs


def grow(reqs, count):
    for req in reqs:
        req.all_token_ids += [7] * count
        req.block_hashes = HASHER.hash_request(req.all_token_ids, 4)


def key(req, j):
    return make_offload_key(req.block_hashes[j], 0)


def test_one_job_stores_the_block_every_running_request_completed():
    manager, sched = make()
    reqs = decoding(sched, 3)
    sched.take_events()
    grow(reqs, 2)  # 8 tokens: block 1 of each is complete once this step has run
    plan = sched.build_step([], (), RunningRequests([r.request_id for r in reqs], [8, 8, 8]))
    (store,) = plan.stores
    assert store.req_id == "" and store.is_store
    assert store.src_spec.block_ids.tolist() == [1, 11, 21]  # each request's block 1, in order
    assert len(store.dst_spec.block_ids) == 3
    assert [manager.lookup(key(r, 1)) for r in reqs] == [LookupResult.PENDING] * 3
    sched.complete_jobs([(store.job_id, True)])
    assert [manager.lookup(key(r, 1)) for r in reqs] == [HIT] * 3
    # one BlockStored per request (three chains), each naming its parent and its tokens
    events = sched.take_events()
    assert [e.block_hashes for e in events] == [[external_hash(r.block_hashes[1])] for r in reqs]
    assert [e.parent_block_hash for e in events] == [external_hash(r.block_hashes[0]) for r in reqs]
    assert all(isinstance(e, BlockStored) for e in events)
    assert [e.token_ids for e in events] == [r.all_token_ids[4:8] for r in reqs]
    # nothing new until the next block ends
    grow(reqs, 1)
    assert sched.build_step([], (), RunningRequests([r.request_id for r in reqs], [9, 9, 9])).stores == []


def test_a_request_finished_or_preempted_waits_for_the_shared_job_only():
    manager, sched = make()
    reqs = decoding(sched, 3)
    grow(reqs, 2)
    (store,) = sched.build_step([], (), [(r.request_id, 8) for r in reqs]).stores
    assert sched.request_finished("r0") is True  # its block is still being copied
    plan = sched.build_step([], preempted=["r1"])
    assert plan.hold_blocks == {"r0": [store.job_id]}
    assert plan.flush == {"r1": [store.job_id]}
    assert sched.take_freeable() == set()
    sched.complete_jobs([(store.job_id, True)])
    assert sched.take_freeable() == {"r0"}
    assert sched.request_finished("r1") is False and sched.request_finished("r2") is False
    assert sched.num_requests == 0


def test_a_failed_shared_job_leaves_no_block_loadable_and_counts_one_failed_job():
    manager, sched = make()
    reqs = decoding(sched, 3)
    sched.take_events()
    grow(reqs, 2)
    (store,) = sched.build_step([], (), [(r.request_id, 8) for r in reqs]).stores
    sched.complete_jobs([(store.job_id, False)])
    assert [manager.lookup(key(r, 1)) for r in reqs] == [MISS] * 3
    assert sched.stats.failed_stores == 1  # failed store jobs, as the metric says
    assert sched.take_events() == []


def test_a_tier_without_room_for_all_reserves_request_by_request():
    # room for one more block: the step's blocks are reserved per request, the first fits
    manager, sched = make(num_blocks=4)
    reqs = decoding(sched, 3)  # three blocks in the tier, idle
    for r in reqs:
        assert manager.lookup(key(r, 0)) is HIT
    grow(reqs, 2)
    manager.prepare_load([key(r, 0) for r in reqs])  # pinned: nothing can be evicted
    plan = sched.build_step([], (), [(r.request_id, 8) for r in reqs])
    (store,) = plan.stores
    assert store.req_id == "r0" and store.src_spec.block_ids.tolist() == [1]
    assert sched.stats.declined_stores == 2


def test_running_requests_with_new_device_blocks_store_them_when_complete():
    manager, sched = make()
    reqs = decoding(sched, 2)
    grow(reqs, 6)  # 12 tokens: blocks 1 and 2 complete
    new = [[[5]], None]  # r0 got block 5 for tokens 12..15, r1 nothing
    plan = sched.build_step([], (), RunningRequests(["r0", "r1"], [12, 12], new))
    (store,) = plan.stores
    assert store.src_spec.block_ids.tolist() == [1, 2, 11, 12]
    sched.complete_jobs([(store.job_id, True)])
    grow(reqs, 4)
    (store,) = sched.build_step([], (), RunningRequests(["r0", "r1"], [16, 16], [None, None])).stores
    assert store.req_id == "r0" and store.src_spec.block_ids.tolist() == [5]  # r1 has no block 3


class KeyByKey(CPUOffloadingManager):
    """The same tier, answering ``lookup`` itself: the scheduler asks it key by key."""

    def lookup(self, key):
        return super().lookup(key)


def test_matching_a_run_of_keys_counts_as_looking_them_up_one_by_one():
    results = []
    for cls in (CPUOffloadingManager, KeyByKey):
        manager, sched = make(manager_class=cls)
        a = Req("a", list(range(14)))
        run_prefill(sched, a, [[0, 1, 2, 3]])
        sched.request_finished("a")
        b = Req("b", list(range(10)) + [99] * 8)  # blocks 0, 1 hit, block 2 misses
        hits = [sched.match(b, 0), sched.match(Req("c", list(range(14))), 4)]
        c = Req("d", list(range(30, 50)))
        d_hits = sched.match(c, 0)
        stats = manager.stats()
        results.append((hits, d_hits, stats.hits, stats.misses))
    assert results[0] == results[1]
    assert results[0][0] == [8, 8]  # c: engine holds block 0, blocks 1, 2 loadable, one token left


def test_a_store_in_flight_among_the_keys_still_means_ask_again():
    manager, sched = make()
    a = Req("a", list(range(12)))
    sched.match(a, 0)
    sched.on_allocated("a", [[0, 1, 2]], 0)
    (store,) = sched.build_step([StepRequest("a", None, 12)]).stores  # in flight
    assert sched.match(Req("b", list(range(16))), 0) is None
    sched.complete_jobs([(store.job_id, True)])
    assert sched.match(Req("c", list(range(16))), 0) == 12


class Recording(CPUOffloadingManager):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.offered = []

    def prepare_store(self, keys):
        self.offered += keys
        return super().prepare_store(keys)


def test_blocks_a_request_loaded_are_not_offered_to_the_tier_again():
    manager, sched = make(manager_class=Recording)
    a = Req("a", list(range(12)))
    run_prefill(sched, a, [[0, 1, 2]])
    sched.request_finished("a")
    b = Req("b", list(range(12)) + [50, 51, 52, 53, 54])
    assert sched.match(b, 0) == 12
    sched.on_allocated("b", [[5, 6, 7, 8, 9]], 12)
    manager.offered.clear()
    plan = sched.build_step([StepRequest("b", None, 17)])
    sched.complete_jobs([(job.job_id, True) for job in plan.loads])
    (store,) = plan.stores
    assert store.src_spec.block_ids.tolist() == [8]  # its block 3, computed: blocks 0-2 came loaded
    assert manager.offered == [key(b, 3)]
    sched.complete_jobs([(store.job_id, True)])
    assert [manager.lookup(key(b, j)) for j in range(4)] == [HIT] * 4


def test_a_request_that_only_ever_runs_in_the_cheap_form_is_stored():
    manager, sched = make()
    req = Req("a", list(range(9)))
    sched.match(req, 0)
    sched.on_allocated("a", [[3, 4, 5]], 0)
    (store,) = sched.build_step([], (), RunningRequests(["a"], [9])).stores
    assert store.req_id == "a" and store.src_spec.block_ids.tolist() == [3, 4]
