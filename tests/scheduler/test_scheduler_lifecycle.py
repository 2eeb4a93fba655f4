"""Request-lifecycle edges of the offloading scheduler, with exact expectations.

Each test pins down one rule a plausible slip would break while the happy-path tests in
``test_scheduler.py`` still pass: chunked prefill stores only fully computed blocks, a
resumed request's device blocks are replaced, preemption flushes in-flight jobs, a
request that finishes before its load is sent releases its pins, and a hit refreshes
recency. Real ``CPUOffloadingManager`` with LRU throughout; no mocks.
"""

from kvoffload.cpu import CPUOffloadingManager
from kvoffload.events.types import BlockRemoved
from kvoffload.keys import external_hash, make_offload_key
from kvoffload.manager import LookupResult
from kvoffload.scheduler import KVGroup, OffloadingScheduler, StepRequest
from scheduler_requests import Req

HIT, MISS = LookupResult.HIT, LookupResult.MISS


ONE_GROUP = (KVGroup(4),)


def make(num_blocks=16, groups=ONE_GROUP, factor=1):
    manager = CPUOffloadingManager(num_blocks, "lru", enable_events=True)
    return manager, OffloadingScheduler(manager, groups, hash_block_size=4, blocks_per_offload_block=factor)


def ids(spec):
    return spec.block_ids.tolist()


def key(req, j, group=0, hashes_per_block=1):
    """Key of offloaded block ``j``: the hash ending at its last token, and the group."""
    return make_offload_key(req.block_hashes[(j + 1) * hashes_per_block - 1], group)


def prefill(sched, req, block_ids):
    """Match, allocate and compute the whole prompt in one step; complete its jobs."""
    n = sched.match(req, 0)
    sched.on_allocated(req.request_id, block_ids, n)
    plan = sched.build_step([StepRequest(req.request_id, None, req.num_prompt_tokens)])
    sched.complete_jobs([(job.job_id, True) for job in plan.loads + plan.stores])


def test_chunked_prefill_stores_only_fully_computed_blocks():
    # 14 prompt tokens = 3 full blocks + 2; computed 6, 10, then 14 tokens. A block whose
    # KV is only partly written must not be copied: its host copy would be garbage.
    manager, sched = make()
    req = Req("a", list(range(14)))
    assert sched.match(req, 0) == 0
    sched.on_allocated("a", [[10, 11, 12, 13]], 0)
    expected = [(6, [10], [0], 0), (10, [11], [1], 1), (14, [12], [2], 2)]
    for computed, device, host, block in expected:
        (store,) = sched.build_step([StepRequest("a", None, computed)]).stores
        assert (ids(store.src_spec), ids(store.dst_spec)) == (device, host)
        assert store.src_spec.block_indices.tolist() == [block]
        sched.complete_jobs([(store.job_id, True)])
        lookups = [manager.lookup(key(req, j)) for j in range(3)]
        assert lookups == [HIT] * (block + 1) + [MISS] * (2 - block)
    # the partial fourth block is never stored, however far decode goes without new blocks
    assert sched.build_step([StepRequest("a", None, 14)]).stores == []
    assert manager.stats().used == 3


