"""CUDAExecutor's own code on CPU tensors, its streams, events and devices played by a fake.

The executor touches CUDA only through its ``cuda`` argument; everything else (staging
plans, wide views, gathers, scatters, copies to the host region) is the code that runs on
a GPU. The fake checks the ordering rules a real device would enforce silently: a stream
may only wait on a recorded event, and every thread that enters a stream context has set
the layout's device first. Failures are injected into the fake's calls, and into torch ops
by releasing a tensor's memory.
"""

from __future__ import annotations

import contextlib
import threading
import time

import numpy as np
import pytest
import torch

from kvoffload.specs import CPULoadStoreSpec, DeviceLoadStoreSpec
from kvoffload.transfer import HostBlockPool, KVLayout, TransferEngine, cuda_executor
from kvoffload.transfer.cuda_executor import CUDAExecutor
from transfer_oracle import assert_state, expected_after, randomize, snapshot, three_group_layer_caches

NUM_DEVICE, NUM_HOST = 32, 16


class FakeCuda:
    """The slice of ``torch.cuda`` the executor uses. ``fail`` maps an operation name
    (``"Event.record"``, ``"TimingEvent.record"`` (a job's start and end events only),
    ``"Event.synchronize"``, ``"Stream.wait_event"``, ``"Stream"``)
    to the 1-based call that raises; ``gate`` (a threading.Event) holds every
    ``Event.synchronize`` and ``Stream.synchronize`` until it is set."""

    def __init__(self, fail: dict[str, int] | None = None, gate: threading.Event | None = None) -> None:
        self.fail = dict(fail or {})
        self.gate = gate
        self.calls: dict[str, int] = {}
        self.log: list[tuple] = []
        self.device_of: dict[int, object] = {}  # thread id -> device set there
        self._lock = threading.Lock()

    def _call(self, name: str, *detail) -> None:
        with self._lock:
            self.calls[name] = n = self.calls.get(name, 0) + 1
            self.log.append((name, threading.get_ident(), *detail))
        if self.fail.get(name) == n:
            raise RuntimeError(f"injected failure of {name} call {n}")

    def _hold(self) -> None:
        if self.gate is not None:
            self.gate.wait()

    # -- the torch.cuda surface -----------------------------------------------------------

    def set_device(self, device) -> None:
        self._call("set_device", device)
        self.device_of[threading.get_ident()] = device

    def device(self, device):
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def stream(self, stream):
        assert self.device_of.get(threading.get_ident()) == stream.device, "device not set on this thread"
        self._call("stream_context")
        yield

    def current_stream(self, device=None):
        return FakeStream(self, device)

    def Stream(self, device=None):  # noqa: N802 - torch.cuda's name
        self._call("Stream")
        return FakeStream(self, device)

    def Event(self, enable_timing: bool = False, blocking: bool = False):  # noqa: N802
        return FakeEvent(self, blocking, enable_timing)


class FakeStream:
    def __init__(self, fake: FakeCuda, device) -> None:
        self.fake, self.device = fake, device

    def wait_event(self, event: FakeEvent) -> None:
        self.fake._call("Stream.wait_event")
        assert event.recorded, "a stream waits on an event that was never recorded"

    def synchronize(self) -> None:
        self.fake._call("Stream.synchronize")
        self.fake._hold()


class FakeEvent:
    def __init__(self, fake: FakeCuda, blocking: bool, timing: bool) -> None:
        self.fake, self.blocking, self.timing, self.recorded = fake, blocking, timing, False

    def record(self, stream=None) -> None:
        self.fake._call("Event.record")
        if self.timing:
            self.fake._call("TimingEvent.record")
        self.recorded = True

    def synchronize(self) -> None:
        self.fake._call("Event.synchronize", self.blocking)
        self.fake._hold()

    def elapsed_time(self, other: FakeEvent) -> float:
        return 0.5


