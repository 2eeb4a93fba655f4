"""Copy executors behind ``TransferEngine``: how one job's rows move on each device kind.

A job reaches an executor as *pieces* ``(tensor, device_rows, host_rows)``: for one layout
tensor, device block ``device_rows[i]`` pairs with host sub-block ``host_rows[i]``. A store
copies device -> host, a load host -> device. Executors raise on any error; the engine
turns that into a failed result.

* ``CPUExecutor`` (device tensors in host memory, e.g. vLLM's CPU build): rows are sorted
  by destination. Where destinations form runs of at least 4 rows on average (whole
  host blocks when F >= 4, freshly allocated consecutive ids), each run is one gather
  straight into the destination. Otherwise rows are gathered into a cache-sized staging
  buffer (``chunk_bytes``, 256 KiB by default) and scattered from it, a chunk at a
  time: torch and numpy have no fused row copy with indices on both sides. Rows are
  viewed as the widest integer type that divides the page (fewer, wider elements).
* ``CUDAExecutor``: runs on a side stream per direction. Rows are sorted by host
  sub-block so that consecutive host rows form runs; the device side is gathered
  (store) or scattered (load) in one ``index_select`` / ``index_copy_`` on the device,
  and each run crosses the bus as one ``non_blocking`` copy to or from pinned memory.
  Freshly allocated host blocks are usually consecutive, so a job is typically one copy
  per tensor; the worst case (scattered host ids, F=1) is one copy per block.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, wait

import numpy as np
import torch

from kvoffload.transfer.host_pool import HostBlockPool
from kvoffload.transfer.layout import KVLayout

Piece = tuple[int, np.ndarray, np.ndarray]  # (tensor index, device rows, host rows)

_WIDE_TYPES = (torch.int64, torch.int32, torch.int16, torch.uint8)


def _widest_views(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``a`` and ``b`` reinterpreted as the widest integer type both allow."""
    for dtype in _WIDE_TYPES:
        try:
            return a.view(dtype), b.view(dtype)
        except RuntimeError:  # page size, stride or offset not a multiple of the width
            continue
    raise AssertionError("uint8 views always exist")


def _numpy_view(tensor: torch.Tensor, dtype: torch.dtype, name: str) -> np.ndarray:
    """A numpy view of ``tensor``, refusing tensors whose memory no longer backs them
    (numpy would read or write freed memory without complaint)."""
    end = tensor.storage_offset() + (tensor.shape[0] - 1) * tensor.stride(0) + tensor.shape[1]
    if tensor.shape[0] and end > tensor.untyped_storage().nbytes():
        raise RuntimeError(f"{name}: its memory was released or shrunk")
    return tensor.view(dtype).numpy()


