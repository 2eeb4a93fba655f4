"""A load chained on a promotion starts in pieces (``WorkerRouter`` with
``kvoffload.held_loads``): the blocks already in host memory at once, each block a
promotion reports written as soon as it is, and never a block before its bytes arrived
or after its promotion failed. Real host pool, real ``TransferEngine``; the promotions
come from a shelf worker that reports each block and waits for a test's go per block,
and from the real disk tier."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from kvoffload import held_loads
from kvoffload.specs import CPULoadStoreSpec, DeviceLoadStoreSpec, DiskLoadStoreSpec
from kvoffload.tiers.fs.format import DATA_FILE
from kvoffload.tiers.fs.worker import FSWorker
from kvoffload.transfer import HostBlockPool, KVLayout, TransferEngine
from kvoffload.worker import TransferResult, WorkerRouter
from shelf_tier import ShelfSpec, ShelfWorker
from transfer_oracle import three_group_layer_caches

TIMEOUT = 30  # a hang guard only


class SteppedShelf(ShelfWorker):
    """Reads a promotion block by block: block ``i`` waits for ``go[i]``, is copied (or
    fails, if its slot is in ``bad``), reported (``on_progress``) and then ``told[i]`` is set."""

    reports_progress = True

    def __init__(self, pool, blocks: int):
        super().__init__(pool)
        self.go = [threading.Event() for _ in range(blocks)]
        self.told = [threading.Event() for _ in range(blocks)]
        self.bad: set[int] = set()

    def _run(self, job_id, src, dst):
        if src.medium == "CPU":
            return super()._run(job_id, src, dst)
        error = None
        for i, (slot, block) in enumerate(zip(src.block_ids.tolist(), dst.block_ids.tolist())):
            self.go[i].wait(TIMEOUT)
            if slot in self.bad:
                error = f"slot {slot}: checksum mismatch (injected)"
                self.told[i].set()
                break
            for t, row in zip(self.pool.tensors, self.shelf[slot]):
                t[block].copy_(torch.frombuffer(bytearray(row), dtype=torch.uint8))
            self.on_progress(job_id, [block])
            self.told[i].set()
        with self._lock:
            self._results.append(TransferResult(job_id, error is None, 0, 0.0, "SHELF->CPU", error))
        self.on_progress(job_id, None)


class Engine(TransferEngine):
    """The host-memory engine, recording the host blocks of every job it is given."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.given: dict[int, list[int]] = {}

    def submit(self, job_id, src_spec, dst_spec):
        self.given[job_id] = src_spec.block_ids.tolist()
        return super().submit(job_id, src_spec, dst_spec)


@pytest.fixture
def setup():
    gen = torch.Generator().manual_seed(5)
    caches, groups = three_group_layer_caches(8, gen)
    layout = KVLayout.from_layer_tensors(caches, groups)
    pool = HostBlockPool(layout, 8)
    engine = Engine(layout, pool)
    shelf = SteppedShelf(pool, 3)
    router = WorkerRouter([engine, shelf])
    yield layout, pool, engine, shelf, router
    for go in shelf.go:
        go.set()
    router.close()


def device_spec(ids):
    return DeviceLoadStoreSpec(ids, [len(ids), 0, 0, 0], [0, 0, 0, 0])


def fill_slot(pool, shelf, slot, value):
    shelf.shelf[slot] = [bytes([value]) * t[0].numel() * t.element_size() for t in pool.tensors]


def holds(layout, block, value) -> bool:
    return bool((layout.tensors[0][block].view(torch.uint8) == value).all())


