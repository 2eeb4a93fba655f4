"""TransferEngine on CPU tensors: every byte lands where the mapping says, nothing else moves."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from kvoffload.specs import CPULoadStoreSpec, DeviceLoadStoreSpec
from kvoffload.transfer import (
    LOAD,
    STORE,
    HostBlockPool,
    KVLayout,
    TransferEngine,
    cpu_executor,
    native,
)
from kvoffload.transfer.cpu_executor import CPUExecutor
from transfer_oracle import (
    assert_state,
    distinct,
    expected_after,
    randomize,
    snapshot,
    three_group_layer_caches,
)

NUM_DEVICE = 32
NUM_HOST = 16


COPIERS = pytest.mark.parametrize(
    "native_copies",
    [
        pytest.param(
            True,
            id="native",
            marks=pytest.mark.skipif(
                not native.AVAILABLE, reason="could not import kvoffload.transfer._rowcopy"
            ),
        ),
        pytest.param(False, id="numpy"),
    ],
)


def make_setup(
    layout_kind: str, f: int, seed: int = 0, chunk_bytes: int = 1 << 20, native_copies: bool | None = None
):
    gen = torch.Generator().manual_seed(seed)
    if layout_kind == "per_layer":
        caches, groups = three_group_layer_caches(NUM_DEVICE, gen)
        layout = KVLayout.from_layer_tensors(caches, groups)
    elif layout_kind == "cross_layer":
        # One tensor per group holding every layer of a block: (blocks, layers, ...).
        tensors = []
        for layers, page in ((4, 256), (2, 512), (3, 40), (1, 64)):
            raw = torch.empty((NUM_DEVICE, layers, page), dtype=torch.uint8)
            randomize(raw, gen)
            tensors.append(KVLayout.cross_layer(raw).tensors[0])
        layout = KVLayout(tensors, [[0], [1], [2], [3]])
    elif layout_kind == "kv_split":
        # (2, num_blocks, ...) K/V caches, and padded pages (block stride > page bytes).
        caches = {}
        for g, (shape, pad) in enumerate((((4, 16), 0), ((8, 16), 8), ((3, 3), 0), ((16,), 0))):
            raw = torch.empty((2, NUM_DEVICE, int(np.prod(shape)) * 2 + pad), dtype=torch.uint8)
            randomize(raw, gen)
            caches[f"layer{g}"] = raw[:, :, : raw.shape[2] - pad]
        layout = KVLayout.from_layer_tensors(caches, [[n] for n in caches], block_dim=1)
    else:
        raise AssertionError(layout_kind)
    pool = HostBlockPool(layout, NUM_HOST, blocks_per_offload_block=f)
    for t in pool.tensors:
        randomize(t, gen)
    executor = CPUExecutor(layout, pool, chunk_bytes, native_copies=native_copies)
    return layout, pool, TransferEngine(layout, pool, executor=executor)


def run_job(engine, layout, pool, store, device_ids, sizes, indices, host_ids, job_id=1):
    before = snapshot(layout, pool)
    device_spec = DeviceLoadStoreSpec(device_ids, sizes, indices)
    host_spec = CPULoadStoreSpec(host_ids)
    src, dst = (device_spec, host_spec) if store else (host_spec, device_spec)
    assert engine.submit(job_id, src, dst) is True
    engine.wait([job_id])
    (result,) = engine.poll()
    assert result.success, result.error
    assert result.job_id == job_id and result.direction == (STORE if store else LOAD)
    page_bytes = [layout.group_page_bytes(g) for g in range(layout.num_groups)]
    assert result.bytes == sum(n * p for n, p in zip(sizes, page_bytes))
    assert_state(
        layout, pool, expected_after(layout, pool, before, store, device_ids, sizes, indices, host_ids)
    )


@pytest.mark.parametrize("layout_kind", ["per_layer", "cross_layer", "kv_split"])
@pytest.mark.parametrize("f", [1, 4])
@pytest.mark.parametrize("store", [True, False], ids=["store", "load"])
@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "unaligned"])
@COPIERS
def test_three_groups_and_an_empty_one(layout_kind, f, store, aligned, native_copies):
    layout, pool, engine = make_setup(layout_kind, f, native_copies=native_copies)
    rng = np.random.default_rng(f * 10 + store)
    # Group 3 takes no part in the job; groups 0..2 have different page sizes.
    sizes = [6, 3, 5, 0]
    indices = [0, 4, 8, 0] if aligned else [1, 6, 3, 2]
    device_ids = distinct(rng, NUM_DEVICE, sum(sizes))
    spans = [-(-(i % f + n) // f) if n else 0 for n, i in zip(sizes, indices)]
    host_ids = distinct(rng, NUM_HOST, sum(spans))
    with engine:
        run_job(engine, layout, pool, store, device_ids, sizes, indices, host_ids)


def test_small_chunks_split_large_jobs():
    # A chunk of one row forces many gather/scatter rounds per tensor.
    layout, pool, engine = make_setup("per_layer", 1, chunk_bytes=1)
    with engine:
        run_job(engine, layout, pool, True, list(range(10)), [10, 0, 0, 0], [0, 0, 0, 0], list(range(5, 15)))


@pytest.mark.skipif(not native.AVAILABLE, reason="could not import kvoffload.transfer._rowcopy")
@pytest.mark.parametrize("chunk_bytes", [1, 1 << 20], ids=["row_chunks", "big_chunks"])
def test_a_native_job_is_a_few_calls_per_copy_thread_whatever_its_tensors(chunk_bytes, monkeypatch):
    """Each native call is a wait for the GIL in a busy engine: a job of every tensor of
    three groups is at most TASKS_PER_THREAD calls per thread, and still byte-exact."""
    calls = []
    real = native.copy
    monkeypatch.setattr(native, "copy", lambda *args: (calls.append(args[2].nbytes), real(*args))[1])
    layout, pool, engine = make_setup("per_layer", 1, chunk_bytes=chunk_bytes)
    executor = engine._executor
    assert len(layout.tensors) > cpu_executor.TASKS_PER_THREAD * executor.threads
    rng = np.random.default_rng(5)
    sizes = [6, 3, 5, 0]
    with engine:
        run_job(engine, layout, pool, True, distinct(rng, NUM_DEVICE, 14), sizes, [0, 0, 0, 0],
                distinct(rng, NUM_HOST, 14))  # fmt: skip
    assert 1 <= len(calls) <= cpu_executor.TASKS_PER_THREAD * executor.threads
    page_bytes = [layout.group_page_bytes(g) for g in range(layout.num_groups)]
    assert sum(calls) == sum(n * p for n, p in zip(sizes, page_bytes))


@pytest.mark.parametrize("pattern", ["fresh_host", "consecutive", "scattered"])
@pytest.mark.parametrize("f", [1, 4])
@pytest.mark.parametrize("chunk_bytes", [1, 1 << 20], ids=["row_chunks", "big_chunks"])
@COPIERS
def test_id_patterns_store_and_load(pattern, f, chunk_bytes, native_copies):
    # Consecutive host ids (a fresh pool) make stores gather into one run and loads
    # scatter from one; consecutive device ids too make plain slice copies.
    layout, pool, engine = make_setup(
        "per_layer", f, seed=f, chunk_bytes=chunk_bytes, native_copies=native_copies
    )
    rng = np.random.default_rng(f)
    sizes, indices = [12, 0, 0, 0], [0, 0, 0, 0]
    spans = 12 // f
    if pattern == "scattered":
        device_ids, host_ids = distinct(rng, NUM_DEVICE, 12), distinct(rng, NUM_HOST, spans)
    else:
        device_ids = list(range(7, 19)) if pattern == "consecutive" else distinct(rng, NUM_DEVICE, 12)
        host_ids = list(range(2, 2 + spans))
    with engine:
        for job_id, store in enumerate((True, False)):
            run_job(engine, layout, pool, store, device_ids, sizes, indices, host_ids, job_id)


def test_store_then_load_round_trip():
    layout, pool, engine = make_setup("per_layer", 4, seed=3)
    original = [t.clone() for t in layout.tensors]
    with engine:
        device_ids, sizes, indices = list(range(8)) + [20, 21], [8, 2, 0, 0], [0, 2, 0, 0]
        store = DeviceLoadStoreSpec(device_ids, sizes, indices)
        engine.submit(1, store, CPULoadStoreSpec([3, 7, 9]))
        engine.wait([1])
        load_to = list(range(10, 18)) + [30, 31]
        engine.submit(2, CPULoadStoreSpec([3, 7, 9]), DeviceLoadStoreSpec(load_to, sizes, indices))
        engine.wait([2])
        assert [r.success for r in engine.poll()] == [True, True]
    for g, (src_ids, dst_ids) in enumerate(((range(8), range(10, 18)), ([20, 21], [30, 31]))):
        for t in layout.groups[g]:
            assert torch.equal(layout.tensors[t][list(dst_ids)], original[t][list(src_ids)])


def test_results_in_submission_order_per_direction():
    layout, pool, engine = make_setup("per_layer", 1)
    with engine:
        for job in range(12):
            store = job % 2 == 0
            device = DeviceLoadStoreSpec([job], [1, 0, 0, 0], [0, 0, 0, 0])
            host = CPULoadStoreSpec([job])
            engine.submit(job, *((device, host) if store else (host, device)))
        engine.wait(range(12))
        results = engine.poll()
    assert sorted(r.job_id for r in results) == list(range(12))
    for direction, first in ((STORE, 0), (LOAD, 1)):
        ids = [r.job_id for r in results if r.direction == direction]
        assert ids == list(range(first, 12, 2))
    assert all(r.success and r.seconds >= 0 for r in results)


@COPIERS
def test_copy_error_fails_only_that_job(native_copies):
    layout, pool, engine = make_setup("per_layer", 1, native_copies=native_copies)
    before = snapshot(layout, pool)
    # Release the memory behind one group-1 layer: copying from it raises.
    layout.tensors[layout.groups[1][0]].untyped_storage().resize_(0)
    with engine:
        engine.submit(1, DeviceLoadStoreSpec([0], [0, 1, 0, 0], [0] * 4), CPULoadStoreSpec([0]))
        engine.submit(2, DeviceLoadStoreSpec([5], [1, 0, 0, 0], [0] * 4), CPULoadStoreSpec([4]))
        engine.wait([1, 2])
        failed, ok = engine.poll()
    assert (failed.job_id, failed.success, failed.bytes) == (1, False, 0)
    assert failed.error and "RuntimeError" in failed.error
    assert (ok.job_id, ok.success) == (2, True)
    for t in layout.groups[0]:
        assert torch.equal(pool.tensors[t][4], before[0][t][5])


@COPIERS
def test_memory_released_after_jobs_ran_fails_the_next_job(native_copies):
    """The executor's views must not pin the storage: torch can still release it after
    jobs have copied through it, and the next job fails instead of touching freed memory."""
    layout, pool, engine = make_setup("per_layer", 1, native_copies=native_copies)
    released = layout.tensors[layout.groups[1][0]]
    with engine:
        engine.submit(1, DeviceLoadStoreSpec([0], [0, 1, 0, 0], [0] * 4), CPULoadStoreSpec([0]))
        engine.wait([1])
        (first,) = engine.poll()
        released.untyped_storage().resize_(0)  # raises if an earlier view locked the storage
        engine.submit(2, DeviceLoadStoreSpec([0], [0, 1, 0, 0], [0] * 4), CPULoadStoreSpec([1]))
        engine.wait([2])
        (second,) = engine.poll()
    assert first.success
    assert (second.success, second.bytes) == (False, 0)
    assert "memory was released or shrunk" in second.error


@pytest.mark.parametrize(
    ("device_ids", "sizes", "host_ids", "message"),
    [
        ([NUM_DEVICE], [1, 0, 0, 0], [0], f"device block id of group 0 {NUM_DEVICE} out of range"),
        ([-1], [0, 1, 0, 0], [0], "device block id of group 1 -1 out of range"),
        ([0], [1, 0, 0, 0], [NUM_HOST], f"host block id {NUM_HOST} out of range"),
        ([0], [1, 0, 0, 0], [-3], "host block id -3 out of range"),
        ([0, 1], [2, 0, 0, 0], [0], "host spec has 1 block ids but the device spec spans 2"),
        ([0], [1, 0, 0], [0], "device spec has 3 groups, the layout has 4"),
    ],
)
def test_bad_jobs_rejected_at_submit(device_ids, sizes, host_ids, message):
    layout, pool, engine = make_setup("per_layer", 1)
    before = snapshot(layout, pool)
    with engine:
        for store in (True, False):
            device = DeviceLoadStoreSpec(device_ids, sizes, [0] * len(sizes))
            host = CPULoadStoreSpec(host_ids)
            with pytest.raises(ValueError, match=message):
                engine.submit(7, *((device, host) if store else (host, device)))
        assert engine.poll() == []
        engine.wait([7])  # never queued: counts as finished
    assert_state(layout, pool, before)


def test_duplicate_destinations_and_job_ids_rejected():
    layout, pool, engine = make_setup("per_layer", 1)
    before = snapshot(layout, pool)
    # Every copy waits until released: job 1 stays in flight, whatever the timing.
    release = threading.Event()
    launch = engine._executor.launch

    def held(*args, **kwargs):
        release.wait()
        return launch(*args, **kwargs)

    engine._executor.launch = held
    store_1 = (DeviceLoadStoreSpec([0], [1, 0, 0, 0], [0] * 4), CPULoadStoreSpec([3]))
    with engine:
        try:
            assert engine.submit(1, *store_1) is True
            # the same id, valid specs, either direction: refused while job 1 runs
            with pytest.raises(ValueError, match=r"^job id 1 is already in flight$"):
                engine.submit(1, DeviceLoadStoreSpec([1], [1, 0, 0, 0], [0] * 4), CPULoadStoreSpec([4]))
            with pytest.raises(ValueError, match=r"^job id 1 is already in flight$"):
                engine.submit(1, CPULoadStoreSpec([5]), DeviceLoadStoreSpec([2], [1, 0, 0, 0], [0] * 4))
            with pytest.raises(ValueError, match=r"^group 0 writes a host sub-block twice in job 2$"):
                engine.submit(2, DeviceLoadStoreSpec([0, 1], [2, 0, 0, 0], [0] * 4), CPULoadStoreSpec([3, 3]))
            with pytest.raises(ValueError, match=r"^group 0 writes a device block twice in job 2$"):
                engine.submit(2, CPULoadStoreSpec([3, 4]), DeviceLoadStoreSpec([0, 0], [2, 0, 0, 0], [0] * 4))
            with pytest.raises(TypeError, match="DeviceLoadStoreSpec"):
                engine.submit(2, CPULoadStoreSpec([3]), CPULoadStoreSpec([4]))
            release.set()
            engine.wait([1])
            assert [(r.job_id, r.success) for r in engine.poll()] == [(1, True)]
            # finished: the id is free again
            assert engine.submit(1, *store_1) is True
            engine.wait([1])
            assert [(r.job_id, r.success) for r in engine.poll()] == [(1, True)]
        finally:
            release.set()  # before close() joins the workers, whatever failed
    # only job 1's copy happened: the refused jobs wrote nothing
    assert_state(layout, pool, expected_after(layout, pool, before, True, [0], [1, 0, 0, 0], [0] * 4, [3]))


def test_submit_after_close_raises_and_results_survive():
    layout, pool, engine = make_setup("per_layer", 1)
    engine.submit(1, DeviceLoadStoreSpec([0], [1, 0, 0, 0], [0] * 4), CPULoadStoreSpec([0]))
    engine.close()  # lets the queued job finish
    engine.close()  # idempotent
    assert [r.job_id for r in engine.poll()] == [1]
    with pytest.raises(RuntimeError, match="after close"):
        engine.submit(2, DeviceLoadStoreSpec([0], [1, 0, 0, 0], [0] * 4), CPULoadStoreSpec([1]))
