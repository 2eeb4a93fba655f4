"""Staging plans: how a device job's rows become device gathers and few host copies.

A device executor cannot copy scattered rows across the bus cheaply: each
``cudaMemcpyAsync`` has a fixed cost, and a small page crosses the bus well below the
link's speed. So a job is staged: on the device, the job's pages are gathered into (a
store) or scattered from (a load) one contiguous staging buffer laid out in *host address
order*, and the staging buffer crosses the bus in one copy per contiguous host range. In
an interleaved ``HostBlockPool`` a run of consecutive host ids is one such range across
every layer; in a tensor-major pool it is one per tensor.

``plan_batches(pieces, pool, cap)`` returns ``Batch`` es (``iter_batches``: the same, one
at a time). A batch needs at most ``cap``
staging bytes (at least one host row of one group: a cap smaller than that is raised to
it), so a job of any size runs in bounded device memory. Within a batch:

* ``gathers``: per chunk of one group, the device rows (in host order) and, for each of
  the group's tensors, where its page of the chunk's ``i``-th row sits in staging:
  ``offset + i * stride``;
* ``host``, ``staging``, ``nbytes``: the copies, byte offsets into ``pool.region`` and the
  staging buffer. A copy never crosses one of ``pool.register_bounds`` (to the driver a
  copy spanning two pinned registrations is not one pinned range); copies are split there.

``coalesce=False`` plans one copy per page (the per-row path, kept for measurement).
Pure numpy: the executor runs the plan, tests check it without a device.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvoffload.transfer.executor import Piece
from kvoffload.transfer.host_pool import HostBlockPool


@dataclass(frozen=True)
class Column:
    """Tensor ``tensor``'s page of row ``i`` is at staging byte ``offset + i * stride``."""

    tensor: int
    offset: int
    stride: int


@dataclass(frozen=True)
class Gather:
    """Device rows of one chunk of one group, in staging order, and its tensors' columns."""

    device_rows: np.ndarray  # int64
    columns: tuple[Column, ...]


@dataclass
class Batch:
    gathers: list[Gather] = field(default_factory=list)
    host: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    staging: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    nbytes: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    staging_bytes: int = 0

    @property
    def num_copies(self) -> int:
        return len(self.host)


def _groups(pieces: Sequence[Piece]) -> list[tuple[list[int], np.ndarray, np.ndarray]]:
    """Pieces sharing row arrays (the tensors of one group) as one entry, in first-seen order."""
    by_rows: dict[tuple[int, int], tuple[list[int], np.ndarray, np.ndarray]] = {}
    for tensor, device_rows, host_rows in pieces:
        key = (id(device_rows), id(host_rows))
        if key not in by_rows:
            by_rows[key] = ([], np.asarray(device_rows, np.int64), np.asarray(host_rows, np.int64))
        by_rows[key][0].append(tensor)
    return list(by_rows.values())


