"""The scheduler and the transfer engine together, with no engine around them: stored
device blocks come back byte for byte into other device blocks of a later request."""

import hashlib

import numpy as np
import pytest
import torch

from kvoffload.cpu import CPUOffloadingManager
from kvoffload.scheduler import KVGroup, OffloadingScheduler, StepRequest
from kvoffload.transfer import HostBlockPool, KVLayout, TransferEngine
from scheduler_requests import Req

PAGE = {0: 64, 1: 64, 2: 96}  # tensor -> page bytes; group 0 uses tensors 0 and 1, group 1 uses 2
GROUPS = (KVGroup(4), KVGroup(8, "sliding_window", 16))
NUM_DEVICE_BLOCKS = 64


def content(tensor: int, tokens: list[int], position: int) -> np.ndarray:
    """What a device page holds: a function of the layer, the block's tokens and place."""
    seed = hashlib.sha256(repr((tensor, tokens, position)).encode()).digest()
    return np.frombuffer(seed * (PAGE[tensor] // 32 + 1), dtype=np.uint8)[: PAGE[tensor]]


class Engine:
    def __init__(self, factor):
        self.device = [torch.zeros((NUM_DEVICE_BLOCKS, PAGE[t]), dtype=torch.uint8) for t in range(3)]
        layout = KVLayout(self.device, [[0, 1], [2]])
        self.manager = CPUOffloadingManager(32)
        self.transfer = TransferEngine(layout, HostBlockPool(layout, 32, factor))
        self.sched = OffloadingScheduler(
            self.manager, GROUPS, hash_block_size=4, blocks_per_offload_block=factor
        )
        self.free = list(range(1, NUM_DEVICE_BLOCKS))

    def allocate(self, n):
        ids, self.free = self.free[:n], self.free[n:]
        return ids

    def compute(self, req, block_ids, start_tokens):
        """Write the pages of every block from ``start_tokens`` on, as a forward pass would."""
        for g, group in enumerate(GROUPS):
            bs = group.block_size
            for i, block in enumerate(block_ids[g]):
                if (i + 1) * bs <= start_tokens or i * bs >= len(req.all_token_ids):
                    continue
                for t in [0, 1] if g == 0 else [2]:
                    self.device[t][block] = torch.from_numpy(
                        content(t, req.all_token_ids[i * bs : (i + 1) * bs], i).copy()
                    )

    def run_step(self, plan):
        for job in plan.loads + plan.stores:
            assert self.transfer.submit(job.job_id, job.src_spec, job.dst_spec)
        jobs = [job.job_id for job in plan.loads + plan.stores]
        self.transfer.wait(jobs)
        results = self.transfer.poll()
        assert all(r.success for r in results)
        self.sched.complete_jobs([(r.job_id, r.success) for r in results])

    def serve(self, req):
        n = len(req.all_token_ids)
        hit = self.sched.match(req, 0)
        block_ids = [self.allocate(-(-n // g.block_size)) for g in GROUPS]
        self.sched.on_allocated(req.request_id, block_ids, hit)
        self.run_step(self.sched.build_step([]))  # the load, before any compute
        loaded = {}
        for g, group in enumerate(GROUPS):
            for i, block in enumerate(block_ids[g]):
                if (i + 1) * group.block_size <= hit:
                    loaded[(g, i)] = block
        self.compute(req, block_ids, hit)
        self.run_step(self.sched.build_step([StepRequest(req.request_id, block_ids, n, True)]))
        self.sched.request_finished(req.request_id)
        return hit, block_ids, loaded


@pytest.mark.parametrize("factor", [1, 2])
def test_loaded_blocks_equal_what_was_stored(factor):
    engine = Engine(factor)
    a = Req("a", list(range(100, 148)))  # 48 tokens
    engine.serve(a)
    # another request scribbles over every device block a used, as reuse would
    engine.device[0].fill_(7), engine.device[1].fill_(7), engine.device[2].fill_(7)
    b = Req("b", list(range(100, 148)) + [1, 2, 3, 4, 5])
    hit, block_ids, loaded = engine.serve(b)
    # group 1 offloads 16 * F-token blocks: it bounds the hit
    assert hit == (48 // (8 * factor)) * 8 * factor
    assert loaded
    for (g, i), block in loaded.items():
        bs = GROUPS[g].block_size
        for t in [0, 1] if g == 0 else [2]:
            expected = content(t, b.all_token_ids[i * bs : (i + 1) * bs], i)
            assert np.array_equal(engine.device[t][block].numpy(), expected), (g, i, t)
    engine.transfer.close()
