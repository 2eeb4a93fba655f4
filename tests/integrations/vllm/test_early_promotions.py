"""The vLLM worker half starts a step's promotions in ``handle_preemptions`` (which vLLM
calls before it prepares the step's inputs), each once: ``start_load_kv`` then submits the
loads, a load chained on a promotion still runs on the promoted bytes only, and a step
whose ``handle_preemptions`` did not run still gets its promotions."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from kvoffload.scheduler import StepPlan, TransferJob  # noqa: E402
from kvoffload.specs import CPULoadStoreSpec, DeviceLoadStoreSpec  # noqa: E402
from kvoffload.transfer import HostBlockPool, KVLayout, TransferEngine  # noqa: E402
from kvoffload.worker import WorkerRouter  # noqa: E402
from shelf_tier import ShelfSpec, ShelfWorker  # noqa: E402
from transfer_oracle import three_group_layer_caches  # noqa: E402


class CountingShelf(ShelfWorker):
    def __init__(self, pool):
        super().__init__(pool)
        self.submitted: list[int] = []

    def submit(self, job_id, src_spec, dst_spec):
        self.submitted.append(job_id)
        return super().submit(job_id, src_spec, dst_spec)


@pytest.fixture
def side(worker_side):
    caches, groups = three_group_layer_caches(8, torch.Generator().manual_seed(5))
    layout = KVLayout.from_layer_tensors(caches, groups)
    pool = HostBlockPool(layout, 4)
    shelf = CountingShelf(pool)
    shelf.shelf[9] = [bytes([7]) * t[0].numel() * t.element_size() for t in pool.tensors]
    made = worker_side(None, None, None)
    made.worker = WorkerRouter([TransferEngine(layout, pool), shelf])
    yield made, layout, shelf
    made.worker.close()


def plan():
    promotion = TransferJob(1, "", False, ShelfSpec([9]), CPULoadStoreSpec([3]))
    load = TransferJob(
        2, "a", False, CPULoadStoreSpec([3]), DeviceLoadStoreSpec([1], [1, 0, 0, 0], [0, 0, 0, 0])
    )
    return StepPlan(loads=[load], transfers=[promotion])


def promoted(layout) -> bool:
    return bool((layout.tensors[0][1].contiguous().view(torch.uint8) == 7).all())


def test_handle_preemptions_starts_the_promotions_and_start_load_kv_does_not_repeat_them(side):
    side, layout, shelf = side
    step = plan()
    side.handle_preemptions(step)
    assert shelf.submitted == [1]  # before start_load_kv
    side.start_loads(step, frozenset({2}))  # the load runs within the step
    assert shelf.submitted == [1] and promoted(layout)
    side.wait_idle(30)
    side.get_finished()
    assert {job: ok for job, (_, ok) in side.build_worker_meta().finished.items()} == {1: True, 2: True}


def test_without_handle_preemptions_start_load_kv_submits_the_promotions(side):
    side, layout, shelf = side
    side.handle_preemptions(StepPlan())  # an earlier step's: nothing to start
    side.start_loads(plan(), frozenset({2}))
    assert shelf.submitted == [1] and promoted(layout)
