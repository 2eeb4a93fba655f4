"""The disk tier's store path pieces: ``HostRows`` (a host block as merged byte views),
``SlotSpace`` (the data file reserved ahead of writes, within the tier's bound) and the
short-write path of ``BlockFiles``. Real pools, real files."""

from __future__ import annotations

import os
import resource
import signal

import numpy as np
import pytest
import torch
from test_fs_worker import Tier, k

from kvoffload.specs import CPULoadStoreSpec
from kvoffload.tiers.fs.block_io import BlockFiles, CorruptBlock
from kvoffload.tiers.fs.format import DATA_FILE, HEADER_FILE, Geometry
from kvoffload.tiers.fs.namespace import namespace_digest
from kvoffload.tiers.fs.space import SlotSpace, fallocate
from kvoffload.tiers.host_rows import HostRows
from kvoffload.transfer import HostBlockPool, KVLayout
from transfer_oracle import host_block, make_pool


def layer_pool(interleave: bool, blocks: int = 6, pages=(4096, 4096, 8192)) -> HostBlockPool:
    layout = KVLayout([torch.empty((1, p), dtype=torch.uint8) for p in pages])
    pool = HostBlockPool(layout, blocks, pin_memory=False, interleave=interleave)
    gen = torch.Generator().manual_seed(1)
    for t in pool.tensors:
        t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=gen))
    return pool


@pytest.mark.parametrize("interleave, buffers", [(False, 3), (True, 1)])
def test_host_rows_are_the_block_bytes_with_adjacent_rows_merged(interleave, buffers):
    pool = layer_pool(interleave)
    rows = HostRows(pool)
    assert rows.block_bytes == sum(int(t.shape[1]) for t in pool.tensors)
    for b in range(pool.num_blocks):
        views = rows.block(b)
        assert len(views) == buffers
        assert b"".join(bytes(v) for v in views) == host_block(pool, b)
    rows.block(2)[0][0] = 0x5A ^ pool.tensors[0][2, 0].item()  # views write into the pool
    assert rows.block(2)[0][0] == pool.tensors[0][2, 0].item()


def test_host_rows_of_a_pool_with_several_device_blocks_per_host_block():
    pool = make_pool(f=4)
    rows = HostRows(pool)
    assert all(b"".join(map(bytes, rows.block(b))) == host_block(pool, b) for b in range(pool.num_blocks))


@pytest.mark.parametrize("interleave", [False, True])
def test_blocks_round_trip_through_the_worker_from_either_pool_layout(tmp_path, interleave):
    pool = layer_pool(interleave, blocks=8)
    tier = Tier(tmp_path, pool, blocks=8)
    expected = [host_block(pool, b) for b in range(4)]
    tier.store([k(i) for i in range(4)], [0, 1, 2, 3])
    for t in pool.tensors:
        t.zero_()
    assert tier.load([k(i) for i in range(4)], [7, 6, 5, 4]).success
    assert [host_block(pool, b) for b in (7, 6, 5, 4)] == expected
    tier.close()


def test_a_job_is_written_in_slot_order_one_batch_per_run_of_consecutive_slots(tmp_path):
    """A full tier hands out evicted slots in descending order; the worker still writes
    them as one run (one thread: one share), byte-exact."""
    pool = make_pool()
    tier = Tier(tmp_path, pool, blocks=8, store_threads=1)
    tier.store([k(i) for i in range(8)], list(range(8)))
    calls = []
    write = tier.worker.files.write_run

    def record(first, keys, blocks):
        calls.append((first, len(keys)))
        return write(first, keys, blocks)

    tier.worker.files.write_run = record
    out = tier.manager.prepare_store([k(i) for i in range(100, 104)])
    assert out.store_spec.block_ids.tolist() == [3, 2, 1, 0]
    result = tier.run(CPULoadStoreSpec([8, 9, 10, 11]), out.store_spec)
    tier.manager.complete_store(out.keys_to_store, result.success)
    assert result.success and calls == [(0, 4)]
    expected = [host_block(pool, b) for b in (8, 9, 10, 11)]
    assert tier.load([k(i) for i in range(100, 104)], [12, 13, 14, 15]).success
    assert [host_block(pool, b) for b in (12, 13, 14, 15)] == expected
    tier.close()


