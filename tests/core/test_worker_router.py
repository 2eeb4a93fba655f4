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