def make_layout(kind: str, gen: torch.Generator) -> KVLayout:
    if kind == "per_layer":
        caches, groups = three_group_layer_caches(NUM_DEVICE, gen)
        return KVLayout.from_layer_tensors(caches, groups)
    if kind == "one_group":  # the common vLLM case: every tensor in one group
        caches = {f"l{i}": torch.empty((NUM_DEVICE, 2, 8, 4), dtype=torch.float16) for i in range(5)}
        for c in caches.values():
            randomize(c.view(torch.uint8), gen)
        return KVLayout.from_layer_tensors(caches)
    # (2, num_blocks, ...) K/V caches with padded pages: rows further apart than a page.
    caches = {}
    for g, (width, pad) in enumerate(((64, 0), (96, 8), (18, 0))):
        raw = torch.empty((2, NUM_DEVICE, width + pad), dtype=torch.uint8)
        randomize(raw, gen)
        caches[f"layer{g}"] = raw[:, :, :width]
    return KVLayout.from_layer_tensors(caches, [[n] for n in caches], block_dim=1)


def make_engine(
    kind="per_layer", f=1, interleave=False, seed=0, fake=None, staging=64 << 20, one_kernel=None, **kw
):
    gen = torch.Generator().manual_seed(seed)
    layout = make_layout(kind, gen)
    pool = HostBlockPool(layout, NUM_HOST, f, interleave=interleave)
    for t in pool.tensors:
        randomize(t, gen)
    fake = fake or FakeCuda()
    executor = CUDAExecutor(layout, pool, staging_bytes=staging, one_kernel=one_kernel, cuda=fake)
    return layout, pool, fake, executor, TransferEngine(layout, pool, executor=executor, **kw)


