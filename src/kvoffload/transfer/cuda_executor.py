"""``CUDAExecutor``: store and load jobs between CUDA KV tensors and the host pool.

It implements ``kvoffload.transfer.executor.Executor``. Each engine worker thread (one per
direction) gets two side streams, a *kernel* stream and a *copy* stream, two staging
buffers and an index ring (``new_state``, on that thread, which also makes the layout's
device current there: copies issued from a thread whose current device is another one
would run on that device). A job is run as ``staging_plan`` batches of at most half the
staging cap each, planned one at a time and alternating between the two buffers, so the
device-side gather or scatter of one batch runs while the other crosses the link:

* store: on the kernel stream the device pages are gathered into staging; the copy stream
  waits for that batch, then copies each contiguous host range to the pool
  (``non_blocking``);
* load: the copy stream copies the host ranges into staging; the kernel stream waits for
  that batch, then scatters it into the device pages.

A gather or scatter is one ``index_select`` / ``index_copy_`` over the layout's
``ByteSpan`` (``kvoffload.transfer.byte_span``) when its granule is at least
``MIN_GRANULE`` bytes, otherwise one per tensor and chunk on rows viewed as the widest
integer type (a byte-wise kernel is several times slower). On a 32-layer layout on an
H200 the one-kernel path moved as much or more (at 64 KiB pages 0.75-0.77 of one pinned
``copy_`` against 0.71-0.76) for half to three quarters of the CPU per job
(BENCHMARKS.md). A batch's index crosses the bus in one
copy from a pinned ring of ``INDEX_RING_ENTRIES`` (pinning a fresh buffer per batch cost
more than the batch's copies); when the ring is full the worker waits for the kernel
stream, the only reader, and starts it over.

``launch`` queues a job's work and returns; ``finish`` waits for it. With
``jobs_in_flight = 2`` the engine launches the next queued job before it waits for the
last one, so planning overlaps copies across jobs too. A buffer is reused, within a job
or by the next one, only after an event recorded behind its previous batch's last use.
Ordering: the kernel stream waits for the event recorded at submit on the submitting
thread's current stream (a store reads KV the forward pass queued before it wrote; a load
writes blocks only after the engine's block zeroing queued before it; a load's copies into
staging may start earlier, they touch only staging). A job ends with an event on the
stream that ran its last step, which waited for every step of the other; ``finish``
sleeps on that blocking event (``Event(blocking=True)``: the driver yields the thread
instead of spinning a core).

Failure: if anything raises once the job may have queued work, both side streams are
synchronized before the error propagates, so when the engine reports the job failed no
copy of it is still writing (the caller may hand its blocks to someone else at once).

Memory: staging is at most ``staging_bytes`` per worker thread, two buffers of half of it
(a buffer is raised to one host row of a group when a row is larger), allocated on first
use at their full size, kept for the engine's life and counted in ``staging_bytes_held``,
plus the index ring (1 MiB on the device, 1 MiB pinned, per worker thread). Device memory
comes from the caching allocator's pool for the side stream, outside the KV cache the
engine sized.

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

from kvoffload.transfer.byte_span import ByteSpan
from kvoffload.transfer.cpu_executor import widest_view_dtype
from kvoffload.transfer.executor import Piece
from kvoffload.transfer.host_pool import HostBlockPool
from kvoffload.transfer.layout import KVLayout
from kvoffload.transfer.staging_plan import Batch, Column, iter_batches
from kvoffload.validation import positive_int

logger = logging.getLogger(__name__)

# 128 MiB per worker thread: on an H200, 64 MiB batches moved the same bytes as 32 MiB
# ones (0.85-0.94 of a pinned copy_ with jobs queued) for half the CPU per job.
DEFAULT_STAGING_BYTES = 128 << 20
INDEX_RING_ENTRIES = 1 << 17  # int64 index entries per worker thread (1 MiB pinned, 1 MiB device)
MIN_GRANULE = 256  # below it a one-kernel gather's index outweighs its launches saved
_WIDTHS = {torch.int64: 8, torch.int32: 4, torch.int16: 2, torch.uint8: 1}
_BY_WIDTH = {w: d for d, w in _WIDTHS.items()}


class _State:
    """One worker thread's side streams and staging buffers."""

    def __init__(self, kernels: Any, copies: Any) -> None:
        self.stream = kernels  # gathers, scatters and the index uploads
        self.copy_stream = copies  # the bus copies between staging and the host pool
        self.staging: list[torch.Tensor | None] = [None, None]
        # Index ring: host (pinned) and device halves; entries below ``used`` belong to
        # batches of the current job, so the ring is free again when a job starts.
        self.index_host: torch.Tensor | None = None
        self.index_device: torch.Tensor | None = None
        self.used = 0
        # Across jobs: the buffer the next batch takes, each buffer's last-use event, and
        # the jobs launched and not finished.
        self.next_slot = 0
        self.free: list[Any] = [None, None]
        self.in_flight = 0

    def synchronize(self) -> None:
        self.stream.synchronize()
        self.copy_stream.synchronize()


