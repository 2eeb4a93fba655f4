"""The worker contract: ``WorkerRouter`` routes jobs by their (source, destination) medium
to peer workers; the host-memory ``TransferEngine`` is one of them."""

from __future__ import annotations

import pytest
import torch

from kvoffload.specs import CPULoadStoreSpec, DeviceLoadStoreSpec
from kvoffload.transfer import HostBlockPool, KVLayout, TransferEngine
from kvoffload.worker import WorkerRouter
from shelf_tier import ShelfSpec, ShelfWorker
from transfer_oracle import three_group_layer_caches


@pytest.fixture
def setup():
    gen = torch.Generator().manual_seed(3)
    caches, groups = three_group_layer_caches(8, gen)
    layout = KVLayout.from_layer_tensors(caches, groups)
    pool = HostBlockPool(layout, 4)
    engine = TransferEngine(layout, pool)
    shelf = ShelfWorker(pool)
    shelf.release.clear()  # jobs wait until a test releases them
    router = WorkerRouter([engine, shelf])
    yield layout, pool, engine, shelf, router
    router.close()


def device_spec(ids):
    return DeviceLoadStoreSpec(ids, [len(ids), 0, 0, 0], [0, 0, 0, 0])


def test_jobs_reach_the_worker_of_their_media_and_bytes_travel_through_both(setup):
    layout, pool, engine, shelf, router = setup
    assert router.routes == {("GPU", "CPU"), ("CPU", "GPU"), ("CPU", "SHELF"), ("SHELF", "CPU")}
    assert router.worker_for(("GPU", "CPU")) is engine and router.worker_for(("SHELF", "CPU")) is shelf
    original = layout.tensors[0][5].clone()
    # device block 5 -> host block 2 -> shelf slot 9 -> host block 3 -> device block 1
    router.submit(1, device_spec([5]), CPULoadStoreSpec([2]))
    router.wait([1])
    shelf.release.set()
    router.submit(2, CPULoadStoreSpec([2]), ShelfSpec([9]))
    router.wait([2])
    router.submit(3, ShelfSpec([9]), CPULoadStoreSpec([3]))
    router.wait([3])
    router.submit(4, CPULoadStoreSpec([3]), device_spec([1]))
    router.wait([4])
    results = router.poll()
    assert sorted(r.job_id for r in results) == [1, 2, 3, 4] and all(r.success for r in results)
    assert {r.job_id: r.direction for r in results} == {
        1: "store",
        2: "CPU->SHELF",
        3: "SHELF->CPU",
        4: "load",
    }
    assert torch.equal(layout.tensors[0][1], original)


def test_a_medium_pair_nobody_moves_is_a_type_error_naming_it(setup):
    *_, router = setup
    with pytest.raises(TypeError, match="no worker moves GPU->SHELF"):
        router.submit(1, device_spec([0]), ShelfSpec([0]))


def test_two_workers_claiming_one_route_are_refused(setup):
    _, pool, engine, *_ = setup
    with pytest.raises(ValueError, match="route CPU->SHELF is served by both ShelfWorker and ShelfWorker"):
        WorkerRouter([ShelfWorker(pool), ShelfWorker(pool)])


def test_a_job_id_in_flight_in_one_worker_is_refused_for_another(setup):
    layout, pool, engine, shelf, router = setup
    router.submit(7, CPULoadStoreSpec([0]), ShelfSpec([0]))  # held until release
    with pytest.raises(ValueError, match="job id 7 is already in flight"):
        router.submit(7, device_spec([0]), CPULoadStoreSpec([1]))
    with pytest.raises(TimeoutError, match="job 7"):
        router.wait([7], timeout=0.05)
    shelf.release.set()
    router.wait([7])
    assert [r.job_id for r in router.poll()] == [7]
    router.submit(7, device_spec([0]), CPULoadStoreSpec([1]))  # free again once polled
    router.wait([7])
    assert [(r.job_id, r.success) for r in router.poll()] == [(7, True)]


def test_close_closes_every_worker_and_refuses_later_jobs(setup):
    *_, engine, shelf, router = setup
    router.close()
    router.close()  # idempotent
    assert shelf.closed
    with pytest.raises(RuntimeError, match="after close"):
        router.submit(1, device_spec([0]), CPULoadStoreSpec([0]))
    with pytest.raises(RuntimeError, match="after close"):
        engine.submit(1, device_spec([0]), CPULoadStoreSpec([0]))


