"""The seeded fault injector (``kvoffload.faults``) around a real ``TransferEngine`` on CPU
tensors: chosen jobs fail after a copy that put wrong bytes in their destination, the
others move byte-exact, the choice is reproducible, and its configuration is validated."""

from __future__ import annotations

import pytest
import torch

from kvoffload.faults import INJECTED_ERROR, FaultConfig, FaultInjectingWorker
from kvoffload.integrations.vllm.config import parse_extra_config
from kvoffload.specs import CPULoadStoreSpec, DeviceLoadStoreSpec
from kvoffload.transfer import HostBlockPool, KVLayout, TransferEngine
from kvoffload.worker import WorkerRouter

NUM_DEVICE, NUM_HOST, PAGE = 16, 16, 64


@pytest.fixture
def setup():
    device = torch.arange(NUM_DEVICE, dtype=torch.uint8).repeat_interleave(PAGE).reshape(NUM_DEVICE, PAGE)
    layout = KVLayout.from_layer_tensors({"layer": device}, [["layer"]])
    pool = HostBlockPool(layout, NUM_HOST)
    engine = TransferEngine(layout, pool)
    yield device, pool, engine
    engine.close()


def host_pages(pool: HostBlockPool) -> torch.Tensor:
    return pool.tensors[0].reshape(NUM_HOST, -1)


def store(device_ids, host_ids):
    return DeviceLoadStoreSpec(device_ids, [len(device_ids)], [0]), CPULoadStoreSpec(host_ids)


def load(host_ids, device_ids):
    return CPULoadStoreSpec(host_ids), DeviceLoadStoreSpec(device_ids, [len(device_ids)], [0])


def run(worker, jobs):
    """Submit ``(job_id, (src, dst))`` pairs, wait for all, return ``{job_id: result}``."""
    for job_id, (src, dst) in jobs:
        assert worker.submit(job_id, src, dst) is True
    worker.wait([job_id for job_id, _ in jobs])
    return {r.job_id: r for r in worker.poll()}


def test_failed_store_copies_wrong_bytes_then_reports_failure(setup):
    device, pool, engine = setup
    worker = FaultInjectingWorker(engine, FaultConfig(fail_stores=frozenset({1})))
    results = run(worker, [(0, store([1, 2], [0, 1])), (1, store([3, 4, 5], [2, 3, 4]))])
    assert results[0].success and results[0].bytes == 2 * PAGE
    failed = results[1]
    assert (failed.success, failed.bytes, failed.direction, failed.error) == (
        False,
        0,
        "store",
        INJECTED_ERROR,
    )
    pages = host_pages(pool)
    # the good job is byte-exact; the failed one wrote a device block, but not its own
    assert pages[0].eq(1).all() and pages[1].eq(2).all()
    for slot, own in ((2, 3), (3, 4), (4, 5)):
        assert not pages[slot].eq(own).all()
        assert int(pages[slot][0]) in (3, 4, 5)  # rotated: every slot got a wrong page
    assert worker.stats().as_dict() == {"loads": 0, "stores": 2, "failed_loads": 0, "failed_stores": 1}
    assert worker.injected == {"load": [], "store": [1]}


def test_failed_one_block_load_is_written_from_another_block(setup):
    device, pool, engine = setup
    worker = FaultInjectingWorker(engine, FaultConfig(fail_loads=frozenset({1})))
    run(worker, [(0, store([7, 8], [0, 1]))])
    results = run(worker, [(1, load([0], [10])), (2, load([1], [11]))])
    assert results[1].success and not results[2].success and results[2].error == INJECTED_ERROR
    assert device[10].eq(7).all()  # a good load is byte-exact
    # the failed load wrote its destination from a host block an earlier job named
    assert device[11].eq(7).all()
    assert worker.stats().failed_loads == 1 and worker.injected["load"] == [2]


def test_without_any_other_block_known_nothing_is_copied(setup):
    device, pool, engine = setup
    before = host_pages(pool).clone()
    worker = FaultInjectingWorker(engine, FaultConfig(store_failure_rate=1.0))
    results = run(worker, [(5, store([6], [3]))])
    assert not results[5].success and results[5].error == INJECTED_ERROR
    assert torch.equal(host_pages(pool), before)
    worker.wait([5])  # finished, nothing pending
    assert worker.poll() == []


