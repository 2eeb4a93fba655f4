"""``CUDAExecutor``: store and load jobs between CUDA KV tensors and the host pool.

It implements ``kvoffload.transfer.executor.Executor``. Each engine worker thread (one per
direction) gets a side stream and a staging buffer (``new_state``, on that thread, which
also makes the layout's device current there: copies issued from a thread whose current
device is another one would run on that device). A job is run as ``staging_plan`` batches:

* store: the device pages are gathered into staging (one ``index_select`` per tensor and
  chunk, on rows viewed as the widest integer type: a byte-wise kernel is several times
  slower), then each contiguous host range is one ``non_blocking`` copy to the pool;
* load: the host ranges are copied into staging, then scattered into the device pages
  (one ``index_copy_`` per tensor and chunk).

The job's device row ids cross the bus once per job. Ordering: the copies wait for the
event recorded at submit on the submitting thread's current stream (a store reads KV the
forward pass queued before it wrote; a load writes blocks only after the engine's block
zeroing queued before it). The worker thread then sleeps on a blocking event
(``Event(blocking=True)``: the driver yields the thread instead of spinning a core).

Failure: if anything raises once the job may have queued work, the side stream is
synchronized before the error propagates, so when the engine reports the job failed no
copy of it is still writing (the caller may hand its blocks to someone else at once).

Memory: staging is at most ``staging_bytes`` per worker thread (raised to one host row
of a group when a row is larger), allocated on first use, kept for the engine's life and
counted in ``staging_bytes_held``, plus each job's device row ids (8 bytes a row). Device
memory comes from the caching allocator's pool for the side stream, outside the KV cache
the engine sized.

``cuda`` (default ``torch.cuda``) is the only way the executor touches streams, events and
devices, so tests drive this same code on CPU tensors with a stand-in.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kvoffload.transfer.cpu_executor import widest_view_dtype
from kvoffload.transfer.executor import Piece
from kvoffload.transfer.host_pool import HostBlockPool
from kvoffload.transfer.layout import KVLayout
from kvoffload.transfer.staging_plan import Batch, Column, plan_batches
from kvoffload.validation import positive_int

logger = logging.getLogger(__name__)

_WIDTHS = {torch.int64: 8, torch.int32: 4, torch.int16: 2, torch.uint8: 1}
_BY_WIDTH = {w: d for d, w in _WIDTHS.items()}


class _State:
    """One worker thread's side stream and staging buffer."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.staging: torch.Tensor | None = None


