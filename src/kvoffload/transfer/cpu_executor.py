"""``CPUExecutor``: store and load jobs between host-resident KV tensors and the host pool.

Used when the engine's KV cache lives in host memory (CPU tensors, e.g. vLLM's CPU
build). It implements ``kvoffload.transfer.executor.Executor``: a job arrives as pieces
``(tensor, device_rows, host_rows)``; ``run`` copies them all and returns the seconds
spent, or raises, in which case the job's destination rows are unspecified and nothing
else is touched.

How: each piece's row pairs become a plan of bulk numpy copies (``row_plan``: one gather,
scatter or slice copy per run of consecutive rows, cut into units of about
``chunk_bytes``), and the units of all pieces are shared out over a ``CopyPool`` (the
calling worker thread plus helpers). Tensors of one KV-cache group receive the same row
arrays, so a per-layer layout plans once per group, not once per layer. Rows are viewed
as the widest integer type that divides the page, which numpy copies fastest.

Why numpy and not torch: on one thread, numpy's ``take`` and fancy assignment copied
64-128 KiB rows at contiguous-copy speed, where ``index_copy_`` reached about half of it;
and torch ops above its grain size enter its intra-op pool (see ``copy_pool``). Why not
``np.take``'s default mode: see ``row_plan.apply_unit``.

Freed memory: a tensor whose storage was released or shrunk (e.g. the engine tore its KV
cache down) fails every job that starts afterwards, instead of being read or written
through a stale pointer (the numpy views are made per job from the storage's address, so
torch can still release it). Releasing memory while a job is copying it is the caller's
error, as with any copy in flight.
"""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Sequence

import numpy as np
import torch

from kvoffload.transfer.copy_pool import CopyPool
from kvoffload.transfer.executor import Piece
from kvoffload.transfer.host_pool import HostBlockPool
from kvoffload.transfer.layout import KVLayout
from kvoffload.transfer.row_plan import Unit, apply_unit, plan_copies
from kvoffload.validation import positive_int

_OP_BYTES = 256 << 10  # largest single copy; see row_plan on glibc's memcpy

_WIDE_TYPES = (torch.int64, torch.int32, torch.int16, torch.uint8)


def widest_view_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """The widest integer type every one of ``tensors`` (uint8 rows) can be viewed as."""
    for dtype in _WIDE_TYPES:
        try:
            for t in tensors:
                t.view(dtype)
            return dtype
        except RuntimeError:  # page size, stride or offset not a multiple of the width
            continue
    raise AssertionError("uint8 views always exist")


_NUMPY_TYPES = {torch.int64: np.int64, torch.int32: np.int32, torch.int16: np.int16, torch.uint8: np.uint8}


def numpy_rows(tensor: torch.Tensor, dtype: torch.dtype, name: str) -> np.ndarray:
    """``tensor`` (uint8 rows, each contiguous) as a numpy array of ``dtype`` rows over
    the same memory, refusing a tensor whose memory no longer backs it: numpy would read
    or write freed memory without complaint.

    The array is built from the storage's address, not with ``Tensor.numpy()``: that call
    marks the storage as shared with numpy for good, after which torch refuses to release
    or shrink it, and this check could never fire again."""
    rows, width = tensor.shape
    storage = tensor.untyped_storage()
    end = tensor.storage_offset() + (rows - 1) * tensor.stride(0) + width
    if rows and end > storage.nbytes():
        raise RuntimeError(f"{name}: its memory was released or shrunk")
    size = dtype.itemsize
    memory = (ctypes.c_char * storage.nbytes()).from_address(storage.data_ptr())
    return np.ndarray(
        (rows, width // size),
        _NUMPY_TYPES[dtype],
        memory,
        offset=tensor.storage_offset(),
        strides=(tensor.stride(0), size),
    )


class CPUExecutor:
    """Bulk numpy row copies on our own small thread pool."""

    def __init__(
        self,
        layout: KVLayout,
        pool: HostBlockPool,
        chunk_bytes: int = 1 << 20,
        copy_threads: int | None = None,
    ) -> None:
        """``chunk_bytes``: about how many bytes one thread copies per unit of work (at
        least one row). ``copy_threads``: threads copying one job, the caller included
        (default: CPU count, at most 8); stores and loads share the helpers."""
        positive_int("chunk_bytes", chunk_bytes)
        self.layout, self.pool = layout, pool
        self.chunk_bytes = chunk_bytes
        self.dtypes = [
            widest_view_dtype(layout.tensors[t], pool.sub_blocks(t)) for t in range(len(layout.tensors))
        ]
        self.threads = copy_threads or min(8, os.cpu_count() or 1)
        self._copies = CopyPool(self.threads)

    def ready_event(self) -> None:
        return None  # copies of host memory need no ordering with a device stream

    def new_state(self) -> None:
        return None

    def close(self) -> None:
        self._copies.close()

    def run(self, store: bool, pieces: Sequence[Piece], state=None, ready=None) -> float:
        start = time.perf_counter()
        plans: dict[tuple[int, int, int], list[Unit]] = {}
        tasks: list[tuple[np.ndarray, np.ndarray, Unit]] = []
        for tensor, device_rows, host_rows in pieces:
            src_rows, dst_rows = (device_rows, host_rows) if store else (host_rows, device_rows)
            page = self.layout.page_bytes(tensor)
            # The pieces keep these arrays alive for the whole call, so ids are stable keys.
            key = (id(src_rows), id(dst_rows), page)
            if key not in plans:
                page = max(page, 1)
                plans[key] = plan_copies(src_rows, dst_rows, self.chunk_bytes // page, _OP_BYTES // page)
            # Views are made per job: a released tensor fails this job rather than being
            # kept alive or read after free.
            device, host = self._views(tensor)
            src, dst = (device, host) if store else (host, device)
            tasks.extend((src, dst, unit) for unit in plans[key])
        self._copies.run(tasks, apply_unit)
        return time.perf_counter() - start

    def _views(self, tensor: int) -> tuple[np.ndarray, np.ndarray]:
        name, dtype = self.layout.names[tensor], self.dtypes[tensor]
        return (
            numpy_rows(self.layout.tensors[tensor], dtype, name),
            numpy_rows(self.pool.sub_blocks(tensor), dtype, f"host {name}"),
        )
