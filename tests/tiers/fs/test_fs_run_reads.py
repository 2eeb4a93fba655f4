"""A disk load's pieces: each run of slots is reported (``on_progress``) only once its
records, keys and payload CRCs checked out, with the bytes already in the host rows; a
failed run is never reported and nothing after it starts; a chained device load copies
nothing of a run that was not reported. Both read paths: the native one
(``kvoffload.tiers.fs._runread``, one call without the GIL per run) and the Python one.
Real files, a real host pool and a real ``TransferEngine``; damage is done with ordinary
writes."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from kvoffload import held_loads
from kvoffload.specs import CPULoadStoreSpec, DeviceLoadStoreSpec, DiskLoadStoreSpec
from kvoffload.tiers.fs import block_io
from kvoffload.tiers.fs import worker as fs_worker
from kvoffload.tiers.fs.format import DATA_FILE, HEADER_FILE, RECORD_BYTES
from kvoffload.tiers.fs.worker import FSWorker
from kvoffload.transfer import HostBlockPool, KVLayout, TransferEngine
from kvoffload.worker import WorkerRouter
from transfer_oracle import host_block, make_pool, pool_block_bytes, three_group_layer_caches

TIMEOUT = 30  # a hang guard only
RUN = 4  # blocks per run in these tests
PATHS = ["native", "python"]


@pytest.fixture(params=PATHS)
def read_path(request, monkeypatch):
    """The read path under test, with runs of ``RUN`` blocks (set before a worker is built)."""
    if request.param == "native":
        if not block_io.native_reads():
            pytest.skip("kvoffload.tiers.fs._runread was not built")
    else:
        monkeypatch.setattr(block_io, "_runread", None)
    return request.param


def runs_of(monkeypatch, pool) -> None:
    block = pool_block_bytes(pool)
    monkeypatch.setattr(fs_worker, "RUN_BYTES", RUN * block)
    monkeypatch.setattr(fs_worker, "NATIVE_LOAD_RUN_BYTES", RUN * block)


def keys_of(n: int) -> list[bytes]:
    return [bytes([i + 1]) * 36 for i in range(n)]


def flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))


class Reports:
    """``on_progress`` of a worker: each report, and whether the reported host blocks held
    their expected bytes at that moment."""

    def __init__(self, pool, expected: dict[int, bytes]):
        self.pool, self.expected = pool, expected
        self.told: list[tuple[int, list[int] | None]] = []
        self.held_then: list[bool] = []
        self.lock = threading.Lock()

    def __call__(self, job_id, blocks):
        with self.lock:
            self.told.append((job_id, None if blocks is None else list(blocks)))
            if blocks is not None:
                self.held_then.append(all(host_block(self.pool, b) == self.expected[b] for b in blocks))


def stored_tier(tmp_path, monkeypatch, n: int):
    """A one-thread disk worker holding ``n`` blocks (host blocks 0..n-1) in slots 0..n-1,
    the load destinations n..2n-1 cleared; the expected bytes of each destination."""
    pool = make_pool(num_host=2 * n)
    runs_of(monkeypatch, pool)
    fs = FSWorker(pool, tmp_path, "ns", 4 * n * (pool_block_bytes(pool) + 8192), load_threads=1)
    keys = keys_of(n)
    fs.submit(1, CPULoadStoreSpec(list(range(n))), DiskLoadStoreSpec(list(range(n)), keys))
    fs.wait([1], TIMEOUT)
    assert [r.success for r in fs.poll()] == [True]
    expected = {n + i: host_block(pool, i) for i in range(n)}
    for t in pool.tensors:
        t[n:].zero_()
    return pool, fs, keys, expected


def load(fs, job_id, keys, n):
    fs.submit(job_id, DiskLoadStoreSpec(list(range(n)), keys), CPULoadStoreSpec(list(range(n, 2 * n))))
    fs.wait([job_id], TIMEOUT)
    (result,) = fs.poll()
    return result


def test_each_run_is_reported_in_order_once_its_bytes_are_in_place(tmp_path, monkeypatch, read_path):
    pool, fs, keys, expected = stored_tier(tmp_path, monkeypatch, 10)
    reports = fs.on_progress = Reports(pool, expected)
    result = load(fs, 2, keys, 10)
    assert result.success and result.error is None
    # one thread: runs of RUN consecutive slots, in slot order, then the job's end
    assert reports.told == [(2, [10, 11, 12, 13]), (2, [14, 15, 16, 17]), (2, [18, 19]), (2, None)]
    assert reports.held_then == [True, True, True]  # each checked and in place when told
    fs.close()


@pytest.mark.parametrize("damage", ["payload byte", "record key"])
def test_a_failed_middle_run_is_never_reported_and_the_runs_after_it_never_start(
    tmp_path, monkeypatch, read_path, damage
):
    pool, fs, keys, expected = stored_tier(tmp_path, monkeypatch, 12)
    if damage == "payload byte":  # slot 6: the middle run's third block
        flip(os.path.join(fs.path, DATA_FILE), fs.geometry.data_offset(6) + 9)
        reason = "checksum mismatch"
    else:
        flip(os.path.join(fs.path, HEADER_FILE), 6 * RECORD_BYTES + 60)  # inside the key
        reason = "header record checksum mismatch"
    reports = fs.on_progress = Reports(pool, expected)
    result = load(fs, 2, keys, 12)
    assert not result.success and result.bytes == 0
    assert f"key {keys[6].hex()} in slot 6: {reason}" in result.error
    assert reports.told == [(2, [12, 13, 14, 15]), (2, None)]  # the first run only, then the end
    assert reports.held_then == [True]
    assert all(host_block(pool, b) == bytes(len(expected[b])) for b in range(20, 24))  # never read
    assert fs.counters().corrupt_blocks == 1 and fs.counters().loads_failed == 1
    fs.close()


def test_a_checksum_failure_inside_a_run_names_its_block_and_reports_nothing_of_it(
    tmp_path, monkeypatch, read_path
):
    pool, fs, keys, expected = stored_tier(tmp_path, monkeypatch, 4)  # one run
    flip(os.path.join(fs.path, DATA_FILE), fs.geometry.data_offset(2) + pool_block_bytes(pool) - 1)
    reports = fs.on_progress = Reports(pool, expected)
    result = load(fs, 2, keys, 4)
    assert not result.success and f"key {keys[2].hex()} in slot 2: checksum mismatch (stored" in result.error
    assert reports.told == [(2, None)]
    # invalidated: read again, the record itself is refused now
    assert "empty slot" in load(fs, 3, keys, 4).error
    fs.close()


def device_spec(ids):
    return DeviceLoadStoreSpec(ids, [len(ids), 0, 0, 0], [0, 0, 0, 0])


@pytest.mark.parametrize("corrupt", [None, 6])
def test_a_chained_load_copies_each_reported_run_and_nothing_of_a_failed_one(
    tmp_path, monkeypatch, read_path, corrupt
):
    monkeypatch.setattr(held_loads, "MAX_PIECES", 3)  # a 12-block load: pieces of a run or more
    gen = torch.Generator().manual_seed(8)
    caches, groups = three_group_layer_caches(16, gen)
    layout = KVLayout.from_layer_tensors(caches, groups)
    pool = HostBlockPool(layout, 24)
    runs_of(monkeypatch, pool)
    engine = TransferEngine(layout, pool)
    fs = FSWorker(pool, tmp_path, "ns", 64 * (pool_block_bytes(pool) + 8192), load_threads=1)
    router = WorkerRouter([engine, fs])
    try:
        keys = keys_of(12)
        for i in range(12):
            pool.tensors[0][i].fill_(30 + i)
        router.submit(1, CPULoadStoreSpec(list(range(12))), DiskLoadStoreSpec(list(range(12)), keys))
        router.wait([1], TIMEOUT)
        if corrupt is not None:  # the middle run's third block
            flip(os.path.join(fs.path, DATA_FILE), fs.geometry.data_offset(corrupt) + 3)
        before = layout.tensors[0].clone()
        started: list[list[int]] = []
        submit = engine.submit

        def recording(job_id, src, dst):
            started.append(src.block_ids.tolist())
            return submit(job_id, src, dst)

        engine.submit = recording
        router.submit(2, DiskLoadStoreSpec(list(range(12)), keys), CPULoadStoreSpec(list(range(12, 24))))
        router.submit(3, CPULoadStoreSpec(list(range(12, 24))), device_spec(list(range(12))))
        router.wait([3], TIMEOUT)
        results = {r.job_id: r for r in router.poll()}
        assert results[2].success is results[3].success is (corrupt is None)
        copied = sorted(h for ids in started for h in ids)
        page = layout.tensors[0]
        if corrupt is None:
            assert copied == list(range(12, 24))
            assert all(bool((page[d].view(torch.uint8) == 30 + d).all()) for d in range(12))
        else:
            assert "promotion 2 of its source blocks failed" in results[3].error
            assert set(copied) <= set(range(12, 16))  # the first run's piece at most
            assert torch.equal(page[4:], before[4:])  # nothing of the failed run or after it
    finally:
        router.close()


def test_native_checksums_are_the_crc32c_packages():
    if not block_io.native_reads():
        pytest.skip("kvoffload.tiers.fs._runread was not built")
    import crc32c

    from kvoffload.tiers.fs import _runread

    data = os.urandom(70_000)
    for start, end in ((0, 0), (0, 1), (3, 11), (1, 12_289), (5, 40_000), (0, 70_000)):
        part = data[start:end]
        assert _runread.crc32c(part) == crc32c.crc32c(part)
        assert _runread.crc32c(part, 0x1234) == crc32c.crc32c(part, 0x1234)


def test_native_read_refuses_bad_arguments_naming_them(tmp_path):
    if not block_io.native_reads():
        pytest.skip("kvoffload.tiers.fs._runread was not built")
    from kvoffload.tiers.fs import _runread

    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        buf = [bytearray(16)]
        with pytest.raises(ValueError, match="2 blocks but 1 keys"):
            _runread.read_run(fd, fd, 0, [b"k"], [buf, buf], bytes(16), 1, 16, 0, 4096)
        with pytest.raises(ValueError, match="block 0's buffers hold 16 bytes, the payload is 32"):
            _runread.read_run(fd, fd, 0, [b"k"], [buf], bytes(16), 1, 32, 0, 4096)
        with pytest.raises(ValueError, match="key 0 must be 1..64 bytes"):
            _runread.read_run(fd, fd, 0, [b""], [buf], bytes(16), 1, 16, 0, 4096)
        with pytest.raises(ValueError, match="digest of 3 bytes"):
            _runread.read_run(fd, fd, 0, [b"k"], [buf], b"abc", 1, 16, 0, 4096)
        with pytest.raises(BufferError, match="not writable"):
            _runread.read_run(fd, fd, 0, [b"k"], [[b"read-only buffer"]], bytes(16), 1, 16, 0, 4096)
    finally:
        os.close(fd)