def _copies(
    host: np.ndarray, lengths: np.ndarray, bound_starts: np.ndarray, coalesce: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pages (host offsets and lengths, laid out densely in staging from 0) as copies of
    contiguous host ranges, merged unless ``coalesce`` is off, split at chunk starts."""
    staging = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.int64)
    if len(host) and coalesce:
        joins = host[1:] == host[:-1] + lengths[:-1]
        starts = np.flatnonzero(np.concatenate(([True], ~joins)))
        ends = np.concatenate((starts[1:], [len(host)]))
        totals = np.concatenate(([0], np.cumsum(lengths)))
        host, staging, lengths = (
            host[starts],
            staging[starts],
            (totals[ends] - totals[starts]).astype(np.int64),
        )
    first = np.searchsorted(bound_starts, host, side="right")
    last = np.searchsorted(bound_starts, host + lengths - 1, side="right")
    crossing = np.flatnonzero(first != last)
    if not len(crossing):
        return host, staging, lengths
    out_h, out_s, out_n = [], [], []
    previous = 0
    for k in crossing.tolist():  # rare: one per chunk end inside the job
        out_h.append(host[previous:k])
        out_s.append(staging[previous:k])
        out_n.append(lengths[previous:k])
        cuts = bound_starts[first[k] : last[k]]
        edges = np.concatenate(([host[k]], cuts, [host[k] + lengths[k]]))
        out_h.append(edges[:-1])
        out_s.append(staging[k] + edges[:-1] - host[k])
        out_n.append(np.diff(edges))
        previous = k + 1
    out_h.append(host[previous:])
    out_s.append(staging[previous:])
    out_n.append(lengths[previous:])
    return (
        np.concatenate(out_h).astype(np.int64),
        np.concatenate(out_s).astype(np.int64),
        np.concatenate(out_n).astype(np.int64),
    )


def plan_batches(
    pieces: Sequence[Piece], pool: HostBlockPool, cap: int, coalesce: bool = True
) -> list[Batch]:
    """The batches of a job given as pieces ``(tensor, device_rows, host_rows)``; see the
    module docstring."""
    return list(iter_batches(pieces, pool, cap, coalesce))


def iter_batches(
    pieces: Sequence[Piece], pool: HostBlockPool, cap: int, coalesce: bool = True
) -> Iterator[Batch]:
    """``plan_batches`` one batch at a time, each planned when it is asked for, so an
    executor can start moving the first batch while it plans the next."""
    page = pool.layout.page_bytes
    bound_starts = np.asarray([off for off, _ in pool.register_bounds] or [0], np.int64)
    batch = Batch()
    hosts: list[np.ndarray] = []
    lengths: list[np.ndarray] = []

    def finish(batch: Batch) -> Batch:
        host, length = np.concatenate(hosts), np.concatenate(lengths)
        batch.host, batch.staging, batch.nbytes = _copies(host, length, bound_starts, coalesce)
        hosts.clear()
        lengths.clear()
        return batch

    for tensors, device_rows, host_rows in _groups(pieces):
        if not len(host_rows):
            continue
        tensors = sorted(tensors, key=pool.row_offset)
        offsets = np.asarray([pool.row_offset(t) for t in tensors], np.int64)
        strides = np.asarray([pool.row_stride(t) for t in tensors], np.int64)
        pages = np.asarray([page(t) for t in tensors], np.int64)
        row_bytes = int(pages.sum())
        order = np.argsort(host_rows, kind="stable")
        h_sorted, d_sorted = host_rows[order], device_rows[order]
        rows_per_chunk = max(1, cap // row_bytes)
        for first in range(0, len(h_sorted), rows_per_chunk):
            h, d = h_sorted[first : first + rows_per_chunk], d_sorted[first : first + rows_per_chunk]
            size = len(h) * row_bytes
            if batch.gathers and batch.staging_bytes + size > cap:
                yield finish(batch)
                batch = Batch()
            base = batch.staging_bytes
            if pool.interleaved:
                # Staging rows are host rows: each tensor's page side by side.
                columns = np.concatenate(([0], np.cumsum(pages)[:-1]))
                cols = tuple(Column(t, base + int(c), row_bytes) for t, c in zip(tensors, columns))
                host = offsets[None, :] + h[:, None] * strides[None, :]
                length = np.broadcast_to(pages[None, :], host.shape)
            else:
                # One slab per tensor: each tensor's pages of the chunk one after another.
                starts = np.concatenate(([0], np.cumsum(pages * len(h))[:-1]))
                cols = tuple(Column(t, base + int(s), int(p)) for t, s, p in zip(tensors, starts, pages))
                host = offsets[:, None] + h[None, :] * strides[:, None]
                length = np.broadcast_to(pages[:, None], host.shape)
            hosts.append(host.ravel())
            lengths.append(np.ascontiguousarray(length).ravel())
            batch.gathers.append(Gather(d, cols))
            batch.staging_bytes += size
    if batch.gathers:
        yield finish(batch)