def random_job(layout, pool, rng):
    """Random groups, sizes, alignments and ids of one job (distinct destinations)."""
    f = pool.blocks_per_offload_block
    sizes = [int(rng.integers(0, 6)) for _ in range(layout.num_groups)]
    indices = [int(rng.integers(0, 9)) for _ in sizes]
    spans = [-(-(i % f + n) // f) if n else 0 for n, i in zip(sizes, indices)]
    device_ids = rng.choice(NUM_DEVICE, sum(sizes), replace=False).tolist()
    host_ids = rng.choice(NUM_HOST, sum(spans), replace=False).tolist()
    return device_ids, sizes, indices, host_ids


def run_random_jobs(engine, layout, pool, rng, count):
    """``count`` random jobs, stores and loads in turn, each checked byte for byte."""
    for job_id in range(count):
        store = bool(job_id % 2)
        device_ids, sizes, indices, host_ids = random_job(layout, pool, rng)
        before = snapshot(layout, pool)
        device, host = DeviceLoadStoreSpec(device_ids, sizes, indices), CPULoadStoreSpec(host_ids)
        assert engine.submit(job_id, *((device, host) if store else (host, device)))
        engine.wait([job_id])
        (result,) = engine.poll()
        assert result.success, result.error
        assert_state(
            layout, pool, expected_after(layout, pool, before, store, device_ids, sizes, indices, host_ids)
        )


CASES = [
    ("per_layer", 1, False),
    ("per_layer", 1, True),
    ("per_layer", 4, False),
    ("one_group", 1, True),
    ("one_group", 3, False),
    ("kv_split", 1, True),
    ("kv_split", 2, False),
]


@pytest.mark.parametrize(("kind", "f", "interleave"), CASES)
@pytest.mark.parametrize("staging", [64 << 20, 1], ids=["one_batch", "row_batches"])
@pytest.mark.parametrize("one_kernel", [True, False], ids=["span", "per_tensor"])
def test_jobs_are_byte_exact(kind, f, interleave, staging, one_kernel):
    layout, pool, fake, executor, engine = make_engine(
        kind, f, interleave, staging=staging, one_kernel=one_kernel
    )
    assert (executor.span is not None) == one_kernel
    with engine:
        run_random_jobs(engine, layout, pool, np.random.default_rng(1), 12)
    # the staging cap holds per direction: two buffers of half of it (each raised to one
    # row of the widest group)
    widest_row = max(layout.group_page_bytes(g) for g in range(layout.num_groups))
    assert executor.peak_staging_bytes <= 2 * 2 * (max(staging // 2, widest_row) + 8)
    assert executor.peak_staging_bytes > 0


@pytest.mark.parametrize("one_kernel", [True, False], ids=["span", "per_tensor"])
@pytest.mark.parametrize("ring", ["wraps", "too_small"])
def test_index_ring_wraps_and_overflows_byte_exact(monkeypatch, one_kernel, ring):
    # Batches of one row. "wraps": a ring of three batches' indices, so it wraps (after
    # waiting for the kernel stream); "too_small": no batch fits, each gets its own buffer.
    layout, pool, fake, executor, engine = make_engine(staging=1, one_kernel=one_kernel)
    if one_kernel:
        widest = max(layout.group_page_bytes(g) // executor.span.granule for g in range(layout.num_groups))
    else:
        widest = 1
    monkeypatch.setattr(cuda_executor, "INDEX_RING_ENTRIES", 3 * widest if ring == "wraps" else 0)
    with engine:
        run_random_jobs(engine, layout, pool, np.random.default_rng(3), 10)
    wrapped = fake.calls.get("Stream.synchronize", 0)
    assert wrapped > 0 if ring == "wraps" else wrapped == 0


def test_a_staging_buffer_is_refilled_only_after_its_previous_batch_within_and_across_jobs():
    # Batches of one row on two buffers: each batch waits for its hand-over event, and
    # from the third batch of the first job on (every batch of the next job) also for the
    # event behind the last use of its buffer. Per job: the ready event and the job's
    # start event are waited for once each.
    layout, pool, fake, executor, engine = make_engine("one_group", 1, True, staging=1)
    n = 6
    store = (DeviceLoadStoreSpec(list(range(n)), [n], [0]), CPULoadStoreSpec(list(range(n))))
    waits = []
    with engine:
        for job_id in (1, 2):
            before = fake.calls.get("Stream.wait_event", 0)
            engine.submit(job_id, *store)
            engine.wait([job_id])
            waits.append(fake.calls["Stream.wait_event"] - before)
    assert [r.success for r in engine.poll()] == [True, True]
    assert waits == [2 + n + (n - 2), 2 + n + n]


def test_next_job_is_launched_while_the_last_one_copies_and_results_keep_order():
    gate = threading.Event()  # every host wait hangs until set: job 1 stays unfinished
    layout, pool, fake, executor, engine = make_engine(fake=FakeCuda(gate=gate))
    queued = threading.Event()  # job 1 is launched only once all three are queued
    launch = executor.launch

    def launch_when_queued(*args, **kwargs):
        queued.wait(5)
        return launch(*args, **kwargs)

    executor.launch = launch_when_queued
    with engine:
        try:
            for job_id, host in ((1, 1), (2, 2), (3, 3)):
                engine.submit(
                    job_id, DeviceLoadStoreSpec([job_id], [1, 0, 0, 0], [0] * 4), CPULoadStoreSpec([host])
                )
            queued.set()
            deadline = time.monotonic() + 5
            while fake.calls.get("TimingEvent.record", 0) < 4 and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.1)
            # jobs 1 and 2 launched (start and end events each), job 3 waits its turn
            assert fake.calls.get("TimingEvent.record") == 4
            assert engine.poll() == []
        finally:
            gate.set()
        engine.wait([1, 2, 3], timeout=5)
    assert [(r.job_id, r.success) for r in engine.poll()] == [(1, True), (2, True), (3, True)]


def test_device_set_and_blocking_events_on_every_copying_thread():
    layout, pool, fake, executor, engine = make_engine()
    with engine:
        engine.submit(1, DeviceLoadStoreSpec([3], [1, 0, 0, 0], [0] * 4), CPULoadStoreSpec([2]))
        engine.submit(2, CPULoadStoreSpec([2]), DeviceLoadStoreSpec([7], [1, 0, 0, 0], [0] * 4))
        engine.wait([1, 2])
    assert [r.success for r in engine.poll()] == [True, True]
    copying = {entry[1] for entry in fake.log if entry[0] == "stream_context"}
    assert len(copying) == 2  # one worker thread per direction
    assert all(fake.device_of[t] == layout.device for t in copying)
    waits = [entry[2] for entry in fake.log if entry[0] == "Event.synchronize"]
    assert waits and all(waits)  # every host wait is on a blocking event


def test_failure_at_submit_is_one_failed_result_and_no_pending_id():
    # The first Event.record is job 1's ready event, on the submitting thread.
    layout, pool, fake, executor, engine = make_engine(fake=FakeCuda({"Event.record": 1}))
    store = (DeviceLoadStoreSpec([0], [1, 0, 0, 0], [0] * 4), CPULoadStoreSpec([1]))
    with engine:
        assert engine.submit(1, *store) is True  # no exception
        engine.wait([1], timeout=5)
        assert [(r.job_id, r.success) for r in engine.poll()] == [(1, False)]
        assert engine.submit(1, *store) is True  # the id is free again, and it works
        engine.wait([1], timeout=5)
        assert [(r.job_id, r.success) for r in engine.poll()] == [(1, True)]
    assert engine.poll() == []


@pytest.mark.parametrize("failing", ["Stream.wait_event", "Event.synchronize", "Stream"])
def test_failure_in_a_job_fails_it_once_and_later_jobs_run(failing):
    layout, pool, fake, executor, engine = make_engine(fake=FakeCuda({failing: 1}))
    before = snapshot(layout, pool)
    with engine:
        for job_id, host in ((1, 1), (2, 2)):
            engine.submit(job_id, DeviceLoadStoreSpec([5], [1, 0, 0, 0], [0] * 4), CPULoadStoreSpec([host]))
        engine.wait([1, 2], timeout=5)
        results = engine.poll()
    assert [(r.job_id, r.success) for r in results] == [(1, False), (2, True)]
    assert results[0].error.startswith("RuntimeError: injected failure")
    assert engine.poll() == []
    if failing != "Stream":  # the streams existed: both were fenced before the report
        assert fake.calls.get("Stream.synchronize") == 2
    want = expected_after(layout, pool, before, True, [5], [1, 0, 0, 0], [0] * 4, [2])
    for t in layout.groups[0]:  # the failed job's destination is unspecified
        want[1][t][1] = pool.tensors[t][1]
    assert_state(layout, pool, want)


def test_failed_job_is_reported_only_after_its_stream_is_fenced():
    # Job 1's end event fails to record (its copies are queued by then); the fence holds.
    gate = threading.Event()
    fake = FakeCuda({"TimingEvent.record": 2}, gate)  # 1: start, 2: end
    layout, pool, fake, executor, engine = make_engine(fake=fake)
    with engine:
        try:
            engine.submit(1, DeviceLoadStoreSpec([5], [1, 0, 0, 0], [0] * 4), CPULoadStoreSpec([1]))
            deadline = time.monotonic() + 5
            while not fake.calls.get("Stream.synchronize") and time.monotonic() < deadline:
                time.sleep(0.01)
            assert fake.calls.get("Stream.synchronize") == 1  # the fence runs...
            with pytest.raises(TimeoutError):
                engine.wait([1], timeout=0.2)  # ...and the job is not finished before it ends
            assert engine.poll() == []
        finally:
            gate.set()
        engine.wait([1], timeout=5)
        assert [(r.job_id, r.success) for r in engine.poll()] == [(1, False)]


@pytest.mark.parametrize("one_kernel", [True, False], ids=["span", "per_tensor"])
def test_a_torch_error_mid_job_fails_only_that_job(one_kernel):
    layout, pool, fake, executor, engine = make_engine(one_kernel=one_kernel)
    layout.tensors[layout.groups[1][0]].untyped_storage().resize_(0)  # memory released
    with engine:
        engine.submit(1, DeviceLoadStoreSpec([0, 1], [1, 1, 0, 0], [0] * 4), CPULoadStoreSpec([0, 1]))
        engine.submit(2, DeviceLoadStoreSpec([5], [1, 0, 0, 0], [0] * 4), CPULoadStoreSpec([4]))
        engine.wait([1, 2], timeout=5)
        assert [(r.job_id, r.success) for r in engine.poll()] == [(1, False), (2, True)]
    assert fake.calls.get("Stream.synchronize") == 2  # both side streams fenced


def test_close_is_bounded_and_reports_a_stuck_job_once():
    gate = threading.Event()  # every host wait hangs: a device that never finishes
    layout, pool, fake, executor, engine = make_engine(fake=FakeCuda(gate=gate), close_timeout=0.3)
    engine.submit(1, DeviceLoadStoreSpec([0], [1, 0, 0, 0], [0] * 4), CPULoadStoreSpec([0]))
    engine.submit(2, DeviceLoadStoreSpec([1], [1, 0, 0, 0], [0] * 4), CPULoadStoreSpec([1]))
    start = time.monotonic()
    engine.close()
    assert time.monotonic() - start < 5
    results = engine.poll()
    assert sorted((r.job_id, r.success) for r in results) == [(1, False), (2, False)]
    assert all(r.direction == "store" for r in results)
    gate.set()  # the stuck copy ends after all: no second result
    time.sleep(0.3)
    assert engine.poll() == []
    engine.wait([1, 2], timeout=1)
