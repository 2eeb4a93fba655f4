"""``CPUExecutor``: store and load jobs between host-resident KV tensors and the host pool.

Used when the engine's KV cache lives in host memory (CPU tensors, e.g. vLLM's CPU
build). It implements ``kvoffload.transfer.executor.Executor``: a job arrives as pieces
``(tensor, device_rows, host_rows)``; ``run`` copies them all and returns the seconds
spent, or raises, in which case the job's destination rows are unspecified and nothing
else is touched.

How: each piece's row pairs become copy tasks (below), shared out over a ``CopyPool``
(the calling worker thread plus helpers). Tensors of one KV-cache group receive the same
row arrays, so a per-layer layout plans once per group, not once per layer. Two copiers:

* native (default when built, ``kvoffload.transfer.native``): every piece's rows become
  byte ranges (``row_plan.plan_runs``: rows consecutive on both sides join into one
  range of at most ``chunk_bytes``); the job's ranges, all tensors together, are then cut
  into ``TASKS_PER_THREAD`` tasks per copy thread of about equal bytes, each copied by one
  C call without the GIL. Stores write the host pool with streaming stores on x86-64,
  loads write the engine's KV with plain ones (it is read next). Few, large tasks: each
  task costs its thread a wait for the GIL, and in an engine whose thread runs Python
  between steps that wait is what a job lasts (vLLM CPU build, a 15.5 MB load: 3.3-8.3 ms
  as 16 tasks, one per MiB of each tensor, against 1.6-3.8 ms as 4; notes/benchmarks-history.md, "The
  CPU tier's load inside the engine").
* numpy (without a C compiler at install): tasks of about ``chunk_bytes``, each one
  gather, scatter or slice copy per run of consecutive rows (``row_plan.plan_copies``),
  rows viewed as the widest integer type
  that divides the page. On one thread numpy's ``take`` and fancy assignment copied
  64-128 KiB rows at contiguous-copy speed, where ``index_copy_`` reached about half of
  it; and torch ops above its grain size enter its intra-op pool (see ``copy_pool``).
  Gathers read a C-contiguous view of the source (``row_plan.source``, built once per
  tensor and job): given the strided rows of an interleaved host pool, ``np.take`` would
  copy the whole pool tensor per call (``row_plan``, "Strided rows").

Freed memory: a tensor whose storage was released or shrunk (e.g. the engine tore its KV
cache down) fails every job that starts afterwards, instead of being read or written
through a stale pointer (nothing here holds the storage: addresses and numpy views are
taken per job, so torch can still release it). Releasing memory while a job is copying it is the caller's
error, as with any copy in flight.
"""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Sequence

import numpy as np
import torch

from kvoffload.transfer import native
from kvoffload.transfer.copy_pool import CopyPool
from kvoffload.transfer.executor import Piece
from kvoffload.transfer.host_pool import HostBlockPool
from kvoffload.transfer.layout import KVLayout
from kvoffload.transfer.row_plan import Source, Unit, apply_unit, plan_copies, plan_runs, source
from kvoffload.validation import positive_int

_OP_BYTES = 256 << 10  # largest single copy; see row_plan on glibc's memcpy
TASKS_PER_THREAD = 2  # native path: enough to even out a slow thread, few GIL waits

WIDE_TYPES = (torch.int64, torch.int32, torch.int16, torch.uint8)


def widest_view_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """The widest integer type every one of ``tensors`` (uint8 rows) can be viewed as."""
    for dtype in WIDE_TYPES:
        try:
            for t in tensors:
                t.view(dtype)
            return dtype
        except RuntimeError:  # page size, stride or offset not a multiple of the width
            continue
    raise AssertionError("uint8 views always exist")


def check_backed(tensor: torch.Tensor, name: str) -> tuple[int, int]:
    """``tensor``'s (rows, row bytes), or ``RuntimeError`` naming it when its storage no
    longer holds every row (released or shrunk): copying would touch freed memory."""
    rows, width = tensor.shape
    end = tensor.storage_offset() + (rows - 1) * tensor.stride(0) + width
    if rows and end > tensor.untyped_storage().nbytes():
        raise RuntimeError(f"{name}: its memory was released or shrunk")
    return rows, width


_NUMPY_TYPES = {torch.int64: np.int64, torch.int32: np.int32, torch.int16: np.int16, torch.uint8: np.uint8}


