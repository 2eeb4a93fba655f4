"""Groups that are not plain attention: recurrent-state groups (Mamba/GDN, ``kind="mamba"``),
groups the engine does not transfer (``offloaded=False``), and draft groups whose last
block is volatile while a request decodes (``volatile_tail``)."""

import pytest

from kvoffload.cpu import CPUOffloadingManager
from kvoffload.keys import make_offload_key
from kvoffload.scheduler import KVGroup, OffloadingScheduler, StepRequest
from scheduler_requests import HASHER, Req

NULL = 0
ATTN, STATE = KVGroup(4), KVGroup(4, "mamba")


def make(groups, num_blocks=32):
    manager = CPUOffloadingManager(num_blocks, "lru", enable_events=True)
    sched = OffloadingScheduler(manager, groups, hash_block_size=4, null_block_id=NULL)
    return manager, sched


def done(sched, plan):
    sched.complete_jobs([(job.job_id, True) for job in plan.loads + plan.stores])


def key(req, j, g):
    return make_offload_key(req.block_hashes[j], g)


def test_a_state_group_stores_the_states_the_engine_names_under_their_boundary():
    manager, sched = make((STATE, ATTN))
    req = Req("a", list(range(18)))  # 4 whole blocks of 4 tokens
    assert sched.match(req, 0) == 0
    sched.on_allocated("a", [[NULL, NULL, NULL, 41, 42], [1, 2, 3, 4, 5]], 0)
    # one chunk computes 16 tokens; the engine wrote the state after 16 into block 41,
    # and names a state off a boundary of ours (18) and one at the null block: both skipped
    states = [(0, 41, 16), (0, 42, 18), (0, NULL, 8)]
    plan = sched.build_step([StepRequest("a", None, 16, states=states)])
    (store,) = plan.stores
    assert store.src_spec.block_ids.tolist() == [41, 1, 2, 3, 4]
    assert store.src_spec.group_sizes.tolist() == [1, 4]
    done(sched, plan)
    assert manager.lookup_prefix([key(req, 3, 0)]) == 1  # the state after 16 tokens
    assert manager.lookup_prefix([key(req, j, 0) for j in range(3)]) == 0  # no earlier state


def test_a_hit_ends_on_a_stored_state_and_loads_that_one_state():
    manager, sched = make((STATE, ATTN))
    first = Req("a", list(range(18)))
    sched.match(first, 0)
    sched.on_allocated("a", [[NULL, 41, NULL, 43, 44], [1, 2, 3, 4, 5]], 0)
    plan = sched.build_step([StepRequest("a", None, 16, states=[(0, 41, 8), (0, 43, 16)])])
    done(sched, plan)
    assert sched.request_finished("a") is False

    # Same 16-token prefix, longer prompt: the attention hit is 16 tokens, the last state
    # at or before it is the one after 16.
    req = Req("b", list(range(16)) + [99] * 6)
    assert sched.match(req, 0) == 16
    sched.on_allocated("b", [[NULL, NULL, NULL, 53, 54, 55], [11, 12, 13, 14, 15, 16]], 16)
    (load,) = sched.build_step([]).loads
    assert load.dst_spec.block_ids.tolist() == [53, 11, 12, 13, 14]
    assert load.dst_spec.group_sizes.tolist() == [1, 4]
    assert load.dst_spec.block_indices.tolist() == [3, 0]


def test_without_the_state_at_the_end_of_the_attention_hit_an_earlier_one_bounds_it():
    manager, sched = make((STATE, ATTN))
    first = Req("a", list(range(18)))
    sched.match(first, 0)
    sched.on_allocated("a", [[NULL, 41, NULL, NULL, 44], [1, 2, 3, 4, 5]], 0)
    done(sched, sched.build_step([StepRequest("a", None, 16, states=[(0, 41, 8)])]))
    sched.request_finished("a")
    req = Req("b", list(range(16)) + [99] * 6)
    assert sched.match(req, 0) == 8  # 16 attention tokens, but the last state is after 8
    assert sched.match(Req("c", list(range(16)) + [7]), 4) == 4  # from the engine's own 4
    assert sched.match(Req("d", [5] * 20), 0) == 0


def test_groups_not_offloaded_are_neither_stored_nor_loaded_nor_bound_a_hit():
    manager, sched = make((KVGroup(4, "not_offloaded", offloaded=False), ATTN))
    req = Req("a", list(range(13)))
    sched.match(req, 0)
    sched.on_allocated("a", [[21, 22, 23, 24], [1, 2, 3, 4]], 0)
    plan = sched.build_step([StepRequest("a", None, 13)])
    (store,) = plan.stores
    assert store.src_spec.group_sizes.tolist() == [0, 3] and store.src_spec.block_ids.tolist() == [1, 2, 3]
    done(sched, plan)
    sched.request_finished("a")
    assert sched.match(Req("b", list(range(13))), 0) == 12
    sched.on_allocated("b", [[31, 32, 33, 34], [5, 6, 7, 8]], 12)
    (load,) = sched.build_step([]).loads
    assert load.dst_spec.group_sizes.tolist() == [0, 3]


