"""The engine-agnostic scheduler, driven as an engine would drive it."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload.cpu import CPUOffloadingManager
from kvoffload.events.types import AllBlocksCleared, BlockRemoved, BlockStored
from kvoffload.keys import BlockHasher, external_hash, make_offload_key
from kvoffload.manager import LookupResult
from kvoffload.policies import LRUPolicy
from kvoffload.scheduler import KVGroup, OffloadingScheduler, StepRequest
from scheduler_requests import HASHER, Req, run_prefill

ONE_GROUP = (KVGroup(4),)


def make(num_blocks=16, groups=ONE_GROUP, factor=1, policy="lru", mode="self_describing"):
    manager = CPUOffloadingManager(num_blocks, policy, enable_events=True)
    return manager, OffloadingScheduler(
        manager, groups, hash_block_size=4, blocks_per_offload_block=factor, kv_events=mode
    )


def test_stores_full_blocks_only_and_emits_self_describing_events():
    manager, sched = make()
    req = Req("a", list(range(10)))  # 2 full blocks of 4, 2 tokens partial
    n, plan = run_prefill(sched, req, [[7, 8, 9]])
    assert n == 0 and plan.loads == []
    (store,) = plan.stores
    assert store.src_spec.block_ids.tolist() == [7, 8]
    assert store.src_spec.group_sizes.tolist() == [1 * 2] and store.src_spec.block_indices.tolist() == [0]
    assert store.dst_spec.block_ids.tolist() == [0, 1]
    h = req.block_hashes
    assert sched.take_events() == [
        BlockStored(
            block_hashes=[external_hash(h[0]), external_hash(h[1])],
            parent_block_hash=None,
            token_ids=list(range(8)),
            block_size=4,
            lora_id=None,
            medium="CPU",
            lora_name=None,
            group_idx=0,
            kv_cache_spec_kind="full_attention",
        )
    ]


def test_match_counts_leading_hits_and_keeps_one_token_to_compute():
    manager, sched = make()
    run_prefill(sched, Req("a", list(range(12))), [[0, 1, 2]])
    sched.request_finished("a")
    # same 12-token prompt: 3 blocks offloaded, but the engine must compute the last token
    b = Req("b", list(range(12)))
    assert sched.match(b, 0) == 11
    # the engine already has 1 block cached: 7 more from the tier
    assert sched.match(b, 4) == 7
    # a longer prompt sharing 2 blocks, then diverging
    c = Req("c", list(range(8)) + [99] * 8)
    assert sched.match(c, 0) == 8


def test_load_plan_pins_and_targets_allocated_device_blocks():
    manager, sched = make()
    run_prefill(sched, Req("a", list(range(12))), [[0, 1, 2]])
    b = Req("b", list(range(12)) + [5, 5])
    n = sched.match(b, 4)  # engine holds block 0 itself
    assert n == 8
    sched.on_allocated("b", [[10, 11, 12, 13]], n)
    assert manager.stats().pinned == 2
    plan = sched.build_step([StepRequest("b", None, 14)])
    (load,) = plan.loads
    assert load.src_spec.block_ids.tolist() == [1, 2]  # host slots of blocks 1 and 2
    assert load.dst_spec.block_ids.tolist() == [11, 12]
    assert load.dst_spec.block_indices.tolist() == [1]
    sched.complete_jobs([(load.job_id, True)])
    assert manager.stats().pinned == 0


def test_pending_store_means_ask_again():
    manager, sched = make()
    a = Req("a", list(range(8)))
    sched.match(a, 0)
    sched.on_allocated("a", [[0, 1]], 0)
    plan = sched.build_step([StepRequest("a", None, 8)])
    assert sched.match(Req("b", list(range(9))), 0) is None
    sched.complete_jobs([(plan.stores[0].job_id, True)])
    assert sched.match(Req("b", list(range(9))), 0) == 8


def test_failed_store_rolls_back_without_event_and_failed_load_unpins():
    manager, sched = make()
    a = Req("a", list(range(8)))
    sched.match(a, 0)
    sched.on_allocated("a", [[0, 1]], 0)
    plan = sched.build_step([StepRequest("a", None, 8)])
    sched.complete_jobs([(plan.stores[0].job_id, False)])
    assert sched.take_events() == []
    assert manager.lookup(make_offload_key(a.block_hashes[0], 0)) is LookupResult.MISS
    run_prefill(sched, Req("c", list(range(8))), [[0, 1]])
    b = Req("b", list(range(9)))
    n = sched.match(b, 0)
    sched.on_allocated("b", [[4, 5, 6]], n)
    plan = sched.build_step([])
    sched.complete_jobs([(plan.loads[0].job_id, False)])
    assert manager.stats().pinned == 0
    with pytest.raises(KeyError, match="unknown transfer job"):
        sched.complete_jobs([(plan.loads[0].job_id, True)])


def test_stores_follow_a_growing_request_across_steps():
    manager, sched = make()
    req = Req("a", list(range(6)))
    sched.match(req, 0)
    sched.on_allocated("a", [[0, 1]], 0)
    plan = sched.build_step([StepRequest("a", None, 6)])
    assert [j.src_spec.block_ids.tolist() for j in plan.stores] == [[0]]
    # decode: tokens appended, hashes grow, a new block is allocated
    req.all_token_ids += [6, 7, 8]
    req.block_hashes = HASHER.hash_request(req.all_token_ids, 4)
    plan2 = sched.build_step([StepRequest("a", [[2]], 9)])
    assert [j.src_spec.block_ids.tolist() for j in plan2.stores] == [[1]]
    assert plan2.stores[0].src_spec.block_indices.tolist() == [1]
    sched.complete_jobs([(j.job_id, True) for j in plan.stores + plan2.stores])
    first, second = sched.take_events()  # one event per completed store
    assert first.token_ids == [0, 1, 2, 3] and first.parent_block_hash is None
    assert second.token_ids == [4, 5, 6, 7]
    assert second.parent_block_hash == external_hash(req.block_hashes[0])


def test_finished_request_holds_blocks_until_its_stores_complete():
    manager, sched = make()
    a = Req("a", list(range(8)))
    sched.match(a, 0)
    sched.on_allocated("a", [[0, 1]], 0)
    plan = sched.build_step([StepRequest("a", None, 8)])
    assert sched.request_finished("a") is True
    plan2 = sched.build_step([])
    assert plan2.hold_blocks == {"a": [plan.stores[0].job_id]}
    assert sched.take_freeable() == set()
    sched.complete_jobs([(plan.stores[0].job_id, True)])
    assert sched.take_freeable() == {"a"}
    assert sched.num_requests == 0
    assert sched.request_finished("zzz") is False


def test_evictions_become_block_removed_and_reset_all_blocks_cleared():
    manager, sched = make(num_blocks=2)
    a = Req("a", list(range(8)))
    run_prefill(sched, a, [[0, 1]])
    sched.request_finished("a")
    b = Req("b", [50 + i for i in range(8)])
    run_prefill(sched, b, [[2, 3]])
    events = sched.take_events()
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    # a finished request's blocks are ranked deepest least recent: its tail goes first
    assert removed == [
        BlockRemoved(
            block_hashes=[external_hash(h) for h in reversed(a.block_hashes)], medium="CPU", group_idx=0
        )
    ]
    sched.request_finished("b")
    sched.reset()
    assert sched.take_events() == [AllBlocksCleared()]
    assert manager.stats().used == 0


def test_reset_with_a_store_in_flight_flushes_it_and_ignores_its_outcome():
    manager, sched = make()
    a = Req("a", list(range(12)), num_prompt_tokens=8)  # 8 prompt + 4 generated tokens
    keys = [make_offload_key(h, 0) for h in a.block_hashes[:2]]
    sched.match(a, 0)
    sched.on_allocated("a", [[0, 1, 2]], 0)
    (stale,) = sched.build_step([StepRequest("a", None, 8)]).stores
    sched.reset()  # accepted, like vLLM's offloading connector
    assert sched.take_events() == [AllBlocksCleared()]
    assert [manager.lookup(k) for k in keys] == [LookupResult.MISS] * 2
    # Next step: the worker first waits for the stale store (its host blocks are free
    # again), and the still running request offloads its blocks again.
    plan = sched.build_step([StepRequest("a", None, 9)])
    assert plan.flush == {"a": [stale.job_id]}
    (again,) = plan.stores
    assert again.dst_spec.block_ids.tolist() == [0, 1]  # the same host blocks, hence the flush
    sched.complete_jobs([(stale.job_id, True)])
    assert [manager.lookup(k) for k in keys] == [LookupResult.PENDING] * 2
    sched.complete_jobs([(again.job_id, True)])
    assert [manager.lookup(k) for k in keys] == [LookupResult.HIT] * 2
    assert sched.stats.blocks_stored == 2
    with pytest.raises(KeyError, match=f"unknown transfer job {stale.job_id}"):
        sched.complete_jobs([(stale.job_id, True)])


def test_reset_refused_between_planning_a_load_and_sending_it():
    manager, sched = make()
    a = Req("a", list(range(8)))
    run_prefill(sched, a, [[0, 1]])
    b = Req("b", list(range(8)) + [99])
    assert sched.match(b, 0) == 8
    sched.on_allocated("b", [[5, 6, 7]], 8)
    with pytest.raises(RuntimeError, match="1 loads planned but not sent"):
        sched.reset()
    (load,) = sched.build_step([]).loads
    sched.reset()  # sent: the next plan flushes it
    assert sched.build_step([]).flush == {"b": [load.job_id]}


def test_two_groups_with_different_block_sizes_and_offload_factor():
    # group 0: 4-token device blocks; group 1: 8-token device blocks; F = 2
    manager, sched = make(num_blocks=64, groups=(KVGroup(4), KVGroup(8, "sliding_window", 8)), factor=2)
    req = Req("a", list(range(20)))  # hashes every 4 tokens
    n, plan = run_prefill(sched, req, [[0, 1, 2, 3, 4], [10, 11, 12]])
    (store,) = plan.stores
    # group 0 offloads 8-token blocks: 2 of them (device 0..3); group 1 16-token blocks: 1 (device 10, 11)
    assert store.src_spec.group_sizes.tolist() == [4, 2]
    assert store.src_spec.block_ids.tolist() == [0, 1, 2, 3, 10, 11]
    events = sched.take_events()
    sizes = sorted((e.group_idx, e.block_size, len(e.block_hashes)) for e in events)
    assert sizes == [(0, 8, 2), (1, 16, 1)]
    g1 = [e for e in events if e.group_idx == 1][0]
    assert g1.block_hashes == [external_hash(req.block_hashes[3])]
    assert g1.kv_cache_spec_kind == "sliding_window" and g1.kv_cache_spec_sliding_window == 8
    sched.request_finished("a")
    # a new request with the same 20 tokens: group 1 limits the hit to 16 tokens
    b = Req("b", list(range(20)))
    assert sched.match(b, 0) == 16
    sched.on_allocated("b", [[20, 21, 22, 23, 24], [30, 31, 32]], 16)
    (load,) = sched.build_step([]).loads
    assert load.dst_spec.group_sizes.tolist() == [4, 2]
    assert load.dst_spec.block_ids.tolist() == [20, 21, 22, 23, 30, 31]


def test_placeholder_events_carry_no_tokens():
    manager, sched = make(mode="placeholder")
    run_prefill(sched, Req("a", list(range(8))), [[0, 1]])
    (event,) = sched.take_events()
    assert event.block_size == 0 and event.token_ids == [] and event.parent_block_hash is None


def test_hashes_tokens_itself_when_engine_gives_none():
    manager, sched = make()
    run_prefill(sched, Req("a", list(range(8)), hashed=False), [[0, 1]])
    sched.request_finished("a")
    assert sched.match(Req("b", list(range(9))), 0) == 8


def test_configuration_errors_name_the_value():
    manager = CPUOffloadingManager(4)
    with pytest.raises(ValueError, match="blocks_per_offload_block"):
        OffloadingScheduler(manager, [KVGroup(4)], 4, blocks_per_offload_block=0)
    with pytest.raises(ValueError, match="hash block size 3"):
        OffloadingScheduler(manager, [KVGroup(4)], 3)
    with pytest.raises(ValueError, match="kv_events"):
        OffloadingScheduler(manager, [KVGroup(4)], 4, kv_events="loud")
    with pytest.raises(ValueError, match="block_size"):
        KVGroup(0)


def test_sliding_window_null_blocks_are_neither_stored_nor_loaded():
    manager = CPUOffloadingManager(64, enable_events=True)
    sched = OffloadingScheduler(
        manager, [KVGroup(4), KVGroup(4, "sliding_window", 8)], hash_block_size=4, null_block_id=0
    )
    a = Req("a", list(range(16)))
    sched.match(a, 0)
    # the sliding-window group already dropped its first two blocks (null block 0)
    sched.on_allocated("a", [[1, 2, 3, 4], [0, 0, 7, 8]], 0)
    (store,) = sched.build_step([StepRequest("a", None, 16)]).stores
    assert store.src_spec.group_sizes.tolist() == [4, 2]
    assert store.src_spec.block_ids.tolist() == [1, 2, 3, 4, 7, 8]
    assert store.src_spec.block_indices.tolist() == [0, 2]
    sched.complete_jobs([(store.job_id, True)])
    sched.request_finished("a")
    # store the sliding-window group's first blocks too (as a request that ran them would)
    c = Req("c", list(range(16)))
    sched.match(c, 0)
    sched.on_allocated("c", [[11, 12, 13, 14], [15, 16, 17, 18]], 0)
    (store,) = sched.build_step([StepRequest("c", None, 16)]).stores
    assert store.src_spec.block_ids.tolist() == [15, 16]
    sched.complete_jobs([(store.job_id, True)])
    sched.request_finished("c")
    b = Req("b", list(range(16)) + [1])
    assert sched.match(b, 0) == 16
    # the engine gives the window's blocks only; the load skips the null positions
    sched.on_allocated("b", [[21, 22, 23, 24, 25], [0, 0, 27, 28, 29]], 16)
    (load,) = sched.build_step([]).loads
    assert load.dst_spec.group_sizes.tolist() == [4, 2]
    assert load.dst_spec.block_ids.tolist() == [21, 22, 23, 24, 27, 28]
    assert load.dst_spec.block_indices.tolist() == [0, 2]
    assert len(load.src_spec.block_ids) == 6


def test_after_a_failed_load_the_request_is_never_offered_hits_again():
    manager, sched = make()
    run_prefill(sched, Req("a", list(range(12))), [[0, 1, 2]])
    sched.request_finished("a")
    b = Req("b", list(range(13)))
    assert sched.match(b, 0) == 12
    sched.on_allocated("b", [[5, 6, 7, 8]], 12)
    (load,) = sched.build_step([]).loads
    sched.complete_jobs([(load.job_id, False)])
    assert sched.stats.failed_loads == 1
    assert sched.match(b, 0) == 0  # the engine recomputes b
    assert sched.match(Req("c", list(range(13))), 0) == 12  # other requests still hit


class _Declines(LRUPolicy):
    """Declines the keys in ``declined``."""

    admits_all = False
    declined: set = set()

    def admit(self, key):
        return key not in self.declined


def test_keys_a_policy_declines_are_not_offloaded():
    req = Req("a", list(range(13)))  # 3 full blocks of 4
    h = req.block_hashes
    _Declines.declined = {make_offload_key(h[0], 0)}
    manager, sched = make(policy=_Declines)
    n, plan = run_prefill(sched, req, [[7, 8, 9, 10]])
    (store,) = plan.stores
    assert store.src_spec.block_ids.tolist() == [8, 9]  # block 0 (device 7) left out
    assert store.src_spec.block_indices.tolist() == [1]
    (event,) = sched.take_events()
    assert isinstance(event, BlockStored)
    assert event.block_hashes == [external_hash(h[1]), external_hash(h[2])]
    assert event.parent_block_hash == external_hash(h[0]) and event.token_ids == list(range(4, 12))
    assert manager.lookup(make_offload_key(h[0], 0)) is LookupResult.MISS
    assert sched.match(Req("b", list(range(13))), 0) == 0  # the prefix starts with a miss


@settings(max_examples=200, deadline=None)
@given(
    hashes=st.lists(st.binary(min_size=1, max_size=40), min_size=0, max_size=24),
    step=st.sampled_from([1, 2, 3]),
    group=st.integers(0, 3),
    bounds=st.tuples(st.integers(0, 10), st.integers(0, 10)),
)
def test_request_block_keys_are_the_offload_keys_of_their_hashes(hashes, step, group, bounds):
    from kvoffload.scheduler.blocks import BlockKeys

    blocks = BlockKeys([16 * step] * 4, 16, BlockHasher(), None, 0)
    g = group
    start, end = min(bounds), min(max(bounds), len(hashes) // step)
    want = [make_offload_key(hashes[(j + 1) * step - 1], g) for j in range(start, end)]
    got = blocks.keys(hashes, g, start, end)
    assert got == want and all(type(key) is bytes for key in got)


class Recording(CPUOffloadingManager):
    """A CPU tier that records every key it is asked about, touched with or stored."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.asked: list = []

    def lookup(self, key):
        self.asked.append(key)
        return super().lookup(key)

    def touch(self, keys):
        self.asked += list(keys)
        return super().touch(keys)

    def prepare_store(self, keys):
        self.asked += list(keys)
        return super().prepare_store(keys)