def numpy_rows(tensor: torch.Tensor, dtype: torch.dtype, name: str) -> np.ndarray:
    """``tensor`` (uint8 rows, each contiguous) as a numpy array of ``dtype`` rows over
    the same memory, refusing a tensor whose memory no longer backs it: numpy would read
    or write freed memory without complaint.

    The array is built from the storage's address, not with ``Tensor.numpy()``: that call
    marks the storage as shared with numpy for good, after which torch refuses to release
    or shrink it, and this check could never fire again."""
    rows, width = check_backed(tensor, name)
    storage = tensor.untyped_storage()
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
    """Bulk row copies (native or numpy) on our own small thread pool."""

    def __init__(
        self,
        layout: KVLayout,
        pool: HostBlockPool,
        chunk_bytes: int = 1 << 20,
        copy_threads: int | None = None,
        native_copies: bool | None = None,
    ) -> None:
        """``chunk_bytes``: about how many bytes one thread copies per unit of work (at
        least one row). ``copy_threads``: threads copying one job, the caller included
        (default: CPU count, at most 8); stores and loads share the helpers.
        ``native_copies`` (default: when built) copies through ``kvoffload.transfer.native``
        instead of numpy."""
        positive_int("chunk_bytes", chunk_bytes)
        if native_copies is None:
            native_copies = native.AVAILABLE
        elif native_copies and not native.AVAILABLE:
            raise ValueError("native_copies=True, but kvoffload.transfer._rowcopy was not built")
        self.native_copies = bool(native_copies)
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

    jobs_in_flight = 1  # launch does the copies: nothing to overlap

    def finish(self, handle: float) -> float:
        return handle  # the seconds launch took

    def launch(self, store: bool, pieces: Sequence[Piece], state=None, ready=None) -> float:
        start = time.perf_counter()
        if self.native_copies:
            self._run_native(store, pieces)
        else:
            self._run_numpy(store, pieces)
        return time.perf_counter() - start

    def _run_native(self, store: bool, pieces: Sequence[Piece]) -> None:
        plans: dict[tuple[int, ...], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        src_parts: list[np.ndarray] = []
        dst_parts: list[np.ndarray] = []
        lengths: list[np.ndarray] = []
        for tensor, device_rows, host_rows in pieces:
            name = self.layout.names[tensor]
            device, host = self.layout.tensors[tensor], self.pool.sub_blocks(tensor)
            # Checked per job: a released tensor fails this job rather than being
            # read or written after free.
            _, page = check_backed(device, name)
            check_backed(host, f"host {name}")
            src, dst = (device, host) if store else (host, device)
            src_rows, dst_rows = (device_rows, host_rows) if store else (host_rows, device_rows)
            # The pieces keep these arrays alive for the whole call, so ids are stable keys.
            key = (id(src_rows), id(dst_rows), page, src.stride(0), dst.stride(0))
            if key not in plans:
                # one unit of runs of at most chunk_bytes: the tasks are cut below
                chunk_rows = max(1, self.chunk_bytes // max(page, 1))
                units = plan_runs(src_rows, dst_rows, max(1, len(dst_rows)), chunk_rows)
                runs = [native.ByteRuns.of(u, src.stride(0), dst.stride(0), page) for u in units]
                plans[key] = tuple(  # type: ignore[assignment]
                    np.concatenate([getattr(r, f) for r in runs]) if runs else np.zeros(0, np.int64)
                    for f in ("src_offsets", "dst_offsets", "lengths")
                )
            src_offsets, dst_offsets, n = plans[key]
            src_parts.append(src_offsets + src.data_ptr())
            dst_parts.append(dst_offsets + dst.data_ptr())
            lengths.append(n)
        if not lengths:
            return
        src_at, dst_at, sizes = np.concatenate(src_parts), np.concatenate(dst_parts), np.concatenate(lengths)
        if not len(sizes):
            return
        # Offsets from the lowest address of each side: one base pair serves every tensor.
        src_base, dst_base = int(src_at.min()), int(dst_at.min())
        src_at -= src_base
        dst_at -= dst_base
        ends = np.cumsum(sizes)
        count = self.threads * TASKS_PER_THREAD
        cuts = np.unique(np.searchsorted(ends, ends[-1] * np.arange(1, count) / count, side="right"))
        bounds = [0, *(int(c) for c in cuts if 0 < c < len(sizes)), len(sizes)]
        # Stores stream into the host pool (read again much later, if ever); loads use
        # plain stores and leave the KV in cache for the forward pass that reads it next.
        tasks = [
            (dst_base, src_base, native.ByteRuns(src_at[a:b], dst_at[a:b], sizes[a:b]), store)
            for a, b in zip(bounds, bounds[1:])
        ]
        self._copies.run(tasks, native.copy)

    def _run_numpy(self, store: bool, pieces: Sequence[Piece]) -> None:
        plans: dict[tuple[int, int, int], list[Unit]] = {}
        tasks: list[tuple[Source, np.ndarray, Unit]] = []
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
            rows = source(src)  # its contiguous view for gathers, made once per tensor
            tasks.extend((rows, dst, unit) for unit in plans[key])
        self._copies.run(tasks, apply_unit)

    def _views(self, tensor: int) -> tuple[np.ndarray, np.ndarray]:
        name, dtype = self.layout.names[tensor], self.dtypes[tensor]
        return (
            numpy_rows(self.layout.tensors[tensor], dtype, name),
            numpy_rows(self.pool.sub_blocks(tensor), dtype, f"host {name}"),
        )
