"""The host region: exactly the pool's bytes, views into it, pinned in row-aligned chunks on
several threads, and a pageable fallback when pinning fails."""

from __future__ import annotations

import ctypes
import gc
import logging
import mmap
import sys
import threading
import time

import pytest
import torch

from kvoffload.specs import CPULoadStoreSpec, DeviceLoadStoreSpec
from kvoffload.transfer import HostBlockPool, KVLayout, TransferEngine
from transfer_oracle import assert_state, expected_after, randomize, snapshot

PAGES = (48, 16, 40)


def layout() -> KVLayout:
    caches = {f"l{i}": torch.zeros((10, p), dtype=torch.uint8) for i, p in enumerate(PAGES)}
    return KVLayout.from_layer_tensors(caches, [["l0", "l1"], ["l2"]])


class FakeRegistrar:
    def __init__(self, fail_at: int | None = None) -> None:
        self.fail_at = fail_at
        self.registered: dict[int, int] = {}
        self.unregistered: list[int] = []
        self.threads: set[int] = set()
        self._lock = threading.Lock()

    def register(self, ptr: int, nbytes: int) -> bool:
        time.sleep(0.01)  # pinning takes time: the chunks spread over the threads
        with self._lock:
            self.threads.add(threading.get_ident())
            if self.fail_at is not None and len(self.registered) == self.fail_at:
                return False
            self.registered[ptr] = nbytes
        return True

    def unregister(self, ptr: int) -> None:
        self.unregistered.append(ptr)


@pytest.mark.parametrize(("f", "interleave"), [(1, True), (1, False), (3, False)])
def test_region_is_exactly_the_pool_and_views_alias_it(f, interleave):
    pool = HostBlockPool(layout(), 7, f, interleave=interleave)
    assert pool.nbytes == pool.region.numel() == 7 * f * sum(PAGES)
    assert pool.block_bytes == f * sum(PAGES)
    base = pool.region.data_ptr()
    for t, page in enumerate(PAGES):
        assert tuple(pool.tensors[t].shape) == (7, page * f)
        rows = pool.sub_blocks(t)
        assert tuple(rows.shape) == (7 * f, page)
        for r in (0, 5, 7 * f - 1):
            assert rows[r].data_ptr() == base + pool.row_offset(t) + r * pool.row_stride(t)
        assert pool.tensors[t][2, page * (f - 1) :].data_ptr() == rows[2 * f + f - 1].data_ptr()
    # the views tile the region: writing every view's bytes covers each region byte once
    pool.region.zero_()
    for t in range(len(PAGES)):
        pool.sub_blocks(t).add_(1)
    assert torch.equal(pool.region, torch.ones_like(pool.region))


def test_interleaved_rows_hold_every_layer_of_a_block_side_by_side():
    pool = HostBlockPool(layout(), 5, interleave=True)
    assert [pool.row_offset(t) for t in range(3)] == [0, 48, 64]
    assert {pool.row_stride(t) for t in range(3)} == {sum(PAGES)}


def test_interleaving_needs_one_device_block_per_host_block():
    with pytest.raises(ValueError, match="blocks_per_offload_block=1, got 2"):
        HostBlockPool(layout(), 4, 2, interleave=True)


def test_pools_interleave_by_default_unless_a_host_block_spans_several_device_blocks():
    pool = HostBlockPool(layout(), 4)
    assert pool.interleaved
    assert pool.pinned == torch.cuda.is_available()
    assert not HostBlockPool(layout(), 4, 2).interleaved


@pytest.mark.parametrize("interleave", [True, False])
def test_pinned_in_page_aligned_chunks_on_several_threads(interleave):
    fake = FakeRegistrar()
    pool = HostBlockPool(
        layout(),
        400,
        pin_memory=True,
        interleave=interleave,
        registrar=(fake.register, fake.unregister),
        register_threads=4,
        register_chunk_bytes=5000,  # rounded down to whole pages
    )
    assert pool.pinned
    base = pool.region.data_ptr()
    assert base % mmap.PAGESIZE == 0
    spans = sorted((ptr - base, n) for ptr, n in fake.registered.items())
    # the chunks tile the region exactly, on page boundaries (the driver pins whole pages)
    at = 0
    for off, n in spans:
        assert off == at and off % mmap.PAGESIZE == 0 and 0 < n <= 4096
        at += n
    assert at == pool.nbytes == 400 * sum(PAGES)
    assert spans == sorted(pool.register_bounds)
    assert len(fake.threads) > 1
    del pool
    gc.collect()
    assert sorted(fake.unregistered) == sorted(fake.registered)  # released with the pool


def test_failed_pinning_falls_back_to_pageable_with_a_warning(caplog):
    fake = FakeRegistrar(fail_at=2)
    with caplog.at_level(logging.WARNING, logger="kvoffload.transfer.host_pool"):
        pool = HostBlockPool(
            layout(),
            400,
            pin_memory=True,
            registrar=(fake.register, fake.unregister),
            register_chunk_bytes=4096,
        )
    assert not pool.pinned
    assert len(fake.registered) >= 2  # some chunks had been pinned before one failed
    assert sorted(fake.unregistered) == sorted(fake.registered)  # nothing left half pinned
    assert "stays pageable" in caplog.text
    assert pool.region.numel() == pool.nbytes  # still usable


def test_an_interleaved_pool_serves_the_cpu_executor_too():
    """The views keep their meaning in either layout, so every mover of host blocks works."""
    gen = torch.Generator().manual_seed(3)
    lay = layout()
    for t in lay.tensors:
        randomize(t, gen)
    pool = HostBlockPool(lay, 6, interleave=True)
    randomize(pool.region, gen)
    with TransferEngine(lay, pool) as engine:
        for job_id, store in ((1, True), (2, False)):
            before = snapshot(lay, pool)
            device, host = DeviceLoadStoreSpec([4, 1, 7], [2, 1], [0, 0]), CPULoadStoreSpec([5, 0, 2])
            engine.submit(job_id, *((device, host) if store else (host, device)))
            engine.wait([job_id])
            assert [r.success for r in engine.poll()] == [True]
            assert_state(
                lay, pool, expected_after(lay, pool, before, store, [4, 1, 7], [2, 1], [0, 0], [5, 0, 2])
            )


def _resident_pages(ptr: int, nbytes: int) -> tuple[int, int]:
    """(resident, total) pages of ``[ptr, ptr + nbytes)``, from the kernel's ``mincore``."""
    libc = ctypes.CDLL(None, use_errno=True)
    pages = (nbytes + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    vec = (ctypes.c_ubyte * pages)()
    if libc.mincore(ctypes.c_void_p(ptr), ctypes.c_size_t(nbytes), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(v & 1 for v in vec), pages


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore via the C library")
@pytest.mark.parametrize("prefault", [True, False])
def test_a_pageable_pool_is_faulted_in_at_construction(prefault):
    # A store into a page never touched pays the fault and the kernel's zeroing (several
    # times the copy itself); the pool pays it once, up front, unless asked not to.
    pool = HostBlockPool(layout(), 40_000, pin_memory=False, prefault=prefault)
    resident, pages = _resident_pages(pool.region.data_ptr(), pool.nbytes)
    assert pages > 500
    if prefault:
        assert resident == pages
    else:
        assert resident < pages // 2