def test_a_prompt_ending_inside_an_offloaded_block_never_keys_that_block():
    # F = 2: offloaded blocks of 8 tokens; a 12-token prompt fills one and half of the next
    manager = Recording(16, "lru", enable_events=True)
    sched = OffloadingScheduler(manager, ONE_GROUP, hash_block_size=4, blocks_per_offload_block=2)
    a = Req("a", list(range(12)))
    run_prefill(sched, a, [[0, 1, 2]])
    full = make_offload_key(a.block_hashes[1], 0)  # an offloaded block is named by its last device block
    assert set(manager.asked) == {full} and manager.stats().used == 1
    sched.request_finished("a")
    # b shares a's 12 tokens, then goes on: its second offloaded block (tokens 8-15) is not a's
    b = Req("b", list(range(12)) + [99] * 8)
    manager.asked.clear()
    assert sched.match(b, 0) == 8
    assert make_offload_key(a.block_hashes[2], 0) not in manager.asked


def test_a_request_that_finishes_after_its_first_step_has_its_prompt_stored():
    manager, sched = make()
    a = Req("a", list(range(10)))
    sched.match(a, 0)
    sched.on_allocated("a", [[0, 1, 2]], 0)
    # one step computes the whole prompt and samples the only token (max_tokens=1); the
    # engine then finishes the request before the next step is built
    plan = sched.build_step([StepRequest("a", None, 10)])
    assert sched.request_finished("a") is True
    (store,) = plan.stores
    assert store.src_spec.block_ids.tolist() == [0, 1]  # both full blocks of the prompt
    sched.complete_jobs([(store.job_id, True)])
    assert sched.match(Req("b", list(range(10))), 0) == 8
