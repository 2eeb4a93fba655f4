"""``CUDAExecutor``: store and load jobs between CUDA KV tensors and a pinned host pool.

It implements ``kvoffload.transfer.executor.Executor`` and runs on a side stream per
engine worker thread (one per direction). Rows are sorted by host sub-block so that
consecutive host rows form runs; the device side is gathered (store) or scattered (load)
in one ``index_select`` / ``index_copy_`` on the device, and each run crosses the bus as
one ``non_blocking`` copy to or from pinned memory. Freshly allocated host blocks are
usually consecutive, so a job is typically one copy per tensor; the worst case (scattered
host ids, F=1) is one copy per block.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvoffload.transfer.executor import Piece
from kvoffload.transfer.host_pool import HostBlockPool
from kvoffload.transfer.layout import KVLayout
from kvoffload.transfer.row_plan import run_bounds


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
                starts, lengths = run_bounds(host_sorted)
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
