"""Quiet decode steps (``Stores._note_running``): a step whose running requests are those
of the last pass, with no store bound written since and none advanced by the pass's
slack, skips the pass. With it on, the scheduler plans, asks of the tier, counts and
announces exactly what it does with every step passed over in full (``quiet_steps =
False``), whatever happens between steps: decode and draft tokens, rejected drafts,
chunks of prompt, requests joining, preempted, finishing, failed stores, a tier reset."""

from __future__ import annotations

import random

import msgspec
import pytest

from kvoffload.scheduler import KVGroup, OffloadingScheduler, RunningRequests, StepRequest
from scheduler_requests import HASHER, Recording, Req

ONE_GROUP = (KVGroup(4),)


def drive(quiet: bool, seed: int, prompt_only: bool = False, groups=ONE_GROUP):
    """A random run of up to 40 steps over requests that join, run, get preempted and
    finish; per step what was planned, the events, the freeable requests; then the tier's
    calls and the counters."""
    rng = random.Random(seed)
    manager = Recording(64, "lru", enable_events=True)
    sched = OffloadingScheduler(manager, groups, hash_block_size=4, offload_prompt_only=prompt_only)
    sched.quiet_steps = quiet
    trace, running, waiting, next_block = [], {}, [], 1
    skipped = 0  # steps the quiet path answered (with it on)

    def admit(n):
        nonlocal next_block
        for _ in range(n):
            name = f"r{seed}-{len(trace)}-{len(waiting)}"
            tokens = [rng.randrange(50) for _ in range(rng.choice([3, 8, 9, 16]))]
            waiting.append(Req(name, tokens))

    admit(rng.randrange(2, 6))
    for step in range(40):
        scheduled = []
        while waiting and rng.random() < 0.7:  # new requests: a chunk of their prompt first
            req = waiting.pop()
            hit = sched.match(req, 0) or 0
            blocks = list(range(next_block, next_block + 32))
            next_block += 32
            sched.on_allocated(req.request_id, [blocks], hit)
            done = min(req.num_prompt_tokens, hit + rng.choice([2, 4, 64]))
            running[req.request_id] = [req, done]
            scheduled.append(StepRequest(req.request_id, None, done))
        ids, computed = [], []
        for req_id, (req, done) in list(running.items()):
            if any(s.req_id == req_id for s in scheduled):
                continue
            move = rng.choice([1, 1, 1, 1, 2, 3, 0, -1])  # decode, drafts, idle, a rejected draft
            new = max(1, min(done + move, len(req.all_token_ids) + 1))
            while new > len(req.all_token_ids):
                req.all_token_ids.append(rng.randrange(50))
                req.block_hashes = HASHER.hash_request(req.all_token_ids, 4)
            running[req_id][1] = new
            ids.append(req_id)
            computed.append(new)
        preempted = []
        if running and rng.random() < 0.05:
            preempted = [rng.choice(sorted(running))]
        unfolded = sched._unfolded
        plan = sched.build_step(scheduled, preempted, RunningRequests(ids, computed))
        skipped += sched._unfolded is not None and sched._unfolded is not unfolded  # (a new one)
        trace.append([(j.job_id, j.req_id, j.src_spec.block_ids.tolist(), j.dst_spec.block_ids.tolist())
                      for j in plan.loads + plan.stores])  # fmt: skip
        fail = rng.random() < 0.1
        results = [(j.job_id, not fail) for j in plan.stores] + [(j.job_id, True) for j in plan.loads]
        sched.complete_jobs(results)
        for req_id in preempted:
            running.pop(req_id)
            trace.append(("finished", req_id, sched.request_finished(req_id)))
        for req_id in list(running):
            if rng.random() < 0.02:
                running.pop(req_id)
                trace.append(("finished", req_id, sched.request_finished(req_id)))
        if rng.random() < 0.08:
            admit(rng.randrange(1, 3))
        if step == 25 and rng.random() < 0.5:
            sched.reset()
        trace.append(sorted(sched.take_freeable()))
        trace.append([tuple(msgspec.structs.astuple(e)) for e in sched.take_events()])
    for req_id in running:
        trace.append(("finished", req_id, sched.request_finished(req_id)))
    return trace, manager.calls, manager.stats(), sched.stats, skipped


@pytest.mark.parametrize("seed", range(40))
def test_quiet_steps_change_nothing(seed):
    prompt_only = seed % 5 == 4
    groups = (KVGroup(4, volatile_tail=True),) if seed % 7 == 3 else (KVGroup(16 if seed % 2 else 4),)
    on = drive(True, seed, prompt_only, groups)
    off = drive(False, seed, prompt_only, groups)
    assert on[0] == off[0]  # plans, ends, freeable requests and events, step by step
    assert on[1] == off[1]  # the tier's store calls and request ends (their computed tokens)
    assert on[2] == off[2]
    assert on[3] == off[3]


def test_the_runs_above_take_quiet_steps():
    counts = [drive(True, seed, groups=(KVGroup(16 if seed % 2 else 4),))[4] for seed in range(40)]
    assert sum(counts) > 300 and sum(c > 0 for c in counts) > 30, counts
