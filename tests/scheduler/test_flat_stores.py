"""The block-completion step planned in one pass (``kvoffload.scheduler.running``) plans
exactly what planning each request with ``_offer`` and ``_store_jobs`` plans, step by step:
the same jobs (ids, requests, device and host blocks), the same tier calls, the same
``BlockStored`` events, the same ends of requests; and events built as an engine's own
classes say field for field what the default ones say."""

import msgspec
import pytest

from kvoffload.cpu import CPUOffloadingManager
from kvoffload.events.types import AllBlocksCleared, BlockRemoved, BlockStored
from kvoffload.scheduler import KVGroup, OffloadingScheduler, RunningRequests, StepRequest
from scheduler_requests import HASHER, Recording, Req


class Extra:
    """Extra keys for the blocks of requests named ``s*`` (a salted tenant with an adapter),
    none otherwise."""

    def __call__(self, request, start, end):
        if not request.request_id.startswith("s"):
            return None
        return (("lora", "ad1", "/ad1"),) + ((("cache_salt", "t1"),) if start == 0 else ())


ONE_GROUP = (KVGroup(4),)

CASES = {
    "lockstep": {},
    "offload prompt only": {"prompt_only": True},
    "a draft layer's volatile tail": {"groups": (KVGroup(4, volatile_tail=True),)},
    "null blocks": {"nulls": True},
    "prefix loaded from the tier": {"loaded": True},
    "two requests with the same tokens": {"twins": True},
    "a tier without room for all": {"num_blocks": 14},
    "requests the scheduler hashes": {"unhashed": True},
    "failed stores": {"fail": True},
    "a salted tenant": {"salted": True},
    "prompts computed a block a step": {"chunked": True, "salted": True},
    "a loaded prefix computed a block a step": {"chunked": True, "loaded": True},
    "requests finishing with their stores in flight": {"finish_at": 4},
    "requests finishing with their stores failing": {"finish_at": 8, "fail": True},
}


