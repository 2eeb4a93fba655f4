"""The vLLM worker half never raises a worker's error into vLLM and never waits in
``get_finished`` (vLLM 0.32 calls it before sampling is queued)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from kvoffload.scheduler import StepPlan, TransferJob  # noqa: E402
from kvoffload.specs import CPULoadStoreSpec, DeviceLoadStoreSpec  # noqa: E402
from kvoffload.worker import TransferResult  # noqa: E402


class StubWorker:
    """Raises ``error`` from submit for the ids in ``refuse``; must never be waited on."""

    def __init__(self, refuse: set[int], error: BaseException) -> None:
        self.refuse, self.error = refuse, error
        self.submitted: list[int] = []
        self.results: list[TransferResult] = []

    def submit(self, job_id, src_spec, dst_spec) -> bool:
        if job_id in self.refuse:
            raise self.error
        self.submitted.append(job_id)
        return True

    def poll(self) -> list[TransferResult]:
        results, self.results = self.results, []
        return results

    def wait(self, job_ids, timeout=None) -> None:
        raise AssertionError(f"get_finished waited for {list(job_ids)}")

    def close(self) -> None:
        pass


def load(job_id: int, req: str, device_blocks: list[int]) -> TransferJob:
    device = DeviceLoadStoreSpec(device_blocks, [len(device_blocks)], [0])
    return TransferJob(job_id, req, False, CPULoadStoreSpec(list(range(len(device_blocks)))), device)


def store(job_id: int, req: str) -> TransferJob:
    return TransferJob(job_id, req, True, DeviceLoadStoreSpec([1], [1], [0]), CPULoadStoreSpec([0]))


@pytest.mark.parametrize("error", [RuntimeError("CUDA error: out of memory"), KeyError(3), ValueError("bad")])
def test_errors_at_submit_become_failed_jobs_not_exceptions(error, worker_side):
    side = worker_side(None, None, None)
    side.worker = StubWorker({1, 3}, error)
    side.start_loads(StepPlan(loads=[load(1, "a", [7, 8]), load(2, "b", [9])], hold_blocks={"c": [3]}))
    side.start_stores(StepPlan(stores=[store(3, "c")]))  # no exception reaches vLLM
    assert side.worker.submitted == [2]
    sending, recving = side.get_finished()
    assert recving == {"a"}  # failed load: reported finished, its blocks recomputed
    assert sending == {"c"}  # the held request's only job failed: nothing to wait for
    assert side.take_load_errors() == {7, 8}
    assert side.take_failed_requests() == set()


def test_on_a_model_with_several_kv_groups_failed_loads_are_reported_by_request(worker_side):
    """vLLM refuses block-level load failures there (block ids repeat across groups)."""
    groups = SimpleNamespace(kv_cache_groups=[SimpleNamespace(), SimpleNamespace()])
    side = worker_side(None, groups, None)
    side.worker = StubWorker({1}, RuntimeError("refused"))
    side.start_loads(StepPlan(loads=[load(1, "a", [7, 8]), load(2, "b", [9]), load(4, "d", [5])]))
    side.worker.results = [TransferResult(2, False, 0, 0.0, "load"), TransferResult(4, True, 9, 0.1, "load")]
    sending, recving = side.get_finished()
    assert recving == {"a", "b", "d"}  # a failed load is still a finished one
    assert side.take_failed_requests() == {"a", "b"}
    assert side.take_load_errors() == set()
    assert side.take_failed_requests() == set()  # each reported once
    meta = side.build_worker_meta()
    assert meta is not None
    assert side.build_worker_meta() is None


def test_get_finished_polls_and_never_waits_for_this_steps_loads(worker_side):
    side = worker_side(None, None, None)
    side.worker = StubWorker(set(), RuntimeError())
    side.start_loads(StepPlan(loads=[load(5, "a", [2])]))
    assert side.get_finished() == (set(), set())  # still copying: reported later
    side.worker.results.append(TransferResult(5, True, 64, 0.001, "load"))
    assert side.get_finished() == (set(), {"a"})
    assert side.take_load_errors() == set()