def _space(tmp_path, stride: int, slots: int, chunk: int) -> tuple[int, SlotSpace]:
    fd = os.open(tmp_path / "data", os.O_RDWR | os.O_CREAT, 0o600)
    return fd, SlotSpace(fd, stride, slots, chunk_bytes=chunk)


def test_slot_space_reserves_whole_chunks_once_and_never_past_the_bound(tmp_path):
    fd, space = _space(tmp_path, 8192, 10, chunk=4 * 8192)
    if not space.enabled:
        pytest.skip("fallocate is not supported on this file system")
    assert space.chunk_slots == 4
    assert space.unreserved_bytes([0, 1]) == 4 * 8192 and space.unreserved_bytes([3, 4]) == 8 * 8192
    space.reserve(1, 2)  # inside chunk 0
    assert os.fstat(fd).st_size == 4 * 8192 and os.fstat(fd).st_blocks * 512 >= 4 * 8192
    assert space.unreserved_bytes([0, 3]) == 0 and space.unreserved_bytes([2, 4]) == 4 * 8192
    space.reserve(7, 3)  # chunks 1 and 2; the last holds slots 8 and 9 only
    assert os.fstat(fd).st_size == 10 * 8192  # the bound: num_slots * stride
    assert space.unreserved_bytes(range(10)) == 0
    os.close(fd)


def test_a_store_reserves_its_chunk_and_rewriting_needs_no_space(tmp_path):
    pool = make_pool()
    tier = Tier(tmp_path, pool, blocks=32)
    if not tier.worker.space.enabled:
        pytest.skip("fallocate is not supported on this file system")
    stride = tier.worker.geometry.slot_stride
    assert tier.worker.space.unreserved_bytes([0]) == 32 * stride  # one chunk: the whole small tier
    tier.store([k(1)], [1])
    assert tier.worker.space.unreserved_bytes(range(32)) == 0
    data = os.stat(tmp_path / "ns" / DATA_FILE)
    assert data.st_size == 32 * stride and data.st_blocks * 512 >= 32 * stride
    # with every chunk reserved, a floor that leaves no room at all still lets stores in
    tier.worker.free_floor = 1 << 62
    tier.store([k(i) for i in range(2, 10)], list(range(2, 10)))
    assert tier.worker.counters().floor_declines == 0
    tier.close()


def test_fallocate_errors_carry_their_errno(tmp_path):
    with pytest.raises(OSError) as info:
        fallocate(-1, 0, 4096)
    assert info.value.errno == 9  # EBADF


def test_a_write_cut_short_by_the_file_size_limit_fails_and_leaves_no_valid_record(tmp_path):
    """The first pwritev returns short (RLIMIT_FSIZE): the rest is retried, fails with
    EFBIG, and the slot's record stays zero -- never a record over a torn payload."""
    geometry = Geometry(3 * 4096)
    ns = tmp_path / "ns"
    ns.mkdir()
    for name in (DATA_FILE, HEADER_FILE):
        (ns / name).touch()
    files = BlockFiles(str(ns), geometry, namespace_digest("ns"))
    pages = [np.full(4096, i + 1, dtype=np.uint8) for i in range(3)]
    files.write(0, k(0), pages)
    limit = geometry.slot_stride + 4096  # slot 1 fits one page of three
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        with pytest.raises(OSError) as info:
            files.write(1, k(1), pages)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old)
    assert info.value.errno == 27  # EFBIG, after a short first write
    assert os.path.getsize(ns / DATA_FILE) == limit
    out = [np.zeros(4096, dtype=np.uint8) for _ in range(3)]
    with pytest.raises(CorruptBlock, match="empty slot"):
        files.read(1, k(1), out)
    files.read(0, k(0), out)
    assert all((o == i + 1).all() for i, o in enumerate(out))
    files.close()
