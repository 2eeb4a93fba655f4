"""Row-copy plans: how one tensor's (source row, destination row) pairs become few bulk copies.

A job hands an executor, per tensor, arrays ``src_rows`` and ``dst_rows``: row
``src_rows[i]`` of the source is copied to row ``dst_rows[i]`` of the destination
(destinations are distinct; the engine checks that at submit). numpy and torch have no
copy with indices on both sides, and gathering into a staging buffer and scattering
from it measured slower than copying row by row (0.5-0.7 of a contiguous copy for 64
and 128 KiB rows, against 0.9-1.0: the second pass is not free even when the buffer
stays in cache). So the pairs are grouped into *runs*, each one numpy call that moves
its bytes exactly once:

* consecutive sources into consecutive destinations: a slice assignment (a memcpy);
* scattered sources into consecutive destinations: ``np.take(..., out=destination
  slice)``, a gather straight into place;
* consecutive sources into scattered destinations: ``dst[index] = src[slice]``, a
  scatter straight from place.

``plan_copies`` groups by destination or by source, whichever gives fewer runs, so the
common cases are a handful of calls: freshly allocated host blocks have consecutive ids
(a store gathers into one run, a load scatters from one), and whole host blocks of F
sub-blocks are runs of F. Pairs scattered on both sides are single rows, i.e. one slice
copy per row: with no vectorised alternative that is faster, that is the cheapest plan.

Runs are cut into operations of at most ``op_rows`` rows, and operations are packed into
*units* of at most ``unit_rows`` rows. A unit is the work one copy thread takes at a
time: small enough that threads share a job evenly (and a descheduled thread on a busy
machine holds back little), large enough that Python overhead stays small. The op cap
exists because a slice copy is one ``memcpy``, and glibc's ``memcpy`` switched to a
slower strategy for 1 MiB copies on the machine we measured (9.7 GB/s on one thread,
against 12-14 GB/s for 256-512 KiB copies).

Strided rows. The arrays are often views whose rows sit further apart than their width:
a tensor's rows in a block-interleaved host pool are a whole block apart, a device
tensor may interleave K and V. ``np.take`` copies any source that is not C-contiguous
into a contiguous temporary first, *all* of it, whatever the index: a gather from one
layer of the host pool copied the layer's whole pool per operation (a 64-row load
scattered on both sides ran at 0.02-0.05 of a contiguous copy whenever its plan
gathered, ``bench/bench_transfer.py``, numpy copier, issue 29). So ``apply_unit``
gathers from ``Source.pages``: the same memory viewed as C-contiguous rows of the same
width, source row ``i`` being page ``i * step`` (where rows are a whole number of widths
apart, as in an interleaved pool whose tensors share one page size). ``np.take`` into a
destination that is not C-contiguous goes through a temporary too (three passes: read
the destination, gather, write back); such gathers copy row by row when a row is at
least ``ROW_COPY_BYTES`` (one ``memcpy`` per Python call), otherwise through fancy
indexing (gather into a temporary, then one strided copy), as do gathers from rows no
contiguous view covers. Scatters (fancy assignment) and slice copies work in place on
any strides.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numpy.lib.stride_tricks import as_strided

# Gathers into strided rows of at least this many bytes copy one row per call. On one
# thread, cache-warm: 64 KiB rows 19 GB/s, against 13 through a temporary and 8.5 with
# np.take's own; 4 KiB rows 3, 8 and 5 GB/s. A whole store job on two threads (fresh host
# ids, an interleaved pool): 64-128 KiB pages 0.75-1.05 of a contiguous copy row by row,
# against 0.65-0.9 through a temporary and 0.6-0.8 with np.take's; 32 KiB pages row by
# row fell to 0.35-0.5 on an idle machine (a GIL hand-over per row) against 0.7-0.85.
ROW_COPY_BYTES = 64 << 10

# One operation: (source key, destination key). A key is a slice of rows or an int64
# array of row ids; at most one side is an array.
Op = tuple[slice | np.ndarray, slice | np.ndarray]
Unit = list[Op]


def run_bounds(sorted_rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Start offsets and lengths of runs of consecutive values in ``sorted_rows``."""
    breaks = np.flatnonzero(np.diff(sorted_rows) != 1) + 1
    starts = np.concatenate(([0], breaks)).astype(np.int64)
    lengths = np.diff(np.concatenate((starts, [len(sorted_rows)])))
    return starts, lengths


