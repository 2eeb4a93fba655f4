"""Loads past the page cache (``kvoffload.tiers.fs.direct``): cold reads go through
``O_DIRECT``, warm, mostly cached and dirty ones through the cache, and every one is
byte-exact and checked. Real files on the test's file system; the page cache is emptied
with ``posix_fadvise(DONTNEED)`` after an ``fsync``, until ``cachestat`` says it is."""

from __future__ import annotations

import mmap
import os
import time

import numpy as np
import pytest
import torch

from kvoffload.keys import make_offload_key
from kvoffload.specs import CPULoadStoreSpec
from kvoffload.tiers.fs.direct import DIRECT_ALIGN, PayloadReader, cache_state
from kvoffload.tiers.fs.format import DATA_FILE, Geometry
from kvoffload.tiers.fs.manager import FSOffloadingManager
from kvoffload.tiers.fs.worker import FSWorker
from kvoffload.tiers.host_rows import HostRows
from kvoffload.transfer import HostBlockPool, KVLayout

PAGE = 8192  # bytes per tensor row: aligned for O_DIRECT
TENSORS = 4
FILE_BYTES = 1 << 20


def drop_cache(path) -> None:
    """Empties ``path``'s page cache (``DONTNEED`` can miss pages still in a per-CPU batch)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        for _ in range(100):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            if cache_state(fd, 0, os.fstat(fd).st_size) == (0, 0):
                return
            time.sleep(0.01)
        pytest.skip(f"the page cache of {path} would not empty")
    finally:
        os.close(fd)


@pytest.fixture
def data_file(tmp_path):
    path = tmp_path / "data"
    payload = np.random.default_rng(0).integers(0, 256, FILE_BYTES, dtype=np.uint8).tobytes()
    path.write_bytes(payload)
    fd = os.open(path, os.O_RDWR)
    reader = PayloadReader(str(path), fd, direct=True)
    if reader.direct_fd < 0:
        reader.close()
        os.close(fd)
        pytest.skip(f"no O_DIRECT on the file system under {tmp_path}, or no cachestat(2)")
    yield path, fd, reader, payload
    reader.close()
    os.close(fd)


def aligned_buffers(count: int, size: int) -> tuple[mmap.mmap, list[memoryview]]:
    region = mmap.mmap(-1, count * size)  # page-aligned
    view = memoryview(region)
    return region, [view[i * size : (i + 1) * size] for i in range(count)]


def test_cold_read_goes_past_the_cache_and_is_byte_exact(data_file):
    path, _, reader, payload = data_file
    drop_cache(path)
    region, buffers = aligned_buffers(16, 16384)
    assert reader.read(buffers, 65536, 16 * 16384) == 16 * 16384
    assert bytes(region) == payload[65536 : 65536 + 16 * 16384]
    assert reader.direct_reads == 1


@pytest.mark.parametrize("cached", [FILE_BYTES, 3 * 65536], ids=["whole_file", "three_quarters"])
def test_a_cached_or_mostly_cached_read_is_served_by_the_page_cache(data_file, cached):
    path, fd, reader, payload = data_file
    drop_cache(path)
    os.pread(fd, cached, 0)
    region, buffers = aligned_buffers(4, 65536)
    assert reader.read(buffers, 0, 4 * 65536) == 4 * 65536
    assert bytes(region) == payload[: 4 * 65536]
    assert reader.direct_reads == 0


def test_a_range_with_dirty_pages_is_read_through_the_cache_as_written(data_file):
    path, fd, reader, payload = data_file
    drop_cache(path)
    new = bytes(range(256)) * 64  # 16 KiB, buffered and dirty
    os.pwrite(fd, new, 32768)
    region, buffers = aligned_buffers(4, 65536)
    assert reader.read(buffers, 0, 4 * 65536) == 4 * 65536
    assert bytes(region) == payload[:32768] + new + payload[32768 + len(new) : 4 * 65536]
    assert reader.direct_reads == 0


def test_a_direct_read_after_a_write_back_returns_the_new_bytes(data_file):
    path, fd, reader, payload = data_file
    new = bytes(range(256)) * 64
    os.pwrite(fd, new, 32768)
    drop_cache(path)
    region, buffers = aligned_buffers(4, 65536)
    assert reader.read(buffers, 0, 4 * 65536) == 4 * 65536
    assert bytes(region) == payload[:32768] + new + payload[32768 + len(new) : 4 * 65536]
    assert reader.direct_reads == 1


def test_unaligned_offset_and_end_of_file_read_through_the_cache(data_file):
    path, _, reader, payload = data_file
    drop_cache(path)
    region, buffers = aligned_buffers(1, 8192)
    assert reader.read(buffers, 100, 8192) == 8192  # offset not aligned: buffered
    assert bytes(region) == payload[100 : 100 + 8192]
    assert reader.direct_reads == 0
    drop_cache(path)
    assert reader.read(buffers, FILE_BYTES - 4096, 8192) == 4096  # end of file: short
    assert bytes(region)[:4096] == payload[-4096:]


def test_without_direct_the_reader_never_opens_one(tmp_path):
    path = tmp_path / "data"
    path.write_bytes(b"x" * 8192)
    fd = os.open(path, os.O_RDONLY)
    reader = PayloadReader(str(path), fd, direct=False)
    assert reader.direct_fd == -1
    buf = bytearray(8192)
    assert reader.read([buf], 0, 8192) == 8192 and buf == b"x" * 8192
    reader.close()
    os.close(fd)


def test_host_rows_alignment():
    def pool(page: int) -> HostBlockPool:
        layout = KVLayout([torch.empty((1, page), dtype=torch.uint8) for _ in range(TENSORS)])
        return HostBlockPool(layout, 8, pin_memory=False)

    assert HostRows(pool(PAGE)).aligned(DIRECT_ALIGN)
    assert not HostRows(pool(PAGE + 512)).aligned(DIRECT_ALIGN)


def k(i: int) -> bytes:
    return make_offload_key(i.to_bytes(32, "big"), 0)


def test_worker_cold_loads_are_byte_exact_and_a_corrupt_block_is_still_caught(tmp_path):
    layout = KVLayout([torch.empty((1, PAGE), dtype=torch.uint8) for _ in range(TENSORS)])
    pool = HostBlockPool(layout, 16, pin_memory=False)
    gen = torch.Generator().manual_seed(3)
    for t in pool.tensors:
        t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=gen))
    block_bytes = PAGE * TENSORS
    bytes_to_use = 16 * Geometry(block_bytes).stored_block_bytes
    manager = FSOffloadingManager(tmp_path, "ns", block_bytes, bytes_to_use)
    worker = FSWorker(pool, tmp_path, "ns", bytes_to_use)
    if worker.files.reader.direct_fd < 0:
        worker.close()
        manager.close()
        pytest.skip(f"no O_DIRECT on the file system under {tmp_path}, or no cachestat(2)")

    def run(job_id, src, dst):
        assert worker.submit(job_id, src, dst)
        worker.wait([job_id])
        (result,) = worker.poll()
        return result

    def host(h: int) -> bytes:
        return b"".join(t[h].numpy().tobytes() for t in pool.tensors)

    keys = [k(i) for i in range(8)]
    expected = [host(h) for h in range(8)]
    out = manager.prepare_store(keys)
    assert run(1, CPULoadStoreSpec(list(range(8))), out.store_spec).success
    manager.complete_store(keys)
    data = os.path.join(worker.path, DATA_FILE)
    drop_cache(data)
    spec = manager.prepare_load(keys)
    result = run(2, spec, CPULoadStoreSpec(list(range(8, 16))))
    manager.complete_load(keys)
    assert result.success, result.error
    assert [host(h) for h in range(8, 16)] == expected
    assert worker.files.reader.direct_reads >= 1
    # flip one payload byte on disk: the direct read is checked like any other
    slot = int(spec.block_ids[3])
    fd = os.open(data, os.O_RDWR)
    (byte,) = os.pread(fd, 1, slot * Geometry(block_bytes).slot_stride + 100)
    os.pwrite(fd, bytes([byte ^ 0xFF]), slot * Geometry(block_bytes).slot_stride + 100)
    os.close(fd)
    drop_cache(data)
    before = worker.files.reader.direct_reads
    spec = manager.prepare_load([keys[3]])
    result = run(3, spec, CPULoadStoreSpec([12]))
    manager.complete_load([keys[3]])
    assert not result.success and "checksum mismatch" in result.error
    assert worker.files.reader.direct_reads > before
    assert worker.counters().corrupt_blocks == 1
    worker.close()
    manager.close()


def test_direct_reads_setting_is_checked_and_can_turn_it_off(tmp_path):
    from kvoffload.tiers.fs.tier import FSTierType

    base = {"root_dir": str(tmp_path), "bytes_to_use": 1 << 20}
    assert FSTierType.parse(base).direct_reads is True
    assert FSTierType.parse({**base, "direct_reads": False}).direct_reads is False
    with pytest.raises(ValueError, match="direct_reads must be true or false, got 'yes'"):
        FSTierType.parse({**base, "direct_reads": "yes"})
    layout = KVLayout([torch.empty((1, PAGE), dtype=torch.uint8) for _ in range(TENSORS)])
    pool = HostBlockPool(layout, 4, pin_memory=False)
    worker = FSWorker(pool, tmp_path, "ns", 1 << 20, direct_reads=False)
    assert worker.files.reader.direct_fd == -1
    worker.close()
