"""The ``sync_stores`` key: a step waits for the stores it started when the KV cache is in
host memory (``auto``), or as configured; loads are never waited for."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from kvoffload.integrations.vllm.config import parse_extra_config  # noqa: E402
from kvoffload.scheduler import StepPlan, TransferJob  # noqa: E402
from kvoffload.specs import CPULoadStoreSpec, DeviceLoadStoreSpec  # noqa: E402


def config(**extra):
    return parse_extra_config({"cpu_bytes_to_use": 1 << 20, **extra}, 16)


def test_values_and_default():
    assert config().sync_stores == "auto"
    assert config(sync_stores=True).sync_stores is True
    assert config(sync_stores=False).sync_stores is False


@pytest.mark.parametrize("bad", ["yes", 1, 0, None, "AUTO"])
def test_bad_values_are_named(bad):
    with pytest.raises(ValueError, match=r"\['sync_stores'\] must be 'auto', true or false, got"):
        config(sync_stores=bad)


class RecordingWorker:
    def __init__(self) -> None:
        self.submitted: list[int] = []
        self.waited: list[list[int]] = []

    def submit(self, job_id, src_spec, dst_spec) -> bool:
        self.submitted.append(job_id)
        return True

    def wait(self, job_ids, timeout=None) -> None:
        self.waited.append(list(job_ids))

    def poll(self):
        return []


def store(job_id: int) -> TransferJob:
    return TransferJob(job_id, "r", True, DeviceLoadStoreSpec([1], [1], [0]), CPULoadStoreSpec([job_id]))


def load(job_id: int) -> TransferJob:
    return TransferJob(job_id, "r", False, CPULoadStoreSpec([0]), DeviceLoadStoreSpec([2], [1], [0]))


@pytest.mark.parametrize("sync", [True, False])
def test_a_step_waits_for_its_stores_only_when_asked(sync, worker_side):
    side = worker_side(None, None, config(sync_stores=sync))
    side.worker = RecordingWorker()
    side.start_loads(StepPlan(loads=[load(1)]))
    side.start_stores(StepPlan(stores=[store(2), store(3)]))
    side.start_stores(StepPlan())  # a step without stores waits for nothing
    assert side.worker.submitted == [1, 2, 3]
    assert side.worker.waited == ([[2, 3]] if sync else [])


def test_stores_that_do_not_end_in_time_are_left_running_not_raised(worker_side):
    class SlowWorker(RecordingWorker):
        def wait(self, job_ids, timeout=None):
            super().wait(job_ids, timeout)
            raise TimeoutError(f"jobs {list(job_ids)} still running")

    side = worker_side(None, None, config(sync_stores=True))
    side.worker = SlowWorker()
    side.start_stores(StepPlan(stores=[store(4)]))  # no exception reaches vLLM
    assert side.worker.waited == [[4]]
    assert side.get_finished() == (set(), set())  # its result comes with a later poll