def test_rates_are_seeded_and_count_every_failure(setup):
    _, _, engine = setup

    def failed_positions(seed):
        worker = FaultInjectingWorker(
            engine, FaultConfig(seed=seed, load_failure_rate=0.3, store_failure_rate=0.3)
        )
        job_ids = list(range(200))
        for job_id in job_ids:
            worker.submit(job_id, *store([job_id % 8, 8 + job_id % 8], [job_id % 8, 8 + job_id % 8]))
            worker.wait([job_id])
        results = {r.job_id: r for r in worker.poll()}
        assert sorted(results) == job_ids  # exactly one result per job
        failed = sorted(j for j, r in results.items() if not r.success)
        assert failed == worker.injected["store"] and worker.stats().failed_stores == len(failed)
        return failed

    first = failed_positions(3)
    assert first == failed_positions(3)
    assert first != failed_positions(4)
    assert 30 <= len(first) <= 90  # 30% of 200, loosely


def test_exact_positions_beside_a_rate_leave_the_rate_s_choices_as_they_are(setup):
    """One draw per job: adding positions fails those jobs too, and exactly the same others."""
    _, _, engine = setup

    def failed(**positions):
        config = FaultConfig(seed=5, store_failure_rate=0.2, load_failure_rate=0.2, **positions)
        worker = FaultInjectingWorker(engine, config)
        for job_id in range(100):
            worker.submit(job_id, *(store if job_id % 2 else load)([job_id % 8], [8 + job_id % 8]))
            worker.wait([job_id])
        return {r.job_id for r in worker.poll() if not r.success}

    by_rate = failed()
    both = failed(fail_stores=frozenset({0, 7}), fail_loads=frozenset({1, 2}))
    # stores are the odd jobs (store position p is job 2p + 1), loads the even ones (2p)
    assert both == by_rate | {1, 15, 2, 4}
    assert by_rate and not by_rate >= {1, 15, 2, 4}


def test_routes_are_the_inner_workers_and_an_unknown_route_still_raises(setup):
    _, _, engine = setup
    worker = FaultInjectingWorker(WorkerRouter([engine]), FaultConfig(load_failure_rate=1.0))
    assert worker.routes == engine.routes
    with pytest.raises(TypeError, match="no worker moves CPU->CPU"):
        worker.submit(1, CPULoadStoreSpec([0]), CPULoadStoreSpec([1]))
    assert worker.stats().as_dict() == {"loads": 0, "stores": 0, "failed_loads": 0, "failed_stores": 0}


def test_fault_injection_is_off_by_default_and_parsed_from_extra_config():
    assert parse_extra_config({"cpu_bytes_to_use": 1 << 20}, 16).faults is None
    config = parse_extra_config(
        {
            "cpu_bytes_to_use": 1 << 20,
            "fault_injection": {
                "seed": 7,
                "load_failure_rate": 0.1,
                "store_failure_rate": 1,
                "fail_loads": [0, 3],
            },
        },
        16,
    ).faults
    assert config == FaultConfig(7, 0.1, 1.0, frozenset({0, 3}), frozenset())


@pytest.mark.parametrize(
    "value, message",
    [
        ("on", r"\['fault_injection'\] must be a mapping .*got 'on'"),
        (
            {"load_rate": 0.1},
            r"unknown kv_connector_extra_config\['fault_injection'\] key\(s\) \['load_rate'\]",
        ),
        ({"load_failure_rate": 1.5}, r"\['load_failure_rate'\] must be a number in \[0, 1\], got 1.5$"),
        ({"store_failure_rate": -0.1}, r"\['store_failure_rate'\] must be a number in \[0, 1\], got -0.1$"),
        ({"store_failure_rate": float("nan")}, r"\['store_failure_rate'\] .* got nan$"),
        ({"load_failure_rate": True}, r"\['load_failure_rate'\] .* got True$"),
        ({"seed": "1"}, r"\['seed'\] must be an int, got '1'$"),
        ({"fail_loads": [1, -2]}, r"\['fail_loads'\] must hold job positions .*got -2$"),
        ({"fail_stores": 3}, r"\['fail_stores'\] must be a list of job positions .*got 3$"),
    ],
)
def test_bad_fault_injection_config_names_the_value(value, message):
    with pytest.raises(ValueError, match=message):
        parse_extra_config({"cpu_bytes_to_use": 1 << 20, "fault_injection": value}, 16)