class CUDAExecutor:
    """Side-stream, staged copies between CUDA KV tensors and a host pool."""

    jobs_in_flight = 2  # the next job is planned and launched while the last one copies

    def __init__(
        self,
        layout: KVLayout,
        pool: HostBlockPool,
        *,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        coalesce: bool = True,
        one_kernel: bool | None = None,
        cuda: Any = None,
    ) -> None:
        """``staging_bytes``: the staging cap per worker thread. ``coalesce=False`` copies
        page by page (the per-row path, for measurement). ``one_kernel``: gather or scatter
        a batch with one kernel over a ``ByteSpan`` (default: when its granule is at least
        ``MIN_GRANULE`` bytes; ``True``: whenever a span exists; ``False``: one kernel per
        tensor). ``cuda``: see the module docstring."""
        self.layout, self.pool = layout, pool
        self.staging_cap = positive_int("staging_bytes", staging_bytes)
        self.coalesce = coalesce
        self.cuda = torch.cuda if cuda is None else cuda
        self.device = layout.device
        if not pool.pinned:
            logger.warning("kvoffload: the host pool is not pinned: device copies will be synchronous")
        self.span = None if one_kernel is False else ByteSpan.of(layout, 1 if one_kernel else MIN_GRANULE)
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
        state = _State(self.cuda.Stream(device=self.device), self.cuda.Stream(device=self.device))
        with self._lock:
            self._states.append(state)
        return state

    @property
    def batch_bytes(self) -> int:
        """The staging bytes one batch plans for: half the cap (two buffers in flight)."""
        return max(1, self.staging_cap // 2)

    def launch(self, store: bool, pieces: Sequence[Piece], state: _State, ready: Any = None) -> Any:
        half = self.batch_bytes
        # Planned lazily: the first batch moves while the next ones are planned.
        batches = iter_batches(pieces, self.pool, half, self.coalesce)
        cuda = self.cuda
        kernels, copies = state.stream, state.copy_stream
        # The stream that starts the job, and the one that ends it (it waits for the other).
        first, last = (kernels, copies) if store else (copies, kernels)
        try:
            start = cuda.Event(enable_timing=True, blocking=True)
            end = cuda.Event(enable_timing=True, blocking=True)
            with cuda.device(self.device):
                if ready is not None:
                    kernels.wait_event(ready)
                start.record(first)
                last.wait_event(start)
                if self.span is not None:
                    self.span.check({tensor for tensor, _, _ in pieces})
                if not state.in_flight:
                    state.used = 0  # every earlier job finished (or was fenced): indices spent
                for batch in batches:
                    slot = state.next_slot
                    state.next_slot ^= 1
                    with cuda.stream(kernels):
                        batch_rows = self._upload(state, self._indices(batch))
                    staging = self._staging(state, slot, max(half, batch.staging_bytes))
                    if state.free[slot] is not None:
                        self._reuse_after(first, state.free[slot])
                    with cuda.stream(first):
                        if store:
                            self._gather(batch, staging, batch_rows)
                        else:
                            self._copy(False, batch, staging)
                    handed = cuda.Event()
                    handed.record(first)
                    last.wait_event(handed)
                    with cuda.stream(last):
                        if store:
                            self._copy(True, batch, staging)
                        else:
                            self._scatter(batch, staging, batch_rows)
                    state.free[slot] = cuda.Event()
                    state.free[slot].record(last)
                end.record(last)
        except BaseException:
            self._fence(state)
            raise
        state.in_flight += 1
        return state, start, end

    def finish(self, handle: Any) -> float:
        state, start, end = handle
        try:
            end.synchronize()
            return start.elapsed_time(end) / 1000.0
        except BaseException:
            self._fence(state)
            raise
        finally:
            state.in_flight -= 1

    def close(self) -> None:
        with self._lock:
            for state in self._states:
                state.staging = [None, None]
                state.index_host = state.index_device = None
            self._states.clear()

    # -- accounting ---------------------------------------------------------------------

    @property
    def staging_bytes_held(self) -> int:
        with self._lock:
            return sum(b.numel() for s in self._states for b in s.staging if b is not None)

    # -- internals ----------------------------------------------------------------------

    def _reuse_after(self, stream: Any, freed: Any) -> None:
        """``stream`` touches a staging buffer only after ``freed``: its last use is done."""
        stream.wait_event(freed)

    def _fence(self, state: _State) -> None:
        try:
            state.synchronize()
        except BaseException:  # noqa: BLE001 - a dead context: nothing of ours runs any more
            logger.exception("kvoffload: synchronizing a failed job's streams failed too")

    def _staging(self, state: _State, slot: int, nbytes: int) -> torch.Tensor:
        # Grown, never shrunk; allocated on the kernel stream and marked as used on the copy
        # stream, so the caching allocator reuses a dropped buffer only after both are done.
        buffer = state.staging[slot]
        if buffer is None or buffer.numel() < nbytes:
            state.staging[slot] = None
            with self.cuda.stream(state.stream):
                buffer = torch.empty(-(-nbytes // 8) * 8, dtype=torch.uint8, device=self.device)
            if buffer.is_cuda:
                buffer.record_stream(state.copy_stream)
            state.staging[slot] = buffer
            held = self.staging_bytes_held
            with self._lock:
                self.peak_staging_bytes = max(self.peak_staging_bytes, held)
        return buffer

    def _indices(self, batch: Batch) -> list[np.ndarray]:
        """The index arrays the batch's kernels take: one span granule index, or each
        gather's device rows."""
        if self.span is None:
            return [g.device_rows for g in batch.gathers]
        return [self.span.granules(batch.gathers, batch.staging_bytes)]

    def _upload(self, state: _State, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        """``arrays`` on the device, in one copy on the kernel stream (the current one),
        through the state's index ring: pinning a fresh host buffer per batch costs more
        than the batch's copies."""
        n = sum(len(a) for a in arrays)
        if n > INDEX_RING_ENTRIES:  # one huge batch: a one-off pinned buffer
            flat = torch.from_numpy(np.concatenate(arrays))
            if self.device.type == "cuda":
                flat = flat.pin_memory()
            flat = flat.to(self.device, non_blocking=True)
        else:
            if state.index_host is None:
                pin = self.device.type == "cuda"
                state.index_host = torch.empty(INDEX_RING_ENTRIES, dtype=torch.int64, pin_memory=pin)
                state.index_device = torch.empty(INDEX_RING_ENTRIES, dtype=torch.int64, device=self.device)
            if state.used + n > INDEX_RING_ENTRIES:
                state.stream.synchronize()  # every earlier upload and kernel read is done
                state.used = 0
            at = state.used
            np.concatenate(arrays, out=state.index_host.numpy()[at : at + n])
            flat = state.index_device[at : at + n]
            flat.copy_(state.index_host[at : at + n], non_blocking=True)
            state.used += n
        out, at = [], 0
        for a in arrays:
            out.append(flat[at : at + len(a)])
            at += len(a)
        return out

    def _copy(self, store: bool, batch: Batch, staging: torch.Tensor) -> None:
        """The batch's bus copies: staging to the host pool (store) or back (load)."""
        region = self.pool.region
        for h, s, n in zip(batch.host.tolist(), batch.staging.tolist(), batch.nbytes.tolist()):
            if store:
                region[h : h + n].copy_(staging[s : s + n], non_blocking=True)
            else:
                staging[s : s + n].copy_(region[h : h + n], non_blocking=True)

    def _span_rows(self, batch: Batch, staging: torch.Tensor) -> torch.Tensor:
        """The batch's staging bytes as rows of one span granule."""
        rows = self.span.rows
        return staging[: batch.staging_bytes].view(rows.dtype).view(-1, rows.shape[1])

    def _gather(self, batch: Batch, staging: torch.Tensor, rows: list[torch.Tensor]) -> None:
        if self.span is not None:
            torch.index_select(self.span.rows, 0, rows[0], out=self._span_rows(batch, staging))
            return
        for gather, idx in zip(batch.gathers, rows):
            for col in gather.columns:
                device, view = self._wide_pair(col, staging, len(gather.device_rows))
                # Into the strided staging rows directly: ``out`` may be non-contiguous.
                torch.index_select(device, 0, idx, out=view)

    def _scatter(self, batch: Batch, staging: torch.Tensor, rows: list[torch.Tensor]) -> None:
        if self.span is not None:
            self.span.rows.index_copy_(0, rows[0], self._span_rows(batch, staging))
            return
        for gather, idx in zip(batch.gathers, rows):
            for col in gather.columns:
                device, view = self._wide_pair(col, staging, len(gather.device_rows))
                device.index_copy_(0, idx, view)

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