class CPUExecutor:
    """Vectorised row copies between host-resident tensors, with numpy on a thread pool."""

    def __init__(
        self,
        layout: KVLayout,
        pool: HostBlockPool,
        chunk_bytes: int = 256 << 10,
        copy_threads: int | None = None,
    ) -> None:
        # numpy's take and fancy assignment run single-threaded without the GIL: a small
        # pool of our own threads (shared by stores and loads) gives parallel copies
        # without torch's intra-op pool, whose threads spin badly on a loaded machine.
        # Views are made per job, so a tensor whose memory was released fails that job
        # instead of being kept alive (or read after free).
        self.layout, self.pool = layout, pool
        self.dtypes = [
            _widest_views(layout.tensors[t], pool.sub_blocks(t))[0].dtype for t in range(len(layout.tensors))
        ]
        max_page = max(layout.page_bytes(t) for t in range(len(layout.tensors)))
        self.chunk_bytes = max(int(chunk_bytes), max_page)
        self.threads = copy_threads or min(8, os.cpu_count() or 1)
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="kvoffload-copy")
        self._local = threading.local()

    def new_state(self) -> None:
        return None

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def run(self, store: bool, pieces: Sequence[Piece], state=None, ready=None) -> float:
        start = time.perf_counter()
        tasks = []
        for tensor, device_rows, host_rows in pieces:
            src_rows, dst_rows = (device_rows, host_rows) if store else (host_rows, device_rows)
            order = np.argsort(dst_rows, kind="stable")
            src_rows, dst_rows = src_rows[order], dst_rows[order]
            # Few big tensors (cross-layer layouts): split rows so every thread works.
            nbytes = len(dst_rows) * self.layout.page_bytes(tensor)
            parts = 1 if len(pieces) >= self.threads else max(1, min(self.threads, nbytes // self.chunk_bytes))
            bounds = np.linspace(0, len(dst_rows), parts + 1).astype(np.int64)
            tasks.extend(
                (store, tensor, src_rows[lo:hi], dst_rows[lo:hi]) for lo, hi in zip(bounds[:-1], bounds[1:])
            )
        futures = [self._pool.submit(self._copy, *task) for task in tasks]
        wait(futures)  # all of them, so nothing still writes once the job is reported
        for future in futures:
            future.result()
        return time.perf_counter() - start

    def _copy(self, store: bool, tensor: int, src_rows: np.ndarray, dst_rows: np.ndarray) -> None:
        dtype = self.dtypes[tensor]
        device = _numpy_view(self.layout.tensors[tensor], dtype, self.layout.names[tensor])
        host = _numpy_view(self.pool.sub_blocks(tensor), dtype, f"host {self.layout.names[tensor]}")
        src, dst = (device, host) if store else (host, device)
        starts, lengths = _runs(dst_rows)
        if len(starts) * _MIN_RUN <= len(dst_rows):
            # Destination rows come in runs (e.g. whole host blocks): gather straight
            # into each run, one pass over the bytes.
            for s, n in zip(starts.tolist(), lengths.tolist()):
                d = int(dst_rows[s])
                np.take(src, src_rows[s : s + n], axis=0, out=dst[d : d + n])
            return
        # Scattered destinations: gather a cache-sized chunk, then scatter it. The chunk
        # stays in cache, so memory sees one read and one write per byte.
        staging = getattr(self._local, "staging", None)
        if staging is None:
            staging = self._local.staging = np.empty(self.chunk_bytes // 8 + 1, dtype=np.int64)
        width = src.shape[1]
        step = max(1, self.chunk_bytes // (width * src.itemsize))
        buffer = staging.view(np.uint8)[: step * width * src.itemsize].view(src.dtype).reshape(step, width)
        for lo in range(0, len(src_rows), step):
            chunk = buffer[: len(src_rows[lo : lo + step])]
            np.take(src, src_rows[lo : lo + step], axis=0, out=chunk)
            dst[dst_rows[lo : lo + step]] = chunk


_MIN_RUN = 4  # average destination run length (rows) worth one op per run


def _runs(sorted_rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Start offsets and lengths of runs of consecutive values in ``sorted_rows``."""
    breaks = np.flatnonzero(np.diff(sorted_rows) != 1) + 1
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.concatenate((starts, [len(sorted_rows)])))
    return starts, lengths


class CUDAExecutor:
    """Side-stream copies between CUDA KV tensors and a pinned host pool."""

    def __init__(self, layout: KVLayout, pool: HostBlockPool) -> None:
        if not pool.pinned:
            raise ValueError("a CUDA layout needs a pinned host pool (pin_memory=True)")
        self.layout = layout
        self.pool = pool
        self.device = layout.device

    def close(self) -> None:
        pass

    def new_state(self) -> torch.cuda.Stream:
        return torch.cuda.Stream(device=self.device)

    def ready_event(self) -> torch.cuda.Event:
        """Recorded on the caller's stream at submit: the job's copies start after the
        work queued so far (e.g. the forward pass that wrote the blocks to store)."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def run(self, store: bool, pieces: Sequence[Piece], stream: torch.cuda.Stream, ready=None) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            if ready is not None:
                stream.wait_event(ready)
            start.record(stream)
            for tensor, device_rows, host_rows in pieces:
                order = np.argsort(host_rows, kind="stable")
                host_sorted = host_rows[order]
                device_index = torch.from_numpy(device_rows[order]).to(self.device, non_blocking=True)
                device_t = self.layout.tensors[tensor]
                host_t = self.pool.sub_blocks(tensor)
                starts, lengths = _runs(host_sorted)
                if store:
                    staging = torch.index_select(device_t, 0, device_index)
                    for s, n in zip(starts.tolist(), lengths.tolist()):
                        h = int(host_sorted[s])
                        host_t[h : h + n].copy_(staging[s : s + n], non_blocking=True)
                else:
                    staging = torch.empty(
                        (len(host_sorted), device_t.shape[1]), dtype=torch.uint8, device=self.device
                    )
                    for s, n in zip(starts.tolist(), lengths.tolist()):
                        h = int(host_sorted[s])
                        staging[s : s + n].copy_(host_t[h : h + n], non_blocking=True)
                    device_t.index_copy_(0, device_index, staging)
            end.record(stream)
        # Only this worker thread waits; the caller's streams keep running.
        end.synchronize()
        return start.elapsed_time(end) / 1000.0
