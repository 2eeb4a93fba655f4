"""The ``sync_load_budget_bytes`` key (vLLM 0.34's): a small hit is loaded within the step
that schedules its request, before the forward pass. The scheduler side reserves each
step's budget per hit and marks those loads; the worker side waits for them before it
returns from ``start_load_kv`` and never reports them as ``finished_recving`` (their
requests already run); a failed one is reported by its device blocks, which vLLM
recomputes. End to end on the CPU build: outputs identical, loads within the step, and
a failed one recomputed."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from kvoffload.integrations.vllm.config import DEFAULT_SYNC_LOAD_BUDGET_BYTES, parse_extra_config  # noqa: E402
from kvoffload.integrations.vllm.scheduler_side import SchedulerSide  # noqa: E402
from kvoffload.scheduler import StepPlan, TransferJob  # noqa: E402
from kvoffload.specs import CPULoadStoreSpec, DeviceLoadStoreSpec  # noqa: E402
from late_worker import LateWorker  # noqa: E402


def config(**extra):
    return parse_extra_config({"cpu_bytes_to_use": 1 << 20, "sync_stores": False, **extra}, 16)


def test_values_and_default():
    assert config().sync_load_budget_bytes == DEFAULT_SYNC_LOAD_BUDGET_BYTES
    assert config(sync_load_budget_bytes=0).sync_load_budget_bytes == 0
    assert config(sync_load_budget_bytes=1 << 20).sync_load_budget_bytes == 1 << 20


@pytest.mark.parametrize("bad", [-1, 1.5, "1MiB", True, None])
def test_bad_values_are_named(bad):
    with pytest.raises(ValueError, match=r"\['sync_load_budget_bytes'\] must be a non-negative int, got"):
        config(sync_load_budget_bytes=bad)


def budget_side(budget: int, bytes_per_token: float = 100.0):
    return SimpleNamespace(
        _sync_budget=budget, _bytes_per_token=bytes_per_token, _sync_requests=set(), _sync_bytes=0.0
    )


def test_the_step_budget_is_shared_by_its_hits_and_renewed_each_step():
    side = budget_side(10_000)
    reserve = SchedulerSide._reserve_sync_load
    assert reserve(side, "a", 64)  # 6,400 bytes
    assert not reserve(side, "b", 64)  # 12,800 > 10,000: asynchronous
    assert reserve(side, "c", 32)  # 9,600
    assert side._sync_requests == {"a", "c"}
    assert not reserve(side, "a", 200)  # asked again (not allocated): too big now
    assert side._sync_requests == {"c"}
    assert not reserve(budget_side(0), "a", 1)  # 0 turns it off


def load(job_id: int, req: str, device: int) -> TransferJob:
    host, dev = CPULoadStoreSpec([job_id]), DeviceLoadStoreSpec([device], [1], [0])
    return TransferJob(job_id, req, False, host, dev)


def side_with(make, delay: float, fail=()):
    side = make(None, None, config())
    side.worker = LateWorker(delay, fail)
    return side


def test_a_load_within_the_step_is_waited_for_and_not_reported_as_received(worker_side):
    side = side_with(worker_side, 0.05)
    start = time.perf_counter()
    side.start_loads(StepPlan(loads=[load(1, "small", 5), load(2, "large", 6)]), frozenset({1}))
    assert time.perf_counter() - start >= 0.04  # the step's own load finished first
    side.worker.wait([2], 5)
    sending, recving = side.get_finished()
    assert recving == {"large"}  # the small hit's request already runs: vLLM expects nothing
    assert side.build_worker_meta().finished == {1: (1, True), 2: (1, True)}
    assert side.take_load_errors() == set()


def test_a_failed_load_within_the_step_is_reported_by_its_blocks(worker_side):
    side = side_with(worker_side, 0.01, fail={1})
    side.start_loads(StepPlan(loads=[load(1, "small", 5)]), frozenset({1}))
    assert side.get_finished() == (set(), set())
    assert side.take_load_errors() == {5}  # vLLM recomputes the block; the forward is redone
    assert side.build_worker_meta().finished == {1: (1, False)}


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_small_hits_load_within_the_step_on_a_real_engine(tiny_llama):
    from kvoffload.demo.offline import (
        close_llm,
        greedy,
        kv_block_bytes,
        make_llm,
        scheduler_connector,
        settle,
        word_text,
        worker_connector,
    )

    block = kv_block_bytes(tiny_llama)  # 256 KiB
    extra = {"cpu_bytes_to_use": 256 * block, "sync_load_budget_bytes": 12 * block}
    extra["fault_injection"] = {"fail_loads": [0]}  # the first load fails: recomputed
    llm = make_llm(tiny_llama, kvoffload=extra)
    try:
        side = worker_connector()._worker
        starts: list[tuple[int, int]] = []  # (loads, of them within the step) per step with loads
        start_loads = side.start_loads

        def spy(plan, sync_loads=frozenset()):
            if plan.loads:
                starts.append((len(plan.loads), len(sync_loads)))
            return start_loads(plan, sync_loads)

        side.start_loads = spy
        for blocks, within in ((8, True), (4, True), (16, False)):  # 16 blocks: over the budget
            text = word_text(blocks, blocks * 32 + 16)
            expected = greedy(llm, text)
            assert expected[1] == 0
            settle(llm)
            assert llm.reset_prefix_cache()
            out, cached = greedy(llm, text)
            assert out == expected[0], blocks
            assert starts[-1] == (1, int(within)), (blocks, starts)
            if len(starts) > 1:  # the first load failed; the others reloaded every full block
                assert cached == blocks * 32
        stats = scheduler_connector(llm).offload_stats()
        assert (stats.loads_planned, stats.failed_loads) == (3, 1)
    finally:
        close_llm(llm)