def drive(
    batch,
    groups=ONE_GROUP,
    prompt_only=False,
    nulls=False,
    loaded=False,
    twins=False,
    num_blocks=4096,
    unhashed=False,
    fail=False,
    salted=False,
    finish_at=None,
    chunked=False,
):
    """Eight requests computing their prompts and decoding 30 tokens, five of them in
    lockstep, all but one in the cheap form (``RunningRequests``; the other one is handed
    over as a ``StepRequest``, with new device blocks every fifth step), the tier reset
    half-way (``finish_at``: two lockstep requests finish at that step, before its jobs
    complete; ``chunked``: the engine says a block more computed each step until its prompt
    is): per step, what was planned. The reference (``batch=False``) converts tier
    events run by run too (``one_block_runs``)."""
    manager = Recording(num_blocks, "lru", enable_events=True)
    sched = OffloadingScheduler(
        manager,
        groups,
        hash_block_size=4,
        offload_prompt_only=prompt_only,
        null_block_id=0 if nulls else None,
        block_extra_keys=Extra() if salted else None,
    )
    sched.batch_stores = batch
    sched._events.one_block_runs = batch
    trace = []
    ends = []  # (finish_at) each step's freeable requests, and the finished ones' answers
    if loaded:  # an earlier turn stored the first three blocks every request starts with
        first = Req("w", list(range(12)), hashed=not unhashed)
        sched.match(first, 0)
        sched.on_allocated("w", [[900, 901, 902]], 0)
        plan = sched.build_step([StepRequest("w", None, 12)])
        sched.complete_jobs([(job.job_id, True) for job in plan.stores])
        sched.request_finished("w")
    lengths = [8, 8, 8, 8, 8, 9, 11, 14]
    requests = []
    for i, n in enumerate(lengths):
        tokens = [1000 * i + t for t in range(n)]
        if loaded:
            tokens = list(range(12)) + tokens
        if twins and i == 1:
            tokens = list(requests[0].all_token_ids)
        name = f"s{i}" if salted and i % 2 else f"r{i}"
        requests.append(Req(name, tokens, hashed=not unhashed))
    late = requests[3]
    next_block = 1
    device = {}
    for req in requests:
        hit = sched.match(req, 0)
        tokens = len(req.all_token_ids) + (0 if req is late else 30)
        count = -(-tokens // 4)
        ids = list(range(next_block, next_block + count))
        if nulls:
            ids[: 1 + len(device) % 3] = [0] * (1 + len(device) % 3)
        next_block += count
        device[req.request_id] = ids
        sched.on_allocated(req.request_id, [ids], hit or 0)
    for step in range(31):
        scheduled, ids, computed, new = [], [], [], []
        for req in requests:
            tokens = len(req.all_token_ids) if step else req.num_prompt_tokens
            if chunked:
                tokens = min(tokens, 4 * (step + 1))
            if req is late and step == 0 and not chunked:  # (chunked: its block 0 in the one pass)
                scheduled.append(StepRequest(req.request_id, None, tokens))
            elif req is late and step and step % 5 == 0:
                blocks = list(range(next_block, next_block + 2))
                next_block += 2
                scheduled.append(StepRequest(req.request_id, [blocks], tokens))
            else:
                ids.append(req.request_id)
                computed.append(tokens)
                new.append(None)
        plan = sched.build_step(scheduled, (), RunningRequests(ids, computed, new))
        trace.append(
            [
                (job.job_id, job.req_id, job.src_spec.block_ids.tolist(), job.dst_spec.block_ids.tolist())
                for job in plan.loads + plan.stores
            ]
        )
        if step == finish_at:
            ends.append([(req.request_id, sched.request_finished(req.request_id)) for req in requests[1:3]])
            del requests[1:3]
        results = [(job.job_id, True) for job in plan.loads]
        results += [(job.job_id, not (fail and job.job_id % 3 == 0)) for job in plan.stores]
        sched.complete_jobs(results)
        ends.append(sorted(sched.take_freeable()))
        if step == 15:  # every request offers its blocks from the first again
            sched.reset()
        trace.append([tuple(msgspec.structs.astuple(e)) for e in sched.take_events()])
        for req in requests:
            req.all_token_ids.append(7 + step)
            if not unhashed:
                req.block_hashes = HASHER.hash_request(req.all_token_ids, 4)
    for req in requests:
        assert not sched.request_finished(req.request_id)
    return trace, manager.calls, manager.stats(), sched.stats, ends


@pytest.mark.parametrize("case", list(CASES))
def test_one_pass_plans_what_request_by_request_plans(case):
    flat = drive(True, **CASES[case])
    reference = drive(False, **CASES[case])
    assert flat[0] == reference[0]  # plans and events, step by step
    assert flat[1] == reference[1]  # tier calls and request ends
    assert flat[2] == reference[2]
    assert flat[3] == reference[3]
    assert flat[4] == reference[4]
    if CASES[case].get("finish_at"):  # held while their store ran, then freed
        (answers,) = [e for e in flat[4] if e and isinstance(e[0], tuple)]
        assert answers == [("r1", True), ("r2", True)]
        assert ["r1", "r2"] in flat[4]
    if not CASES[case].get("prompt_only"):  # (else nothing is stored past the prompts)
        # the lockstep requests completed blocks together: a decode step stored them in one job
        assert any(job[1] == "" for plan in flat[0][2::2] for job in plan)


def test_the_lockstep_step_is_one_job_with_one_event_per_request():
    trace = drive(True)[0]
    plans, events = trace[0::2], trace[1::2]
    step = 4  # the requests of 8 prompt tokens reach 12 (the late one has no device block 2 yet)
    ((job_id, req_id, device, host),) = plans[step]
    assert req_id == "" and len(device) == len(host) == 4  # block 2 of each of the four
    # one BlockStored each (four chains), each of one block of 4 tokens
    assert [(len(e[0]), len(e[2])) for e in events[step]] == [(1, 4)] * 4


class Stored(BlockStored):
    pass


class Removed(BlockRemoved):
    pass


class Cleared(AllBlocksCleared):
    pass


def test_events_built_as_an_engines_own_classes_say_the_same():
    runs = []
    for classes in (None, {BlockStored: Stored, BlockRemoved: Removed, AllBlocksCleared: Cleared}):
        manager = CPUOffloadingManager(6, "lru", enable_events=True)  # evicts: BlockRemoved too
        sched = OffloadingScheduler(manager, (KVGroup(4),), hash_block_size=4, event_classes=classes)
        events = []
        for i in range(3):
            req = Req(f"r{i}", [100 * i + t for t in range(13)])
            sched.match(req, 0)
            sched.on_allocated(req.request_id, [[10 * i + j for j in range(4)]], 0)
            plan = sched.build_step([StepRequest(req.request_id, None, 13)])
            sched.complete_jobs([(job.job_id, True) for job in plan.stores])
            events += sched.take_events()
        sched.reset()
        events += sched.take_events()
        runs.append(events)
    default, own = runs
    assert [type(e) for e in own] == [
        {BlockStored: Stored, BlockRemoved: Removed, AllBlocksCleared: Cleared}[type(e)] for e in default
    ]
    assert {type(e) for e in default} == {BlockStored, BlockRemoved, AllBlocksCleared}
    assert [msgspec.structs.astuple(e) for e in own] == [msgspec.structs.astuple(e) for e in default]


def test_a_tenants_blocks_say_its_extra_keys_in_the_one_pass_step():
    trace = drive(True, salted=True)[0]
    stored = [e for events in trace[1::2] for e in events if len(e) > 7 and e[6] == "ad1"]
    # block 0 with the salt, the others the adapter only; one-block runs of decode steps too
    assert [("ad1", "t1")] in [e[7][:1] for e in stored]
    assert any(e[7] == [("ad1",)] and len(e[0]) == 1 for e in stored)
    others = [e for events in trace[1::2] for e in events if len(e) > 7 and e not in stored]
    assert others and all(e[6] is None and e[7] is None for e in others)
