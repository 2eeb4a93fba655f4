"""Byte-range copies in one native call: the CPU executor's fast path.

``kvoffload.transfer._rowcopy`` (C, built at install when a compiler is present; see
pyproject.toml) copies a list of byte ranges per call without the GIL, with streaming
stores on x86-64 when asked (see the C file for why). ``AVAILABLE`` says whether it was built; the
CPU executor falls back to numpy (``row_plan.plan_copies``) without it.

``ByteRuns.of(runs, src_step, dst_step, row_bytes)`` turns a unit of row runs
(``row_plan.plan_runs``) into byte offsets and lengths for rows ``src_step`` and
``dst_step`` bytes apart; a run of several rows stays one range only where rows are
packed (step equal to the row's bytes), otherwise it becomes one range per row.
``copy(dst_address, src_address, runs)`` then copies them. The caller guarantees that
every range lies inside memory it holds for the whole call and that destination ranges
do not overlap: nothing here can check an address.
"""

from __future__ import annotations

import numpy as np

from kvoffload.transfer.row_plan import Runs

try:
    from kvoffload.transfer import _rowcopy
except ImportError:  # built without a C compiler
    _rowcopy = None

AVAILABLE = _rowcopy is not None
STREAMING = bool(_rowcopy is not None and _rowcopy.STREAMING)


class ByteRuns:
    """Byte offsets (from each side's base address) and lengths of one unit's ranges."""

    __slots__ = ("src_offsets", "dst_offsets", "lengths", "_arguments")

    def __init__(self, src_offsets: np.ndarray, dst_offsets: np.ndarray, lengths: np.ndarray) -> None:
        self.src_offsets = np.ascontiguousarray(src_offsets, dtype=np.int64)
        self.dst_offsets = np.ascontiguousarray(dst_offsets, dtype=np.int64)
        self.lengths = np.ascontiguousarray(lengths, dtype=np.int64)
        if not len(self.src_offsets) == len(self.dst_offsets) == len(self.lengths):
            raise ValueError("offsets and lengths must have one entry per range")
        # The arrays live as long as this object: their addresses are taken once.
        self._arguments = (
            self.dst_offsets.ctypes.data,
            self.src_offsets.ctypes.data,
            self.lengths.ctypes.data,
            len(self.lengths),
        )

    @classmethod
    def of(cls, runs: Runs, src_step: int, dst_step: int, row_bytes: int) -> ByteRuns:
        src_first, dst_first, rows = runs
        if (src_step != row_bytes or dst_step != row_bytes) and rows.max(initial=0) > 1:
            # Padded rows: a run of n rows is n ranges.
            within = np.arange(int(rows.sum())) - np.repeat(np.cumsum(rows) - rows, rows)
            src_first = np.repeat(src_first, rows) + within
            dst_first = np.repeat(dst_first, rows) + within
            rows = np.ones(len(src_first), dtype=np.int64)
        return cls(src_first * src_step, dst_first * dst_step, rows * row_bytes)

    @property
    def nbytes(self) -> int:
        return int(self.lengths.sum())


def copy(dst_address: int, src_address: int, runs: ByteRuns, stream: bool = True) -> None:
    """Copy every range of ``runs`` (see the module contract); releases the GIL.
    ``stream``: write with streaming stores where available, leaving the destination out
    of the CPU's caches (for bytes nobody reads soon, such as a store into the host pool;
    not for KV the engine reads next)."""
    if _rowcopy is None:
        raise RuntimeError("kvoffload.transfer._rowcopy was not built (no C compiler at install)")
    _rowcopy.copy_runs(dst_address, src_address, *runs._arguments, stream)
