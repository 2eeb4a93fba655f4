"""The vLLM worker half with a load chained on a promotion (one step's plan holds both):
the promotion is submitted first, the load runs on the promoted bytes only, its request
is reported loaded once both are done (or within the step for a synchronous load), and a
failed promotion fails the load by its device blocks."""

from __future__ import annotations

import threading

import pytest
import torch

pytest.importorskip("vllm")

from kvoffload.scheduler import StepPlan, TransferJob  # noqa: E402
from kvoffload.specs import CPULoadStoreSpec, DeviceLoadStoreSpec  # noqa: E402
from kvoffload.transfer import HostBlockPool, KVLayout, TransferEngine  # noqa: E402
from kvoffload.worker import WorkerRouter  # noqa: E402
from shelf_tier import ShelfSpec, ShelfWorker  # noqa: E402
from transfer_oracle import three_group_layer_caches  # noqa: E402


@pytest.fixture
def side(worker_side):
    caches, groups = three_group_layer_caches(8, torch.Generator().manual_seed(5))
    layout = KVLayout.from_layer_tensors(caches, groups)
    pool = HostBlockPool(layout, 4)
    shelf = ShelfWorker(pool)
    shelf.release.clear()  # the promotion waits until the test releases it
    shelf.shelf[9] = [bytes([7]) * t[0].numel() * t.element_size() for t in pool.tensors]
    pool.tensors[0][3].fill_(5)  # what host block 3 held before the promotion
    made = worker_side(None, None, None)
    made.worker = WorkerRouter([TransferEngine(layout, pool), shelf])
    yield made, layout, shelf
    made.worker.close()


def plan():
    promotion = TransferJob(1, "", False, ShelfSpec([9]), CPULoadStoreSpec([3]))
    write_through = TransferJob(3, "", False, CPULoadStoreSpec([0]), ShelfSpec([5]))
    load = TransferJob(
        2, "a", False, CPULoadStoreSpec([3]), DeviceLoadStoreSpec([1], [1, 0, 0, 0], [0, 0, 0, 0])
    )
    # in the order the scheduler lists them: loads and transfers apart
    return StepPlan(loads=[load], transfers=[write_through, promotion])


def promoted(layout) -> bool:
    return bool((layout.tensors[0][1].contiguous().view(torch.uint8) == 7).all())


def test_the_request_is_reported_loaded_once_promotion_and_load_are_done(side):
    side, layout, shelf = side
    side.start_loads(plan())
    assert side.get_finished() == (set(), set())  # the promotion is held: nothing loaded
    assert not promoted(layout)
    shelf.release.set()
    side.wait_idle(30)
    sending, recving = side.get_finished()
    assert recving == {"a"} and side.take_load_errors() == set()
    assert promoted(layout)
    assert {job: ok for job, (_, ok) in side.build_worker_meta().finished.items()} == {
        1: True,
        2: True,
        3: True,
    }


def test_a_load_within_the_step_waits_for_its_promotion(side):
    side, layout, shelf = side
    step = threading.Thread(target=side.start_loads, args=(plan(), frozenset({2})))
    step.start()
    step.join(0.2)
    assert step.is_alive()  # start_load_kv has not returned: the promotion is held
    shelf.release.set()
    step.join(30)
    assert not step.is_alive() and promoted(layout)  # on return, the promoted bytes are there
    assert side.get_finished()[1] == set()  # its request runs already: no finished_recving


def test_a_failed_promotion_fails_the_load_by_its_device_blocks(side):
    side, layout, shelf = side
    before = layout.tensors[0][1].clone()
    shelf.fail_reads = True
    side.start_loads(plan())
    shelf.release.set()
    side.wait_idle(30)
    assert side.get_finished()[1] == {"a"}  # finished, failed: vLLM recomputes its blocks
    assert side.take_load_errors() == {1}
    assert torch.equal(layout.tensors[0][1], before)  # the load never ran
    finished = side.build_worker_meta().finished
    assert (finished[1], finished[2]) == ((1, False), (1, False))
