"""The ``idle_wait_s`` key: in a step without a forward pass, the worker side waits a little
for its loads and tier transfers in flight (so vLLM's loop does not spin through empty
steps holding the GIL); in a step with one, it never waits; stores are never waited for."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest

pytest.importorskip("vllm")

from kvoffload.integrations.vllm.config import DEFAULT_IDLE_WAIT_S, parse_extra_config  # noqa: E402
from kvoffload.integrations.vllm.worker_side import WorkerSide  # noqa: E402
from kvoffload.scheduler import StepPlan, TransferJob  # noqa: E402
from kvoffload.specs import CPULoadStoreSpec, DeviceLoadStoreSpec  # noqa: E402
from late_worker import LateWorker  # noqa: E402


def config(**extra):
    return parse_extra_config({"cpu_bytes_to_use": 1 << 20, "sync_stores": False, **extra}, 16)


def test_values_and_default():
    assert config().idle_wait_s == DEFAULT_IDLE_WAIT_S == 0.001
    assert config(idle_wait_s=0).idle_wait_s == 0
    assert config(idle_wait_s=0.02).idle_wait_s == 0.02


@pytest.mark.parametrize("bad", [-0.001, 1, "soon", True, None])
def test_bad_values_are_named(bad):
    with pytest.raises(ValueError, match=r"\['idle_wait_s'\] must be seconds in \[0, 0.1\], got"):
        config(idle_wait_s=bad)


def load(job_id: int, req: str) -> TransferJob:
    return TransferJob(job_id, req, False, CPULoadStoreSpec([0]), DeviceLoadStoreSpec([2], [1], [0]))


def store(job_id: int, req: str) -> TransferJob:
    return TransferJob(job_id, req, True, DeviceLoadStoreSpec([1], [1], [0]), CPULoadStoreSpec([job_id]))


def side_with(make, idle_wait_s: float, delay: float | None = None) -> WorkerSide:
    """A worker half whose jobs finish only when released (``delay=None``). ``idle_wait_s``
    may exceed the key's 0.1 s limit here: a long bound tells "waited for the job" from
    "waited for the bound" by far more than a loaded machine's scheduling delays."""
    side = make(None, None, dataclasses.replace(config(), idle_wait_s=idle_wait_s))
    side.worker = LateWorker(delay)
    return side


def timed(call):
    start = time.perf_counter()
    result = call()
    return result, time.perf_counter() - start


LONG = 30.0  # a bound no passing test waits for


def release_once_waited_for(worker: LateWorker, job_id: int) -> threading.Thread:
    """Finishes the job only after the worker half has begun to wait for it, so that a
    report in the same step can only come from having waited."""
    thread = threading.Thread(target=lambda: worker.waiting.wait(LONG) and worker.release(job_id))
    thread.start()
    return thread


def test_an_idle_step_waits_for_a_load_and_reports_it_at_once(worker_side):
    side = side_with(worker_side, LONG)
    side.start_loads(StepPlan(loads=[load(1, "a")]))
    releaser = release_once_waited_for(side.worker, 1)
    (_, recving), seconds = timed(lambda: side.get_finished(idle=True))
    releaser.join()
    assert side.worker.waits == [([1], LONG)]
    assert recving == {"a"} and seconds < LONG / 2  # waited for the load, not for the bound


def test_a_step_with_a_forward_pass_never_waits(worker_side):
    side = side_with(worker_side, LONG)
    side.start_loads(StepPlan(loads=[load(1, "a")]))
    (_, recving), seconds = timed(lambda: side.get_finished(idle=False))
    assert recving == set() and side.worker.waits == [] and seconds < LONG / 2
    side.worker.release(1)
    assert side.get_finished()[1] == {"a"}  # reported by a later step


def test_the_wait_is_bounded_and_stores_are_not_waited_for(worker_side):
    side = side_with(worker_side, 0.01)
    side.start_loads(StepPlan(loads=[load(1, "a")]))
    (_, recving), seconds = timed(lambda: side.get_finished(idle=True))
    assert recving == set() and side.worker.waits == [([1], 0.01)]  # the bound, then on
    assert 0.01 <= seconds < LONG / 2  # nothing raised
    side.worker.release(1)
    assert side.get_finished()[1] == {"a"}
    side = side_with(worker_side, LONG)
    side.start_stores(StepPlan(stores=[store(2, "b")]))
    _, seconds = timed(lambda: side.get_finished(idle=True))
    assert side.worker.waits == [] and seconds < LONG / 2
    side.worker.release(2)


def test_zero_turns_it_off(worker_side):
    side = side_with(worker_side, 0)
    side.start_loads(StepPlan(loads=[load(1, "a")]))
    (_, recving), seconds = timed(lambda: side.get_finished(idle=True))
    assert recving == set() and side.worker.waits == [] and seconds < LONG / 2
    side.worker.release(1)


def test_the_scheduler_marks_steps_without_tokens_and_the_connector_passes_it_on():
    from types import SimpleNamespace

    from kvoffload.integrations.vllm.connector import KVOffloadConnector
    from kvoffload.integrations.vllm.metadata import KVOffloadMetadata
    from kvoffload.integrations.vllm.scheduler_side import SchedulerSide

    side = SimpleNamespace(
        scheduler=SimpleNamespace(build_step=lambda steps, preempted, running=(): StepPlan()),
        _sync_requests=set(),
        _sync_bytes=0.0,
    )
    cached = SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[], resumed_req_ids=set())

    def output(tokens: int):
        return SimpleNamespace(
            scheduled_new_reqs=[],
            scheduled_cached_reqs=cached,
            num_scheduled_tokens={},
            preempted_req_ids=None,
            total_num_scheduled_tokens=tokens,
        )

    assert SchedulerSide.build_connector_meta(side, output(0)).idle is True
    assert SchedulerSide.build_connector_meta(side, output(7)).idle is False

    seen: list[bool] = []
    worker = SimpleNamespace(get_finished=lambda idle=False: seen.append(idle) or (set(), set()))
    for idle in (True, False):
        connector = SimpleNamespace(
            _connector_metadata=KVOffloadMetadata(StepPlan(), idle=idle), _worker_side=lambda: worker
        )
        assert KVOffloadConnector.get_finished(connector, set()) == (None, None)
    assert seen == [True, False]
