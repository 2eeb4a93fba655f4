"""The native byte-range copier behind the CPU executor (``kvoffload.transfer.native``).

Ranges of every length class (below and above the streaming threshold, with unaligned
heads and tails) land exactly, bytes outside them stay, padded rows split into one range
per row, and bad calls are refused with a clear error. Skipped when the extension was not
built (no C compiler at install), with the reason printed.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvoffload.transfer import native
from kvoffload.transfer.row_plan import plan_runs

pytestmark = pytest.mark.skipif(
    not native.AVAILABLE,
    reason="could not import kvoffload.transfer._rowcopy (not built: no C compiler at install)",
)

LENGTHS = [0, 1, 15, 16, 63, 64, 100, 4095, 4096, 4097, 8192 + 48, 65536 + 13]


def _disjoint_ranges(rng: np.random.Generator, lengths: list[int], span: int) -> np.ndarray:
    """Offsets of non-overlapping ranges of ``lengths`` bytes at random, unaligned places."""
    gaps = rng.integers(0, 40, len(lengths))
    order = rng.permutation(len(lengths))
    offsets = np.zeros(len(lengths), dtype=np.int64)
    at = int(rng.integers(0, 16))
    for i in order:
        offsets[i] = at + gaps[i]
        at = int(offsets[i]) + lengths[i]
    assert at <= span
    return offsets


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_every_range_lands_and_nothing_else_changes(seed: int, stream: bool) -> None:
    rng = np.random.default_rng(seed)
    lengths = [LENGTHS[i] for i in rng.permutation(len(LENGTHS))]
    span = sum(lengths) + 41 * len(lengths) + 64
    src = rng.integers(0, 256, span, dtype=np.uint8)
    dst = rng.integers(0, 256, span, dtype=np.uint8)
    src_offsets = _disjoint_ranges(rng, lengths, span)
    dst_offsets = _disjoint_ranges(rng, lengths, span)
    want = dst.copy()
    for s, d, n in zip(src_offsets, dst_offsets, lengths):
        want[d : d + n] = src[s : s + n]
    runs = native.ByteRuns(src_offsets, dst_offsets, np.array(lengths))
    native.copy(dst.ctypes.data, src.ctypes.data, runs, stream)
    np.testing.assert_array_equal(dst, want)
    assert runs.nbytes == sum(lengths)


@pytest.mark.parametrize("pad", [0, 24])
def test_runs_of_padded_rows_become_one_range_per_row(pad: int) -> None:
    rows, width = 12, 4096 + 32
    rng = np.random.default_rng(pad)
    src_base = rng.integers(0, 256, (rows, width + pad), dtype=np.uint8)
    dst_base = rng.integers(0, 256, (rows, width + pad), dtype=np.uint8)
    src_rows, dst_rows = np.array([0, 1, 2, 9, 5, 6]), np.array([3, 4, 5, 0, 10, 11])
    want = dst_base.copy()
    want[dst_rows, :width] = src_base[src_rows, :width]
    step = width + pad
    for unit in plan_runs(src_rows, dst_rows, unit_rows=4):
        runs = native.ByteRuns.of(unit, step, step, width)
        assert len(runs.lengths) == (int(unit[2].sum()) if pad else len(unit[2]))
        native.copy(dst_base.ctypes.data, src_base.ctypes.data, runs)
    np.testing.assert_array_equal(dst_base, want)  # padding bytes untouched


def test_bad_calls_are_refused_naming_the_problem() -> None:
    from kvoffload.transfer import _rowcopy

    with pytest.raises(TypeError, match="7 arguments, got 2"):
        _rowcopy.copy_runs(0, 0)
    with pytest.raises(ValueError, match="count must be >= 0, got -1"):
        _rowcopy.copy_runs(0, 0, 0, 0, 0, -1, True)
    with pytest.raises(ValueError, match="one entry per range"):
        native.ByteRuns(np.zeros(2), np.zeros(2), np.zeros(1))


def test_an_executor_cannot_ask_for_a_copier_that_was_not_built(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from kvoffload.transfer import HostBlockPool, KVLayout
    from kvoffload.transfer.cpu_executor import CPUExecutor

    layout = KVLayout.from_layer_tensors({"layer0": torch.zeros((4, 64), dtype=torch.uint8)})
    pool = HostBlockPool(layout, 2)
    monkeypatch.setattr(native, "AVAILABLE", False)
    with pytest.raises(ValueError, match="native_copies=True"):
        CPUExecutor(layout, pool, native_copies=True)
    executor = CPUExecutor(layout, pool)  # the default falls back to numpy
    assert executor.native_copies is False
    executor.close()