def test_pieces_start_as_their_blocks_arrive_and_one_result_comes_at_the_end(setup, monkeypatch):
    monkeypatch.setattr(held_loads, "MAX_PIECES", 2)  # a 4-block load's pieces: 2 blocks at least
    layout, pool, engine, shelf, router = setup
    pool.tensors[0][0].fill_(4)  # host block 0: in host memory already
    for slot, value in ((9, 7), (10, 8), (11, 9)):
        fill_slot(pool, shelf, slot, value)
    router.submit(1, ShelfSpec([9, 10, 11]), CPULoadStoreSpec([3, 4, 5]))
    router.submit(2, CPULoadStoreSpec([0, 3, 4, 5]), device_spec([1, 2, 5, 6]))
    assert list(engine.given.values()) == [[0]]  # the resident block, at once
    engine.wait(list(engine.given), TIMEOUT)  # its piece done: the next one may start
    shelf.go[0].set()
    shelf.told[0].wait(TIMEOUT)
    assert router.poll() == [] and len(engine.given) == 1  # one block: too small a piece alone
    shelf.go[1].set()
    shelf.told[1].wait(TIMEOUT)
    assert router.poll() == []  # starts host blocks 3 and 4; the load has not ended
    assert list(engine.given.values()) == [[0], [3, 4]]
    engine.wait(list(engine.given), TIMEOUT)
    assert holds(layout, 1, 4) and holds(layout, 2, 7) and holds(layout, 5, 8) and not holds(layout, 6, 9)
    shelf.go[2].set()
    router.wait([2], TIMEOUT)
    assert holds(layout, 6, 9)
    results = {r.job_id: r for r in router.poll()}
    assert sorted(results) == [1, 2] and results[1].success and results[2].success
    assert results[2].bytes == 4 * layout.group_page_bytes(0)  # every piece's bytes
    assert [h for ids in engine.given.values() for h in ids] == [0, 3, 4, 5]  # each block once


def test_blocks_that_arrive_while_a_piece_copies_start_next_as_one_piece(setup, monkeypatch):
    monkeypatch.setattr(held_loads, "MAX_PIECES", 4)  # a 4-block load: any block is a piece
    layout, pool, engine, shelf, router = setup
    gate = threading.Event()  # holds the engine's copies until set
    launch = engine._executor.launch

    def gated(*args, **kwargs):
        gate.wait(TIMEOUT)
        return launch(*args, **kwargs)

    engine._executor.launch = gated
    pool.tensors[0][0].fill_(4)
    for slot, value in ((9, 7), (10, 8), (11, 9)):
        fill_slot(pool, shelf, slot, value)
    router.submit(1, ShelfSpec([9, 10, 11]), CPULoadStoreSpec([3, 4, 5]))
    router.submit(2, CPULoadStoreSpec([0, 3, 4, 5]), device_spec([1, 2, 5, 6]))
    try:
        assert list(engine.given.values()) == [[0]]  # the resident block, copying (held at the gate)
        for i in (0, 1):
            shelf.go[i].set()
            shelf.told[i].wait(TIMEOUT)
            assert router.poll() == [] and len(engine.given) == 1  # host blocks 3, 4 wait for it
    finally:
        gate.set()
    engine.wait(list(engine.given), TIMEOUT)
    assert router.poll() == []
    assert list(engine.given.values()) == [[0], [3, 4]]  # what arrived meanwhile: one piece
    shelf.go[2].set()
    router.wait([2], TIMEOUT)
    assert {r.job_id: r.success for r in router.poll()} == {1: True, 2: True}
    assert list(engine.given.values()) == [[0], [3, 4], [5]]
    assert holds(layout, 1, 4) and holds(layout, 2, 7) and holds(layout, 5, 8) and holds(layout, 6, 9)


def test_without_resident_blocks_the_first_block_to_arrive_waits_for_a_piece_of_its_size(setup, monkeypatch):
    monkeypatch.setattr(held_loads, "MAX_PIECES", 2)  # a 3-block load's pieces: 2 blocks at least
    layout, pool, engine, shelf, router = setup
    for slot, value in ((9, 7), (10, 8), (11, 9)):
        fill_slot(pool, shelf, slot, value)
    router.submit(1, ShelfSpec([9, 10, 11]), CPULoadStoreSpec([3, 4, 5]))
    router.submit(2, CPULoadStoreSpec([3, 4, 5]), device_spec([2, 5, 6]))
    assert engine.given == {}  # nothing resident: nothing at submission
    shelf.go[0].set()
    shelf.told[0].wait(TIMEOUT)
    assert router.poll() == [] and engine.given == {}  # one block: below a piece's size
    shelf.go[1].set()
    shelf.told[1].wait(TIMEOUT)
    assert router.poll() == [] and list(engine.given.values()) == [[3, 4]]
    shelf.go[2].set()
    router.wait([2], TIMEOUT)
    assert {r.job_id: r.success for r in router.poll()} == {1: True, 2: True}
    assert holds(layout, 2, 7) and holds(layout, 5, 8) and holds(layout, 6, 9)