def _pairs(
    src_rows, dst_rows, unit_rows: int, op_rows: int | None
) -> tuple[np.ndarray, np.ndarray, int, int]:
    """The row arrays as int64 (``ValueError`` if their lengths differ), and the unit and
    operation caps as ints of at least 1 (the operation cap at most the unit cap)."""
    src_rows = np.asarray(src_rows, dtype=np.int64)
    dst_rows = np.asarray(dst_rows, dtype=np.int64)
    if len(src_rows) != len(dst_rows):
        raise ValueError(f"{len(src_rows)} source rows for {len(dst_rows)} destination rows")
    unit_rows = max(1, int(unit_rows))
    op_rows = unit_rows if op_rows is None else max(1, min(int(op_rows), unit_rows))
    return src_rows, dst_rows, unit_rows, op_rows


def plan_copies(
    src_rows: np.ndarray, dst_rows: np.ndarray, unit_rows: int, op_rows: int | None = None
) -> list[Unit]:
    """Units of operations that together copy ``src[src_rows[i]]`` to ``dst[dst_rows[i]]``
    for every ``i``; apply each with ``apply_unit``. Units touch disjoint destination
    rows, so they may run concurrently and in any order. ``op_rows`` (default
    ``unit_rows``) caps the rows of one operation."""
    src_rows, dst_rows, unit_rows, op_rows = _pairs(src_rows, dst_rows, unit_rows, op_rows)
    if not len(dst_rows):
        return []
    by_dst = np.argsort(dst_rows, kind="stable")
    by_src = np.argsort(src_rows, kind="stable")
    dst_runs = 1 + int(np.count_nonzero(np.diff(dst_rows[by_dst]) != 1))
    src_runs = 1 + int(np.count_nonzero(np.diff(src_rows[by_src]) != 1))
    # Ties go to gathers: np.take into a slice measured at least as fast as a scatter.
    gather = dst_runs <= src_runs
    order = by_dst if gather else by_src
    src, dst = src_rows[order], dst_rows[order]
    lead, other = (dst, src) if gather else (src, dst)
    starts, lengths = run_bounds(lead)
    # breaks_before[i]: how many times ``other`` is not consecutive within [0, i]; a
    # run whose ``other`` side has no break inside is a plain slice copy.
    breaks_before = np.concatenate(([0], np.cumsum(np.diff(other) != 1)))

    units: list[Unit] = []
    unit: Unit = []
    rows_in_unit = 0
    for start, length in zip(starts.tolist(), lengths.tolist()):
        for a in range(start, start + length, op_rows):  # cut long runs
            n = min(op_rows, start + length - a)
            if rows_in_unit + n > unit_rows:
                units.append(unit)
                unit, rows_in_unit = [], 0
            s0, d0 = int(src[a]), int(dst[a])
            if breaks_before[a + n - 1] == breaks_before[a]:
                unit.append((slice(s0, s0 + n), slice(d0, d0 + n)))
            elif gather:
                unit.append((src[a : a + n], slice(d0, d0 + n)))
            else:
                unit.append((slice(s0, s0 + n), dst[a : a + n]))
            rows_in_unit += n
    units.append(unit)
    return units


class Source(NamedTuple):
    """Rows to copy from: ``rows`` (2-D) and, where one exists, ``pages``, a C-contiguous
    view of the same memory in which ``rows[i]`` is ``pages[i * step]`` (``None``
    otherwise). Build with ``source``."""

    rows: np.ndarray
    pages: np.ndarray | None
    step: int


