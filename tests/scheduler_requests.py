"""Requests as an engine hands them to the scheduler, for the scheduler's tests.

``Req(request_id, all_token_ids)``: a minimal engine request whose block hashes the engine
computed every ``block_size`` (4) tokens, as vLLM does (``hashed=False``: none, the
scheduler hashes). ``run_prefill``: match, allocate, one step computing the whole prompt,
its jobs completed. ``HASHER`` is the hasher both use. ``Recording``: the CPU tier,
recording the stores asked of it and each request's end.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvoffload.cpu import CPUOffloadingManager
from kvoffload.keys import BlockHasher
from kvoffload.scheduler import StepRequest

HASHER = BlockHasher()


@dataclass
class Req:
    request_id: str
    all_token_ids: list[int]
    num_prompt_tokens: int = 0
    hashed: bool = True
    block_size: int = 4
    block_hashes: list[bytes] | None = field(default=None)

    def __post_init__(self):
        self.num_prompt_tokens = self.num_prompt_tokens or len(self.all_token_ids)
        if self.hashed:
            self.block_hashes = HASHER.hash_request(self.all_token_ids, self.block_size)


def run_prefill(sched, req, block_ids, computed=0):
    """Match, allocate, then one step that computes the whole prompt; completes jobs."""
    n = sched.match(req, computed)
    sched.on_allocated(req.request_id, block_ids, n)
    plan = sched.build_step([StepRequest(req.request_id, None, req.num_prompt_tokens)])
    sched.complete_jobs([(job.job_id, True) for job in plan.loads + plan.stores])
    return n, plan


class Recording(CPUOffloadingManager):
    """The CPU tier, recording what the scheduler asked of it (``calls``) and each request's end."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = []

    def prepare_store(self, keys):
        out = super().prepare_store(keys)
        self.calls.append(("prepare_store", list(keys), None if out is None else list(out.keys_to_store)))
        return out

    def complete_store(self, keys, success=True):
        self.calls.append(("complete_store", list(keys), success))
        super().complete_store(keys, success)

    def on_request_finished(self, request, key_groups, inserted, reused):
        self.calls.append(("finished", request.request_id, key_groups, sorted(inserted), sorted(reused)))
        super().on_request_finished(request, key_groups, inserted, reused)
