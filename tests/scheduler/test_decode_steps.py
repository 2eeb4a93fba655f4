"""Decode steps in their cheap form: ``build_step(..., running=[(req_id, computed)])``, and
``StepRequest``s without new device blocks, plan exactly what planning every request in
full plans, step by step."""

import pytest

from kvoffload.cpu import CPUOffloadingManager
from kvoffload.scheduler import KVGroup, OffloadingScheduler, StepRequest
from scheduler_requests import HASHER, Req

CONFIGS = {
    "one group": ((KVGroup(4),), 1),
    "two groups, offloaded blocks of 2": ((KVGroup(4), KVGroup(8)), 2),
    "a draft layer's volatile tail": ((KVGroup(4), KVGroup(4, volatile_tail=True)), 1),
}


def scheduler(groups, factor, prompt_only):
    manager = CPUOffloadingManager(4096, "lru", enable_events=True)
    return OffloadingScheduler(
        manager,
        groups,
        hash_block_size=4,
        blocks_per_offload_block=factor,
        offload_prompt_only=prompt_only,
    )


def drive(groups, factor, prompt_only, cheap):
    """Three requests decoding 40 tokens (their device blocks allocated up front, but the
    last one's, which come one step in five): what each step planned, as comparable data."""
    sched = scheduler(groups, factor, prompt_only)
    requests = [Req(f"r{i}", [i * 100 + t for t in range(10 + 3 * i)]) for i in range(3)]
    late = requests[-1]
    next_block = 1
    for req in requests:
        sched.match(req, 0)
        tokens = len(req.all_token_ids) + (0 if req is late else 40)
        ids = []
        for group in groups:
            count = -(-tokens // group.block_size)
            ids.append(list(range(next_block, next_block + count)))
            next_block += count
        sched.on_allocated(req.request_id, ids, 0)
    trace = []
    for step in range(41):
        scheduled, running = [], []
        for req in requests:
            computed = len(req.all_token_ids) if step else req.num_prompt_tokens
            new_ids = None
            if req is late and step and step % 5 == 0:  # its blocks for the next five tokens
                new_ids = []
                for group in groups:
                    new_ids.append(list(range(next_block, next_block + -(-5 // group.block_size) + 1)))
                    next_block += len(new_ids[-1])
            if cheap and new_ids is None and step:
                running.append((req.request_id, computed))
            elif cheap:
                scheduled.append(StepRequest(req.request_id, new_ids, computed))
            else:  # no device block added, said so that every request is planned in full
                scheduled.append(StepRequest(req.request_id, new_ids or [[] for _ in groups], computed))
        plan = sched.build_step(scheduled, (), running)
        trace.append(
            sorted(
                (job.req_id, job.src_spec.block_ids.tolist(), job.dst_spec.block_ids.tolist())
                for job in plan.stores
            )
        )
        sched.complete_jobs([(job.job_id, True) for job in plan.stores])
        for req in requests:
            req.all_token_ids.append(7)
            req.block_hashes = HASHER.hash_request(req.all_token_ids, 4)
    return trace, sched.take_events(), sched.manager.stats()


@pytest.mark.parametrize("prompt_only", [False, True])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_running_requests_plan_the_same_stores_as_step_requests(config, prompt_only):
    groups, factor = CONFIGS[config]
    full = drive(groups, factor, prompt_only, cheap=False)
    cheap = drive(groups, factor, prompt_only, cheap=True)
    assert cheap[0] == full[0]
    assert cheap[1] == full[1]  # the same BlockStored events
    assert cheap[2] == full[2]
    stored_steps = [i for i, stores in enumerate(full[0]) if stores]
    if prompt_only:
        assert stored_steps == [0]  # the prompts only
    else:
        assert len(stored_steps) > 5  # decoding filled blocks, and they were stored


def test_a_running_request_the_scheduler_does_not_know_is_skipped():
    sched = scheduler((KVGroup(4),), 1, False)
    plan = sched.build_step([], (), [("nobody", 12)])
    assert plan.stores == []