def source(rows: np.ndarray) -> Source:
    """``rows`` with a C-contiguous view for gathers (see the module's "Strided rows"):
    possible when each row is contiguous and rows are a positive whole number of row
    widths apart. The view spans only memory between ``rows``' first and last byte."""
    if rows.flags.c_contiguous:
        return Source(rows, rows, 1)
    count, width = rows.shape
    row_bytes, (row_step, item_step) = width * rows.itemsize, rows.strides
    if count and row_bytes and item_step == rows.itemsize and row_step > 0 and not row_step % row_bytes:
        step = row_step // row_bytes
        pages = as_strided(rows, ((count - 1) * step + 1, width), (row_bytes, rows.itemsize), writeable=False)
        return Source(rows, pages, step)
    return Source(rows, None, 1)


def apply_unit(src: np.ndarray | Source, dst: np.ndarray, unit: Unit) -> None:
    """Run one unit on 2-D arrays of rows (``src`` also as a ``Source``, built once for
    many units). numpy releases the GIL while it copies, so units on different threads
    copy in parallel; it never starts threads of its own."""
    if not isinstance(src, Source):
        src = source(src)
    for s, d in unit:
        if isinstance(s, np.ndarray):
            _gather(src, s, dst[d])
        else:
            dst[d] = src.rows[s]


def _gather(src: Source, index: np.ndarray, out: np.ndarray) -> None:
    """``out[i] = src.rows[index[i]]`` for every ``i``, never copying more of the source
    than those rows (see the module's "Strided rows")."""
    if src.pages is not None and out.flags.c_contiguous:
        # mode="clip" skips the bounds check (ids were checked at submit); with the
        # default mode="raise", numpy copies through a temporary buffer whenever
        # ``out`` is given, which made gathers 3-5x slower.
        np.take(src.pages, index * src.step if src.step != 1 else index, axis=0, out=out, mode="clip")
    elif out.shape[1] * out.itemsize >= ROW_COPY_BYTES:
        for i, row in enumerate(index.tolist()):
            out[i] = src.rows[row]
    else:
        out[...] = src.rows[index]


# One unit of runs: (first source row, first destination row, rows) per run, int64 arrays.
Runs = tuple[np.ndarray, np.ndarray, np.ndarray]


def plan_runs(
    src_rows: np.ndarray, dst_rows: np.ndarray, unit_rows: int, op_rows: int | None = None
) -> list[Runs]:
    """Units of *runs* that together copy ``src[src_rows[i]]`` to ``dst[dst_rows[i]]``:
    a run is rows consecutive on both sides, at most ``op_rows`` (default ``unit_rows``)
    of them; a pair scattered on both sides is a run of one row. Units hold about
    ``unit_rows`` rows (a unit may exceed it by less than one run), touch disjoint
    destination rows and are in destination order. For a copier that takes many byte
    ranges per call (``kvoffload.transfer.native``), where the number of runs, not the
    number of calls, is what a scattered pattern costs. Computed without a Python loop."""
    src_rows, dst_rows, unit_rows, op_rows = _pairs(src_rows, dst_rows, unit_rows, op_rows)
    if not len(dst_rows):
        return []
    order = np.argsort(dst_rows, kind="stable")
    src, dst = src_rows[order], dst_rows[order]
    joined = (np.diff(src) == 1) & (np.diff(dst) == 1)
    starts = np.flatnonzero(np.concatenate(([True], ~joined)))
    lengths = np.diff(np.append(starts, len(dst)))
    if lengths.max() > op_rows:  # cut long runs into pieces of at most op_rows
        pieces = -(-lengths // op_rows)
        first_piece = np.repeat(np.cumsum(pieces) - pieces, pieces)
        piece_starts = np.repeat(starts, pieces) + (np.arange(len(first_piece)) - first_piece) * op_rows
        lengths = np.minimum(op_rows, np.repeat(starts + lengths, pieces) - piece_starts)
        starts = piece_starts
    unit_of = (np.cumsum(lengths) - lengths) // unit_rows
    cuts = np.flatnonzero(np.diff(unit_of)) + 1
    return list(zip(np.split(src[starts], cuts), np.split(dst[starts], cuts), np.split(lengths, cuts)))
