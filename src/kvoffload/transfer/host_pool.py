"""The host block pool: where offloaded KV pages live in host memory.

``HostBlockPool(layout, num_host_blocks, blocks_per_offload_block=F)`` holds one host
block per id, each with a page of every layout tensor ``F`` times. An offloaded (host)
block spans ``F`` consecutive device blocks: host block ``b`` of a tensor holds
device-sized sub-blocks ``b*F .. b*F+F-1``. Views:

* ``tensors[t]``: ``(num_host_blocks, page_bytes(t) * F)`` uint8, row ``b`` contiguous;
* ``sub_blocks(t)``: ``(num_host_blocks * F, page_bytes(t))``, row ``b*F + k`` is sub-block
  ``k`` of host block ``b``;
* ``region``: the one 1-D allocation all views share, of exactly ``nbytes`` bytes;
  ``row_offset(t)`` and ``row_stride(t)`` locate row ``r`` of ``sub_blocks(t)`` in it.

Memory layout. ``interleave`` (the default whenever F = 1) puts every tensor's page of a
block side by side: a block is one contiguous byte range across all layers, so it crosses
the bus in one copy, goes to disk or to Redis as one buffer, and a run of consecutive host
ids is one range. Tensor-major (one contiguous slab per tensor) is the layout for F > 1,
where the two views above cannot both exist over an interleaved region. Why interleaved
on the CPU build too: the CPU executor copies pages either way at the same speed
(``bench/bench_transfer.py``, interleaved column), while a disk tier writing a block of
32 scattered pages stores at 0.36-0.55 of a sequential write and one buffer per block at
0.9-1.0 (``bench/bench_disk.py --pool``; notes/benchmarks-history.md, disk tier run 6).

Row prefix. ``row_prefix_bytes=P`` (interleaved only; default 0) reserves ``P`` bytes
directly before each block's payload: block ``b``'s payload starts at region byte
``b * block_stride + P``, ``block_stride = P + block_bytes``, and
the views above start after the prefix. No copy planner here touches a prefix: a tier may
keep a block's per-block header there, so that header and payload are one buffer (the
Mooncake tier's objects, ``kvoffload.tiers.mooncake.worker``). Consecutive host ids are
then no longer one byte range: planners that merge rows check that they touch
(``staging_plan``, ``native.ByteRuns``, ``row_plan.source``), so they copy one range per
block instead.

Pinning. One region of exactly the pool's size, mapped anonymously (page-aligned, pages
zero-filled on first touch), then, chunk by chunk on several threads, faulted in
(``MADV_POPULATE_WRITE``; the page zeroing is what takes time) and registered with
``cudaHostRegister``. Chunks start and end on page boundaries: the driver pins whole
pages, so two chunks sharing a page would overlap and the second registration would
fail. Copy planners keep each copy inside one chunk (``register_bounds``): a copy
spanning two registrations is not one pinned range to the driver. Why not ``pin_memory=True``:
PyTorch's caching host allocator rounds an allocation up to a power of two (up to 2x the
memory), and one allocation per tensor wastes that per tensor. When registration fails,
the region stays pageable with a logged warning: copies are then correct but synchronous
and slower.

Faulting in. A pageable pool (no pinning) is faulted in at construction too, on the same
threads and chunks (``prefault``, default on): otherwise every first write into a page
pays a page fault and the kernel's zeroing inside a store. In the vLLM engine on this
project's 2-core machine a 62-block (15 MiB) store took 14-25 ms into fresh pages against
about 2 ms into faulted ones, and a store that slow was still running while the engine
computed the next request: its time to first token doubled (``bench/bench_engine.py``,
"do no harm"). The memory is the pool the user sized; it is committed at start instead of
during the first stores.

Size. The pool is sized by its caller. In the vLLM integration ``cpu_bytes_to_use`` is
currently divided by the host bytes of *this worker's* shard, so each worker of a
tensor-parallel engine allocates the whole ``cpu_bytes_to_use`` (vLLM 0.32 treats it as
the total over all workers, see ``vllm/v1/kv_offload/cpu/spec.py``).

A host block id addresses the same slot in every tensor; a block of group ``g`` uses only
the tensors of ``g``. The memory is allocated uninitialised: a host block holds meaningful
bytes only after a successful store into it, which the tier manager's bookkeeping tracks.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import time
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from kvoffload.transfer.layout import KVLayout
from kvoffload.validation import non_negative_int, positive_int

logger = logging.getLogger(__name__)

# Pin in chunks of about this size: enough chunks to keep the threads busy, and bounded so
# that no single registration hits a driver limit on huge ranges.
_REGISTER_CHUNK_BYTES = 1 << 30
_MAX_REGISTER_CHUNK_BYTES = 64 << 30

# register(ptr, nbytes) -> bool, unregister(ptr) -> None; tests inject fakes.
Registrar = tuple[Callable[[int, int], bool], Callable[[int], None]]


def cuda_registrar(device: torch.device | None = None) -> Registrar | None:
    """``cudaHostRegister``/``cudaHostUnregister`` through torch's bindings, or ``None``."""
    try:
        cudart = torch.cuda.cudart()
        success = cudart.cudaError.success
    except Exception as exc:  # noqa: BLE001 - no CUDA runtime: the caller falls back
        logger.warning("kvoffload: no CUDA runtime to pin host memory with (%s)", exc)
        return None
    index = device.index if device is not None and device.type == "cuda" else None

    def register(ptr: int, nbytes: int) -> bool:
        if index is not None:
            torch.cuda.set_device(index)  # each registering thread: the pool's device
        # 1 = cudaHostRegisterPortable: pinned for every device's context, not only the
        # one current on this thread.
        if cudart.cudaHostRegister(ptr, nbytes, 1) == success:
            return True
        # The failure is also this thread's pending CUDA error, which the next kernel
        # launch check on this thread would report as its own: take it now.
        with contextlib.suppress(RuntimeError):
            torch.zeros(1, device="cuda" if index is None else f"cuda:{index}")
        return False

    def unregister(ptr: int) -> None:
        cudart.cudaHostUnregister(ptr)

    return register, unregister


