"""Copy executors behind ``TransferEngine``: how one job's rows move on each device kind.

A job reaches an executor as *pieces* ``(tensor, device_rows, host_rows)``: for one layout
tensor, device block ``device_rows[i]`` pairs with host sub-block ``host_rows[i]``. A store
copies device -> host, a load host -> device. Executors raise on any error; the engine
turns that into a failed result.

* ``CPUExecutor`` (device tensors in host memory, e.g. vLLM's CPU build): gathers rows with
  ``index_select`` into a small staging buffer and scatters them with ``index_copy_``,
  a chunk of rows at a time. Torch has no fused row-to-row copy with indices on both
  sides; a staging buffer that stays in cache (``chunk_bytes``, 1 MiB by default) keeps
  the memory traffic at one read and one write per byte, like a plain copy. Rows are
  viewed as the widest integer type that divides the page, which makes the per-element
  index kernels several times faster than on bytes.
* ``CUDAExecutor``: runs on a side stream per direction. Rows are sorted by host
  sub-block so that consecutive host rows form runs; the device side is gathered
  (store) or scattered (load) in one ``index_select`` / ``index_copy_`` on the device,
  and each run crosses the bus as one ``non_blocking`` copy to or from pinned memory.
  Freshly allocated host blocks are usually consecutive, so a job is typically one copy
  per tensor; the worst case (scattered host ids, F=1) is one copy per block.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

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


class CPUExecutor:
    """Vectorised gathers and scatters between host-resident tensors."""

    def __init__(self, layout: KVLayout, pool: HostBlockPool, chunk_bytes: int = 1 << 20) -> None:
        self.views = [
            _widest_views(layout.tensors[t], pool.sub_blocks(t)) for t in range(len(layout.tensors))
        ]
        max_page = max(layout.page_bytes(t) for t in range(len(layout.tensors)))
        self.chunk_bytes = max(int(chunk_bytes), max_page)

    def new_state(self) -> torch.Tensor:
        """A staging buffer for one worker thread (8-byte aligned by the allocator)."""
        return torch.empty(self.chunk_bytes, dtype=torch.uint8)

    def run(self, store: bool, pieces: Sequence[Piece], staging: torch.Tensor, ready=None) -> float:
        start = time.perf_counter()
        for tensor, device_rows, host_rows in pieces:
            device, host = self.views[tensor]
            src, dst = (device, host) if store else (host, device)
            src_rows = torch.from_numpy(device_rows if store else host_rows)
            dst_rows = torch.from_numpy(host_rows if store else device_rows)
            width = src.shape[1]
            step = max(1, self.chunk_bytes // (width * src.element_size()))
            buffer = staging.view(src.dtype)[: step * width].view(step, width)
            # Chunks of ~chunk_bytes: each chunk is two vectorised ops, not a row loop.
            for lo in range(0, len(src_rows), step):
                chunk = buffer[: len(src_rows[lo : lo + step])]
                torch.index_select(src, 0, src_rows[lo : lo + step], out=chunk)
                dst.index_copy_(0, dst_rows[lo : lo + step], chunk)
        return time.perf_counter() - start


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