def test_chunked_prefill_two_groups_with_offload_factor():
    # group 0: 4-token device blocks, group 1: 8-token ones; F = 2, so offloaded blocks are
    # 8 and 16 tokens. 36 prompt tokens computed 12, 20, then 36 at a time.
    manager, sched = make(num_blocks=32, groups=(KVGroup(4), KVGroup(8)), factor=2)
    req = Req("a", list(range(36)))
    assert sched.match(req, 0) == 0
    sched.on_allocated("a", [list(range(9)), [20, 21, 22, 23, 24]], 0)
    # (computed, device ids, group sizes, block indices, host ids)
    expected = [
        (12, [0, 1], [2, 0], [0, 0], [0]),  # group 0: block 0 (8 tokens); group 1: none of 16
        (20, [2, 3, 20, 21], [2, 2], [2, 0], [1, 2]),
        (36, [4, 5, 6, 7, 22, 23], [4, 2], [4, 2], [3, 4, 5]),
    ]
    for computed, device, sizes, indices, host in expected:
        (store,) = sched.build_step([StepRequest("a", None, computed)]).stores
        assert ids(store.src_spec) == device and ids(store.dst_spec) == host
        assert store.src_spec.group_sizes.tolist() == sizes
        assert store.src_spec.block_indices.tolist() == indices
        sched.complete_jobs([(store.job_id, True)])
    # one offloaded block of group 0 spans 2 hashes, of group 1 4 hashes
    assert [manager.lookup(key(req, j, 0, 2)) for j in range(4)] == [HIT] * 4
    assert [manager.lookup(key(req, j, 1, 4)) for j in range(2)] == [HIT] * 2
    assert manager.stats().used == 6


def test_resumed_request_stores_from_its_new_device_blocks():
    # Preempted after 8 of 16 tokens: the engine frees device blocks 0-3 and, on resume,
    # hands out 40-43 in their place. Stores must read the new blocks, never the old ones
    # (which now belong to someone else).
    manager, sched = make()
    req = Req("a", list(range(16)))
    sched.match(req, 0)
    sched.on_allocated("a", [[0, 1, 2, 3]], 0)
    (store,) = sched.build_step([StepRequest("a", None, 8)]).stores
    assert ids(store.src_spec) == [0, 1]
    sched.complete_jobs([(store.job_id, True)])
    assert sched.build_step([], preempted=["a"]).flush == {}  # nothing in flight
    resume = StepRequest("a", [[40, 41, 42, 43]], 12, replace_block_ids=True)
    (store,) = sched.build_step([resume]).stores
    assert ids(store.src_spec) == [42] and ids(store.dst_spec) == [2]
    assert store.src_spec.block_indices.tolist() == [2]
    (store2,) = sched.build_step([StepRequest("a", None, 16)]).stores
    assert ids(store2.src_spec) == [43] and ids(store2.dst_spec) == [3]
    sched.complete_jobs([(store.job_id, True), (store2.job_id, True)])
    assert [manager.lookup(key(req, j)) for j in range(4)] == [HIT] * 4


def test_preemption_flushes_exactly_the_preempted_requests_jobs():
    # A preempted request's device blocks are about to be reused: every job still reading
    # or writing them (its load and its store) must be flushed first; others must not be.
    manager, sched = make()
    prefill(sched, Req("a", list(range(12))), [[0, 1, 2]])
    sched.request_finished("a")
    b = Req("b", list(range(20)))
    assert sched.match(b, 0) == 12
    sched.on_allocated("b", [[10, 11, 12, 13, 14]], 12)
    c = Req("c", [100 + i for i in range(8)])
    sched.match(c, 0)
    sched.on_allocated("c", [[20, 21]], 0)
    plan = sched.build_step([StepRequest("b", None, 16), StepRequest("c", None, 4)])
    (load,) = plan.loads
    (b_store,) = plan.stores  # one job for both requests' blocks
    assert (load.req_id, b_store.req_id) == ("b", "")
    assert ids(b_store.src_spec) == [13, 20]  # b's blocks 0-2 already offloaded: only block 3 is new
    d = Req("d", [200 + i for i in range(4)])  # scheduled, nothing in flight
    sched.match(d, 0)
    sched.on_allocated("d", [[30]], 0)
    plan = sched.build_step([StepRequest("c", None, 8)], preempted=["b", "d", "unknown"])
    assert plan.flush == {"b": sorted([load.job_id, b_store.job_id])}
    assert [s.req_id for s in plan.stores] == ["c"]
    assert sched.build_step([]).flush == {}  # said once
    sched.complete_jobs([(j.job_id, True) for j in (load, b_store, *plan.stores)])
    assert manager.stats().pinned == 0