def test_a_failed_promotion_block_fails_the_load_and_its_piece_never_runs(setup):
    layout, pool, engine, shelf, router = setup
    fill_slot(pool, shelf, 9, 7)
    fill_slot(pool, shelf, 10, 8)
    pool.tensors[0][4].fill_(5)  # what host block 4 held before: a piece that ran would copy it
    before = layout.tensors[0][5].clone()
    shelf.bad = {10}
    router.submit(1, ShelfSpec([9, 10]), CPULoadStoreSpec([3, 4]))
    router.submit(2, CPULoadStoreSpec([3, 4]), device_spec([2, 5]))
    shelf.go[0].set()
    shelf.go[1].set()
    router.wait([2], TIMEOUT)
    results = {r.job_id: r for r in router.poll()}
    assert not results[1].success and not results[2].success and results[2].bytes == 0
    assert "promotion 1 of its source blocks failed: slot 10: checksum mismatch" in results[2].error
    assert torch.equal(layout.tensors[0][5], before)  # host block 4's piece never ran
    assert all(4 not in ids for ids in engine.given.values())


def test_a_load_that_is_not_one_host_block_per_device_block_starts_whole():
    gen = torch.Generator().manual_seed(5)
    caches, groups = three_group_layer_caches(8, gen)
    layout = KVLayout.from_layer_tensors(caches, groups)
    pool = HostBlockPool(layout, 8, blocks_per_offload_block=2)  # a host block holds two
    engine = Engine(layout, pool)
    shelf = SteppedShelf(pool, 2)
    router = WorkerRouter([engine, shelf])
    try:
        fill_slot(pool, shelf, 9, 7)
        router.submit(1, ShelfSpec([9]), CPULoadStoreSpec([3]))
        router.submit(2, CPULoadStoreSpec([0, 3]), device_spec([1, 2, 5, 6]))
        assert engine.given == {}  # host block 0 is resident, but nothing can start alone
        shelf.go[0].set()
        router.wait([2], TIMEOUT)
        assert engine.given == {2: [0, 3]}  # whole, under its own id
        assert {r.job_id: r.success for r in router.poll()} == {1: True, 2: True}
        assert holds(layout, 5, 7) and holds(layout, 6, 7)
    finally:
        router.close()


def test_the_disk_tier_streams_a_promotion_run_by_run(tmp_path):
    gen = torch.Generator().manual_seed(6)
    caches, groups = three_group_layer_caches(8, gen)
    layout = KVLayout.from_layer_tensors(caches, groups)
    pool = HostBlockPool(layout, 8)
    fs = FSWorker(pool, tmp_path, "ns", 1 << 20)
    told: list[tuple[int, list[int] | None]] = []
    fs.on_progress = lambda job_id, blocks: told.append((job_id, None if blocks is None else list(blocks)))
    keys = [bytes([i]) * 36 for i in range(4)]
    for i in range(4):
        pool.tensors[0][i].fill_(10 + i)
    fs.submit(1, CPULoadStoreSpec([0, 1, 2, 3]), DiskLoadStoreSpec([0, 2, 4, 6], keys))
    fs.wait([1], TIMEOUT)
    assert [r.success for r in fs.poll()] == [True] and told == []  # stores are not reported
    fs.submit(2, DiskLoadStoreSpec([0, 2, 4, 6], keys), CPULoadStoreSpec([4, 5, 6, 7]))  # four runs
    fs.wait([2], TIMEOUT)
    assert [(r.success, r.error) for r in fs.poll()] == [(True, None)]
    assert sorted(told[:-1]) == [(2, [4]), (2, [5]), (2, [6]), (2, [7])] and told[-1] == (2, None)
    assert all(holds_host(pool, 4 + i, 10 + i) for i in range(4))
    told.clear()
    with open(os.path.join(fs.path, DATA_FILE), "r+b") as f:  # slot 4's payload corrupt
        f.seek(fs.geometry.data_offset(4) + 3)
        byte = f.read(1)
        f.seek(fs.geometry.data_offset(4) + 3)
        f.write(bytes([byte[0] ^ 0x40]))
    fs.submit(3, DiskLoadStoreSpec([0, 2, 4, 6], keys), CPULoadStoreSpec([4, 5, 6, 7]))
    fs.wait([3], TIMEOUT)
    assert [r.success for r in fs.poll()] == [False]
    assert told[-1] == (3, None)  # after its result
    assert all(job == 3 and 6 not in blocks for job, blocks in told[:-1])  # slot 4 never reported
    fs.close()