class CUDAExecutor:
    """Side-stream, staged copies between CUDA KV tensors and a host pool."""

    def __init__(
        self,
        layout: KVLayout,
        pool: HostBlockPool,
        *,
        staging_bytes: int = 64 << 20,
        coalesce: bool = True,
        cuda: Any = None,
    ) -> None:
        """``staging_bytes``: the staging cap per worker thread. ``coalesce=False`` copies
        page by page (the per-row path, for measurement). ``cuda``: see the module
        docstring."""
        self.layout, self.pool = layout, pool
        self.staging_cap = positive_int("staging_bytes", staging_bytes)
        self.coalesce = coalesce
        self.cuda = torch.cuda if cuda is None else cuda
        self.device = layout.device
        if not pool.pinned:
            logger.warning("kvoffload: the host pool is not pinned: device copies will be synchronous")
        self._device_dtypes = [widest_view_dtype(t) for t in layout.tensors]
        self._device_views: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        self._lock = threading.Lock()
        self._states: list[_State] = []
        self.peak_staging_bytes = 0

    # -- Executor contract --------------------------------------------------------------

    def ready_event(self) -> Any:
        """Recorded on the calling thread's current stream at submit."""
        event = self.cuda.Event()
        event.record(self.cuda.current_stream(self.device))
        return event

    def new_state(self) -> _State:
        self.cuda.set_device(self.device)
        state = _State(self.cuda.Stream(device=self.device))
        with self._lock:
            self._states.append(state)
        return state

    def run(self, store: bool, pieces: Sequence[Piece], state: _State, ready: Any = None) -> float:
        batches = plan_batches(pieces, self.pool, self.staging_cap, self.coalesce)
        cuda, stream = self.cuda, state.stream
        try:
            start = cuda.Event(enable_timing=True, blocking=True)
            end = cuda.Event(enable_timing=True, blocking=True)
            with cuda.device(self.device), cuda.stream(stream):
                if ready is not None:
                    stream.wait_event(ready)
                start.record(stream)
                for batch, rows in zip(batches, self._upload_rows(batches)):
                    self._run_batch(store, batch, self._staging(state, batch.staging_bytes), rows)
                end.record(stream)
            end.synchronize()
            return start.elapsed_time(end) / 1000.0
        except BaseException:
            self._fence(stream)
            raise

    def close(self) -> None:
        with self._lock:
            for state in self._states:
                state.staging = None
            self._states.clear()

    # -- accounting ---------------------------------------------------------------------

    @property
    def staging_bytes_held(self) -> int:
        with self._lock:
            return sum(s.staging.numel() for s in self._states if s.staging is not None)

    # -- internals ----------------------------------------------------------------------

    def _fence(self, stream: Any) -> None:
        try:
            stream.synchronize()
        except BaseException:  # noqa: BLE001 - a dead context: nothing of ours runs any more
            logger.exception("kvoffload: synchronizing a failed job's stream failed too")

    def _staging(self, state: _State, nbytes: int) -> torch.Tensor:
        # Grown, never shrunk; allocated under the side stream, so the caching allocator
        # reuses it in that stream's order.
        if state.staging is None or state.staging.numel() < nbytes:
            state.staging = None
            state.staging = torch.empty(-(-nbytes // 8) * 8, dtype=torch.uint8, device=self.device)
            held = self.staging_bytes_held
            with self._lock:
                self.peak_staging_bytes = max(self.peak_staging_bytes, held)
        return state.staging

    def _upload_rows(self, batches: list[Batch]) -> list[list[torch.Tensor]]:
        """Every gather's device rows, on the device, in one copy."""
        arrays = [g.device_rows for b in batches for g in b.gathers]
        if not arrays:
            return []
        flat = torch.from_numpy(np.concatenate(arrays))
        if self.device.type == "cuda":
            flat = flat.pin_memory()  # a pageable source would make the copy synchronous
        flat = flat.to(self.device, non_blocking=True)
        out, at = [], 0
        for b in batches:
            per_batch = []
            for g in b.gathers:
                per_batch.append(flat[at : at + len(g.device_rows)])
                at += len(g.device_rows)
            out.append(per_batch)
        return out

    def _run_batch(self, store: bool, batch: Batch, staging: torch.Tensor, rows: list[torch.Tensor]) -> None:
        region = self.pool.region
        copies = zip(batch.host.tolist(), batch.staging.tolist(), batch.nbytes.tolist())
        if not store:
            for h, s, n in copies:
                staging[s : s + n].copy_(region[h : h + n], non_blocking=True)
        for gather, idx in zip(batch.gathers, rows):
            for col in gather.columns:
                device, view = self._wide_pair(col, staging, len(gather.device_rows))
                if store:
                    # Into the strided staging rows directly: ``out`` may be non-contiguous.
                    torch.index_select(device, 0, idx, out=view)
                else:
                    device.index_copy_(0, idx, view)
        if store:
            for h, s, n in copies:
                region[h : h + n].copy_(staging[s : s + n], non_blocking=True)

    def _wide_pair(self, col: Column, staging: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The device tensor and its staging rows, viewed as the widest integer type both
        allow."""
        page = self.layout.page_bytes(col.tensor)
        width = _WIDTHS[self._device_dtypes[col.tensor]]
        while col.offset % width or col.stride % width or page % width:
            width //= 2
        dtype = _BY_WIDTH[width]
        view = staging.view(dtype).as_strided(
            (n, page // width), (col.stride // width, 1), col.offset // width
        )
        key = (col.tensor, dtype)
        if key not in self._device_views:
            self._device_views[key] = self.layout.tensors[col.tensor].view(dtype)
        return self._device_views[key], view