def test_a_draft_groups_last_block_waits_for_the_next_one_while_decoding():
    manager, sched = make((ATTN, KVGroup(4, volatile_tail=True)))
    req = Req("a", list(range(8)))
    sched.match(req, 0)
    sched.on_allocated("a", [[1, 2, 3], [11, 12, 13]], 0)
    plan = sched.build_step([StepRequest("a", None, 8)])  # the prefill: not decoding yet
    assert plan.stores[0].src_spec.group_sizes.tolist() == [2, 2]
    done(sched, plan)
    req.all_token_ids += [8, 9, 10, 11]  # decoded tokens complete block 2 at 12 tokens
    req.block_hashes = HASHER.hash_request(req.all_token_ids, 4)
    plan = sched.build_step([StepRequest("a", None, 12)])
    assert plan.stores[0].src_spec.group_sizes.tolist() == [1, 0]  # the draft block waits
    done(sched, plan)
    req.all_token_ids += [12, 13, 14, 15]
    req.block_hashes = HASHER.hash_request(req.all_token_ids, 4)
    sched.on_allocated("a", [[1, 2, 3, 4], [11, 12, 13, 14]], 0)
    plan = sched.build_step([StepRequest("a", None, 16)])
    assert plan.stores[0].src_spec.group_sizes.tolist() == [1, 1]
    assert plan.stores[0].src_spec.block_ids.tolist() == [4, 13]


def test_state_groups_need_one_device_block_per_offloaded_block():
    manager = CPUOffloadingManager(8, "lru")
    with pytest.raises(ValueError, match="blocks_per_offload_block must be 1, got 2"):
        OffloadingScheduler(manager, (STATE, ATTN), hash_block_size=4, blocks_per_offload_block=2)
    with pytest.raises(ValueError, match="no KV-cache group is offloaded"):
        OffloadingScheduler(manager, (KVGroup(4, offloaded=False),), hash_block_size=4)


def test_a_state_block_handed_out_again_waits_for_the_store_reading_it():
    """A state's block is the engine's to reuse once a later state is written: a store
    still copying from it must complete before the step that reuses it (``flush``)."""
    manager, sched = make((STATE, ATTN))
    sched.match(Req("a", list(range(18))), 0)
    sched.on_allocated("a", [[NULL, NULL, NULL, 41, 42], [1, 2, 3, 4, 5]], 0)
    (store,) = sched.build_step([StepRequest("a", None, 16, states=[(0, 41, 16)])]).stores
    sched.match(Req("b", [9] * 10), 0)
    sched.on_allocated("b", [[], []], 0)
    plan = sched.build_step([StepRequest("b", [[41], [6]], 4)])  # block 41 reused by b
    assert plan.flush == {"a": [store.job_id]}
    sched.complete_jobs([(store.job_id, True)])
    plan = sched.build_step([StepRequest("b", [[41], [7]], 8)])
    assert plan.flush == {}  # flushed once; a completed store fences nothing


def test_offload_prompt_only_stores_no_block_an_answer_fills():
    manager = CPUOffloadingManager(32, "lru", enable_events=True)
    sched = OffloadingScheduler(
        manager, (STATE, ATTN), hash_block_size=4, null_block_id=NULL, offload_prompt_only=True
    )
    req = Req("a", list(range(10)))  # 2 whole prompt blocks, then decoded tokens
    sched.match(req, 0)
    sched.on_allocated("a", [[NULL, 41, 42], [1, 2, 3]], 0)
    plan = sched.build_step([StepRequest("a", None, 10, states=[(0, 41, 8)])])
    assert plan.stores[0].src_spec.group_sizes.tolist() == [1, 2]
    done(sched, plan)
    req.all_token_ids += list(range(10, 20))  # the answer fills blocks 2..4
    req.block_hashes = HASHER.hash_request(req.all_token_ids, 4)
    sched.on_allocated("a", [[NULL, 41, 42, 43, 44], [1, 2, 3, 4, 5]], 0)
    assert sched.build_step([StepRequest("a", None, 20, states=[(0, 44, 20)])]).stores == []


def test_vllm_hands_over_a_state_of_a_request_it_did_not_schedule_this_step():
    """vLLM's boundary-state hand-offs may name a request with no tokens this step: the
    connector's scheduler half still plans the store."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from kvoffload.integrations.vllm.scheduler_side import SchedulerSide

    side = object.__new__(SchedulerSide)  # only the translation of vLLM's scheduler output
    manager, side.scheduler = make((STATE, ATTN))
    req = Req("a", list(range(18)))
    side.scheduler.match(req, 0)
    side.scheduler.on_allocated("a", [[NULL, NULL, NULL, 41, 42], [1, 2, 3, 4, 5]], 0)
    cached = SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[])  # 0.34's shape
    out = SimpleNamespace(
        scheduled_new_reqs=[], scheduled_cached_reqs=cached, num_scheduled_tokens={},
        total_num_scheduled_tokens=0, preempted_req_ids=set(),
        kv_connector_block_state=SimpleNamespace(boundary_state_offloads={"a": [(0, 41, 16)]}),
    )  # fmt: skip
    (store,) = side.build_connector_meta(out).plan.stores
    assert store.src_spec.block_ids.tolist() == [41] and store.src_spec.group_sizes.tolist() == [1, 0]