def holds_host(pool, block, value) -> bool:
    return bool((pool.tensors[0][block] == value).all())


@pytest.mark.parametrize("corrupt", [False, True])
def test_a_load_chained_on_a_disk_promotion_through_the_router(tmp_path, corrupt):
    gen = torch.Generator().manual_seed(7)
    caches, groups = three_group_layer_caches(8, gen)
    layout = KVLayout.from_layer_tensors(caches, groups)
    pool = HostBlockPool(layout, 8)
    engine = Engine(layout, pool)
    fs = FSWorker(pool, tmp_path, "ns", 1 << 20)
    router = WorkerRouter([engine, fs])
    try:
        keys = [bytes([i + 1]) * 36 for i in range(4)]
        for i in range(4):
            pool.tensors[0][i].fill_(20 + i)
        router.submit(1, CPULoadStoreSpec([0, 1, 2, 3]), DiskLoadStoreSpec([0, 2, 4, 6], keys))
        router.wait([1], TIMEOUT)
        if corrupt:  # slot 4: host block 6, device block 3
            with open(os.path.join(fs.path, DATA_FILE), "r+b") as f:
                f.seek(fs.geometry.data_offset(4) + 3)
                byte = f.read(1)
                f.seek(fs.geometry.data_offset(4) + 3)
                f.write(bytes([byte[0] ^ 0x40]))
        before = layout.tensors[0][3].clone()
        router.submit(2, DiskLoadStoreSpec([0, 2, 4, 6], keys), CPULoadStoreSpec([4, 5, 6, 7]))  # four runs
        router.submit(3, CPULoadStoreSpec([4, 5, 6, 7]), device_spec([1, 2, 3, 4]))
        router.wait([3], TIMEOUT)
        results = {r.job_id: r for r in router.poll()}
        assert sorted(results) == [1, 2, 3] and results[2].success is (not corrupt)
        assert results[3].success is (not corrupt)
        if corrupt:
            assert all(6 not in ids for ids in engine.given.values())  # its piece never started
            assert "promotion 2 of its source blocks failed" in results[3].error
            assert torch.equal(layout.tensors[0][3], before)
        else:
            assert all(holds(layout, 1 + i, 20 + i) for i in range(4))
            assert sorted(h for ids in engine.given.values() for h in ids) == [4, 5, 6, 7]
    finally:
        router.close()


def test_a_load_submitted_after_its_promotion_ended_starts_whole_at_once(setup):
    layout, pool, engine, shelf, router = setup
    for slot, value in ((9, 7), (10, 8), (11, 9)):
        fill_slot(pool, shelf, slot, value)
    router.submit(1, ShelfSpec([9, 10, 11]), CPULoadStoreSpec([3, 4, 5]))
    for go, told in zip(shelf.go, shelf.told):
        go.set()
        told.wait(TIMEOUT)
    shelf.wait([1], TIMEOUT)  # ended; nobody polled the router since
    router.submit(2, CPULoadStoreSpec([0, 3, 4, 5]), device_spec([1, 2, 5, 6]))
    assert engine.given == {2: [0, 3, 4, 5]}  # one job, under its own id
    router.wait([2], TIMEOUT)
    assert {r.job_id: r.success for r in router.poll()} == {1: True, 2: True}
    assert holds(layout, 2, 7) and holds(layout, 5, 8) and holds(layout, 6, 9)


def test_a_load_submitted_after_its_promotion_failed_fails_unrun(setup):
    layout, pool, engine, shelf, router = setup
    fill_slot(pool, shelf, 9, 7)
    fill_slot(pool, shelf, 10, 8)
    shelf.bad = {10}
    before = layout.tensors[0][5].clone()
    router.submit(1, ShelfSpec([9, 10]), CPULoadStoreSpec([3, 4]))
    shelf.go[0].set()
    shelf.go[1].set()
    shelf.wait([1], TIMEOUT)  # failed; nobody polled the router since
    router.submit(2, CPULoadStoreSpec([0, 3, 4]), device_spec([1, 2, 5]))
    router.wait([2], TIMEOUT)
    results = {r.job_id: r for r in router.poll()}
    assert not results[1].success and not results[2].success
    assert "promotion 1 of its source blocks failed" in results[2].error
    assert engine.given == {} and torch.equal(layout.tensors[0][5], before)  # nothing of it ran