# -- a load chained on a promotion: held until the promotion's bytes arrived ----------------


def promoted_rows(pool, slot, shelf, value):
    """Shelf slot ``slot`` holds a block whose every byte is ``value``."""
    shelf.shelf[slot] = [bytes([value]) * t[0].numel() * t.element_size() for t in pool.tensors]


def device_bytes(layout, block):
    return layout.tensors[0][block].contiguous().view(torch.uint8)


def test_a_load_of_blocks_being_promoted_waits_for_the_promotion(setup):
    layout, pool, engine, shelf, router = setup
    promoted_rows(pool, 9, shelf, 7)
    router.submit(1, ShelfSpec([9]), CPULoadStoreSpec([3]))  # held by the shelf until release
    router.submit(2, CPULoadStoreSpec([3]), device_spec([1]))  # reads what job 1 writes
    with pytest.raises(TimeoutError, match=r"jobs \[2\] still wait for promotions \[1\]"):
        router.wait([2], timeout=0.05)
    assert router.poll() == []
    assert not bool((device_bytes(layout, 1) == 7).all())
    shelf.release.set()
    router.wait([2])
    assert bool((device_bytes(layout, 1) == 7).all())  # the promoted bytes, not what was there
    assert [(r.job_id, r.success) for r in router.poll()] == [(1, True), (2, True)]


def test_a_failed_promotion_fails_the_load_without_running_it(setup):
    layout, pool, engine, shelf, router = setup
    promoted_rows(pool, 9, shelf, 7)
    pool.tensors[0][3].fill_(5)  # what host block 3 held before: a load that ran would copy it
    before = layout.tensors[0][1].clone()
    shelf.fail_reads = True
    router.submit(1, ShelfSpec([9]), CPULoadStoreSpec([3]))
    router.submit(2, CPULoadStoreSpec([3]), device_spec([1]))
    shelf.release.set()
    router.wait([2])
    results = {r.job_id: r for r in router.poll()}
    assert not results[1].success and not results[2].success
    assert "promotion 1 of its source blocks failed: checksum mismatch" in results[2].error
    assert torch.equal(layout.tensors[0][1], before)  # never ran


def test_a_poll_that_sees_the_promotion_finish_starts_the_load(setup):
    layout, pool, engine, shelf, router = setup
    promoted_rows(pool, 9, shelf, 9)
    router.submit(1, ShelfSpec([9]), CPULoadStoreSpec([3]))
    router.submit(2, CPULoadStoreSpec([3]), device_spec([1]))
    shelf.release.set()
    shelf.wait([1])  # the promotion finished (the router has not looked yet)
    assert [(r.job_id, r.success) for r in router.poll()] == [(1, True)]
    engine.wait([2])  # started by that poll: now the host engine's job
    assert [(r.job_id, r.success) for r in router.poll()] == [(2, True)]
    assert bool((device_bytes(layout, 1) == 9).all())


def test_a_load_of_other_blocks_is_not_held(setup):
    layout, pool, engine, shelf, router = setup
    promoted_rows(pool, 9, shelf, 7)
    router.submit(1, ShelfSpec([9]), CPULoadStoreSpec([3]))  # held
    router.submit(2, CPULoadStoreSpec([0, 1]), DeviceLoadStoreSpec([4, 5], [2, 0, 0, 0], [0, 0, 0, 0]))
    router.wait([2], timeout=30)  # runs while the promotion waits
    assert [(r.job_id, r.success) for r in router.poll()] == [(2, True)]
    shelf.release.set()


def test_close_fails_a_load_still_held(setup):
    layout, pool, engine, shelf, router = setup
    promoted_rows(pool, 9, shelf, 7)
    router.submit(1, ShelfSpec([9]), CPULoadStoreSpec([3]))
    router.submit(2, CPULoadStoreSpec([3]), device_spec([1]))
    router.close()  # the shelf finishes job 1 as it closes; job 2 cannot start any more
    results = {r.job_id: r for r in router.poll()}
    assert results[1].success and not results[2].success
    assert "closed" in results[2].error