def test_finishing_before_the_load_is_sent_releases_its_pins():
    # The load was planned (keys pinned) but the request is aborted before the next step:
    # the load never runs, so its pins must go now, or those host blocks stay unevictable
    # for good.
    manager, sched = make(num_blocks=3)
    a = Req("a", list(range(12)))
    prefill(sched, a, [[0, 1, 2]])
    sched.request_finished("a")
    b = Req("b", list(range(12)))
    assert sched.match(b, 0) == 11
    sched.on_allocated("b", [[5, 6, 7]], 11)
    assert manager.stats().pinned == 3
    must_hold = sched.request_finished("b")
    assert manager.stats().pinned == 0
    # cancelled, not failed: nothing was handed to the engine and nothing went wrong
    assert (sched.stats.tokens_loaded, sched.stats.failed_loads, sched.stats.blocks_loaded) == (0, 0, 0)
    assert must_hold is False  # its only job was dropped: no device blocks to hold
    plan = sched.build_step([])
    assert plan.loads == [] and plan.hold_blocks == {} and plan.flush == {}
    assert sched.take_freeable() == set() and sched.num_requests == 0
    sched.take_events()
    # the tier is full; a new prompt of 3 blocks needs all of a's blocks evicted
    c = Req("c", [100 + i for i in range(12)])
    sched.match(c, 0)
    sched.on_allocated("c", [[8, 9, 10]], 0)
    (store,) = sched.build_step([StepRequest("c", None, 12)]).stores
    # which freed slot goes to which key is the eviction order's business, not this test's
    assert ids(store.src_spec) == [8, 9, 10] and sorted(ids(store.dst_spec)) == [0, 1, 2]
    assert [manager.lookup(key(a, j)) for j in range(3)] == [MISS] * 3
    (removed,) = sched.take_events()
    assert isinstance(removed, BlockRemoved)
    assert sorted(removed.block_hashes) == sorted(external_hash(h) for h in a.block_hashes)


def test_a_hit_makes_the_matched_block_most_recent():
    # A, B, C stored in that order (A least recent). A new request hitting A refreshes it,
    # so the next eviction takes B, not the block that was just found useful.
    manager, sched = make(num_blocks=3)
    blocks = {
        name: Req(name, [base + i for i in range(4)]) for name, base in (("A", 0), ("B", 100), ("C", 200))
    }
    for req in blocks.values():
        prefill(sched, req, [[0]])
        sched.request_finished(req.request_id)
    assert sched.match(Req("d", list(range(5))), 0) == 4  # A's 4 tokens + 1 to compute
    sched.take_events()
    prefill(sched, Req("e", [300 + i for i in range(4)]), [[1]])
    assert [manager.lookup(key(blocks[n], 0)) for n in "ABC"] == [HIT, MISS, HIT]
    (removed, _stored) = sched.take_events()
    assert removed == BlockRemoved(
        block_hashes=[external_hash(blocks["B"].block_hashes[0])], medium="CPU", group_idx=0
    )


def test_a_request_touches_its_blocks_once_however_often_it_is_matched():
    # An engine re-asks match() every step while a request waits; each re-ask must not
    # refresh its blocks again, or a waiting request would outrank newer hits.
    manager, sched = make(num_blocks=3)
    blocks = {
        name: Req(name, [base + i for i in range(4)]) for name, base in (("A", 0), ("B", 100), ("C", 200))
    }
    for req in blocks.values():
        prefill(sched, req, [[0]])
        sched.request_finished(req.request_id)
    d = Req("d", list(range(5)))
    sched.match(d, 0)  # order now B, C, A
    sched.match(Req("f", [200 + i for i in range(5)]), 0)  # order now B, A, C
    assert sched.match(d, 0) == 4  # re-asked: A must stay where it was
    prefill(sched, Req("e", [300 + i for i in range(8)]), [[1, 2]])  # needs 2 slots
    assert [manager.lookup(key(blocks[n], 0)) for n in "ABC"] == [MISS, MISS, HIT]