class HostBlockPool:
    """Host blocks for every tensor of ``layout``, in one region."""

    def __init__(
        self,
        layout: KVLayout,
        num_host_blocks: int,
        blocks_per_offload_block: int = 1,
        pin_memory: bool | None = None,
        *,
        interleave: bool | None = None,
        registrar: Registrar | None = None,
        register_threads: int | None = None,
        register_chunk_bytes: int = _REGISTER_CHUNK_BYTES,
        prefault: bool = True,
        row_prefix_bytes: int = 0,
    ) -> None:
        """``pin_memory`` (default: CUDA available) registers the region; ``registrar``
        replaces the CUDA runtime's (tests). ``interleave`` (default: F = 1) chooses the
        block-interleaved layout. ``prefault`` faults a pageable region
        in at once (a pinned one always is). ``row_prefix_bytes``: bytes reserved before
        each block's payload (interleaved only; see the module's "Row prefix")."""
        non_negative_int("num_host_blocks", num_host_blocks)
        prefix = non_negative_int("row_prefix_bytes", row_prefix_bytes)
        f = positive_int("blocks_per_offload_block", blocks_per_offload_block)
        positive_int("register_chunk_bytes", register_chunk_bytes)
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        if interleave is None:
            interleave = f == 1
        if interleave and f != 1:
            raise ValueError(f"an interleaved host pool needs blocks_per_offload_block=1, got {f}")
        if prefix and not interleave:
            raise ValueError(
                f"row_prefix_bytes={prefix} needs an interleaved host pool (blocks_per_offload_block=1)"
            )
        self.layout = layout
        self.num_blocks = num_host_blocks
        self.blocks_per_offload_block = f
        self.interleaved = bool(interleave)
        pages = [layout.page_bytes(i) for i in range(len(layout.tensors))]
        # Bytes of one host block across all tensors (its payload), and, interleaved, the
        # distance between two blocks' payloads.
        self.block_bytes = sum(pages) * f
        self.row_prefix_bytes = prefix
        self.block_stride = prefix + self.block_bytes
        self.nbytes = self.block_stride * num_host_blocks
        start = time.perf_counter()
        self._mapping = _map(self.nbytes)
        self.region = (
            torch.frombuffer(self._mapping, dtype=torch.uint8)
            if self._mapping is not None
            else torch.empty(0, dtype=torch.uint8)
        )
        self._offsets: list[int] = []
        self._strides: list[int] = []
        views = []
        offset = prefix
        for page in pages:
            self._offsets.append(offset)
            if self.interleaved:
                self._strides.append(self.block_stride)
                views.append(self._strided(offset, page))
                offset += page
            else:
                slab = num_host_blocks * page * f
                self._strides.append(page)
                views.append(self.region[offset : offset + slab].view(num_host_blocks, page * f))
                offset += slab
        self.tensors: tuple[torch.Tensor, ...] = tuple(views)
        self.register_bounds = self._chunk_bounds(min(register_chunk_bytes, _MAX_REGISTER_CHUNK_BYTES))
        self.pinned = False
        if pin_memory and self.nbytes:
            registrar = registrar if registrar is not None else cuda_registrar(layout.device)
            self.pinned = registrar is not None and self._register(registrar, register_threads)
            if not self.pinned:
                logger.warning(
                    "kvoffload: could not pin the %.1f MiB host pool; it stays pageable "
                    "(copies are correct but synchronous and slower)",
                    self.nbytes / 2**20,
                )
        if not self.pinned and prefault and self.nbytes:
            self._populate(register_threads)
        self.allocation_seconds = time.perf_counter() - start

    def _strided(self, offset: int, page: int) -> torch.Tensor:
        return self.region.as_strided((self.num_blocks, page), (self.block_stride, 1), offset)

    def _chunk_bounds(self, target: int) -> list[tuple[int, int]]:
        """``(offset, nbytes)`` page-aligned chunks of about ``target`` bytes tiling the region."""
        chunk = max(mmap.PAGESIZE, target - target % mmap.PAGESIZE)
        return [(off, min(chunk, self.nbytes - off)) for off in range(0, self.nbytes, chunk)]

    def _register(self, registrar: Registrar, threads: int | None) -> bool:
        register, unregister = registrar
        base = self.region.data_ptr()
        threads = threads or min(8, os.cpu_count() or 1)

        def pin(bound: tuple[int, int]) -> bool:
            try:
                _prefault(self._mapping, *bound)
                return bool(register(base + bound[0], bound[1]))
            except Exception as exc:  # noqa: BLE001 - pinning is an optimisation: fall back
                logger.warning("kvoffload: pinning %d bytes raised %s", bound[1], exc)
                return False

        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kvoffload-pin") as pool:
            ok = list(pool.map(pin, self.register_bounds))
        registered = [base + off for (off, _), good in zip(self.register_bounds, ok) if good]
        if not all(ok):
            for ptr in registered:  # all or nothing: a partly pinned region is not worth it
                unregister(ptr)
            return False
        # Unregister when the pool goes; the memory lives on in any remaining view, then
        # as ordinary pageable memory.
        weakref.finalize(self, _unregister_all, unregister, registered)
        return True

    def _populate(self, threads: int | None) -> None:
        threads = threads or min(8, os.cpu_count() or 1)
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kvoffload-fault") as pool:
            list(pool.map(lambda bound: _prefault(self._mapping, *bound), self.register_bounds))

    def row_offset(self, tensor: int) -> int:
        """Byte offset in ``region`` of row 0 of ``sub_blocks(tensor)``."""
        return self._offsets[tensor]

    def row_stride(self, tensor: int) -> int:
        """Bytes between consecutive rows of ``sub_blocks(tensor)`` in ``region``."""
        return self._strides[tensor]

    def sub_blocks(self, tensor: int) -> torch.Tensor:
        """Tensor ``tensor`` as ``(num_host_blocks * F, page_bytes)``: row ``b*F + k`` is
        sub-block ``k`` of host block ``b``."""
        page = self.layout.page_bytes(tensor)
        if self.interleaved:
            return self._strided(self._offsets[tensor], page)
        return self.tensors[tensor].view(-1, page)

    def __repr__(self) -> str:
        return (
            f"HostBlockPool({self.num_blocks} blocks x {self.blocks_per_offload_block} device "
            f"blocks, {self.nbytes / 2**20:.1f} MiB, pinned={self.pinned}, "
            f"{'interleaved' if self.interleaved else 'tensor-major'}"
            f"{f', {self.row_prefix_bytes}-byte row prefix' if self.row_prefix_bytes else ''})"
        )


def _map(nbytes: int) -> mmap.mmap | None:
    """``nbytes`` of private, page-aligned, lazily zero-filled host memory (``None`` for 0):
    every registration chunk starts on a page of its own."""
    if not nbytes:
        return None
    flags = mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0x20)
    return mmap.mmap(-1, nbytes, flags=flags)


def _prefault(mapping: mmap.mmap | None, offset: int, nbytes: int) -> None:
    """Fault ``[offset, offset + nbytes)`` in on this thread, so that page zeroing runs in
    parallel even where the driver registers one range at a time."""
    if mapping is None:
        return
    try:
        mapping.madvise(getattr(mmap, "MADV_POPULATE_WRITE", 23), offset, nbytes)
    except (OSError, ValueError):  # kernels before 5.14: touch one byte per page
        np.frombuffer(mapping, np.uint8, nbytes, offset)[:: mmap.PAGESIZE] = 0  # fresh pages are 0


def _unregister_all(unregister: Callable[[int], None], ptrs: list[int]) -> None:
    for ptr in ptrs:
        with contextlib.suppress(Exception):  # at exit the runtime may be gone already
            unregister(ptr)
