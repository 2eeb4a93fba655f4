"""Row-copy plans and the copy pool behind the CPU executor.

Plans: applying every unit copies exactly the requested rows (runs, scattered rows,
both), units never share a destination row (they run concurrently), and each id pattern
takes the bulk operation meant for it. Pool: every task runs once, the first error
reaches the caller only after the tasks already started have finished, later tasks are
skipped, and two callers can share the helpers.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvoffload.transfer import row_plan
from kvoffload.transfer.copy_pool import CopyPool
from kvoffload.transfer.row_plan import apply_unit, plan_copies, plan_runs, source

ROWS = 40


def _ids(draw, pattern: str, count: int, limit: int) -> np.ndarray:
    if pattern == "run":
        first = draw(st.integers(0, limit - count))
        return np.arange(first, first + count)
    if pattern == "blocks":  # runs of 4, like whole host blocks with F=4
        blocks = draw(st.permutations(range(limit // 4)))[: -(-count // 4)]
        return (np.asarray(blocks, dtype=np.int64)[:, None] * 4 + np.arange(4)).ravel()[:count]
    return np.asarray(draw(st.permutations(range(limit)))[:count], dtype=np.int64)


@st.composite
def row_pairs(draw):
    count = draw(st.integers(0, 24))
    src = _ids(draw, draw(st.sampled_from(["run", "blocks", "scattered"])), count, ROWS)
    dst = _ids(draw, draw(st.sampled_from(["run", "blocks", "scattered"])), count, ROWS)
    return src, dst, draw(st.integers(1, 9)), draw(st.none() | st.integers(1, 9))


def _apply_all(src_rows, dst_rows, unit_rows, width=3, op_rows=None):
    rng = np.random.default_rng(len(src_rows))
    src = rng.integers(0, 2**62, (ROWS, width), dtype=np.int64)
    dst = rng.integers(0, 2**62, (ROWS, width), dtype=np.int64)
    want = dst.copy()
    want[dst_rows] = src[src_rows]
    units = plan_copies(src_rows, dst_rows, unit_rows, op_rows)
    for unit in units:
        apply_unit(src, dst, unit)
    return units, dst, want


def _dst_rows_of(unit):
    rows = []
    for _, d in unit:
        rows.extend(range(d.start, d.stop) if isinstance(d, slice) else d.tolist())
    return rows


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(row_pairs())
def test_plans_copy_exactly_the_requested_rows(case):
    src_rows, dst_rows, unit_rows, op_rows = case
    units, dst, want = _apply_all(src_rows, dst_rows, unit_rows, op_rows=op_rows)
    np.testing.assert_array_equal(dst, want)  # mapped rows copied, every other row untouched
    per_unit = [_dst_rows_of(u) for u in units]
    assert all(len(rows) <= unit_rows for rows in per_unit)
    flat = [r for rows in per_unit for r in rows]
    assert sorted(flat) == sorted(dst_rows.tolist())  # each destination in exactly one unit
    cap = unit_rows if op_rows is None else min(op_rows, unit_rows)
    assert all(len(_dst_rows_of([op])) <= cap for unit in units for op in unit)


def _kinds(units):
    return {
        "slice"
        if isinstance(s, slice) and isinstance(d, slice)
        else "gather"
        if isinstance(d, slice)
        else "scatter"
        for unit in units
        for s, d in unit
    }


@pytest.mark.parametrize(
    ("src_rows", "dst_rows", "kinds", "ops"),
    [
        # Consecutive on both sides: one slice copy per unit.
        (np.arange(5, 21), np.arange(20, 36), {"slice"}, 2),
        # Store into freshly allocated host blocks: one gather into the destination run.
        (np.array([9, 2, 30, 4, 17, 11, 0, 25]), np.arange(8, 16), {"gather"}, 1),
        # Load from consecutive host blocks to scattered device blocks: one scatter.
        (np.arange(8, 16), np.array([9, 2, 30, 4, 17, 11, 0, 25]), {"scatter"}, 1),
        # Scattered on both sides: single rows, copied as slices.
        (np.array([9, 2, 30, 4]), np.array([7, 33, 1, 15]), {"slice"}, 4),
        # Destination runs of 4 (whole host blocks) from scattered sources.
        (np.array([3, 9, 1, 7, 30, 20, 10, 0]), np.array([12, 13, 14, 15, 4, 5, 6, 7]), {"gather"}, 2),
    ],
    ids=["consecutive", "fresh-host-store", "fresh-host-load", "scattered", "host-blocks"],
)
def test_each_id_pattern_uses_its_bulk_operation(src_rows, dst_rows, kinds, ops):
    units, dst, want = _apply_all(src_rows, dst_rows, unit_rows=8)
    np.testing.assert_array_equal(dst, want)
    assert _kinds(units) == kinds
    assert sum(len(u) for u in units) == ops


def test_plans_work_on_strided_rows():
    # Padded pages: rows sit further apart than their width (numpy views of such tensors).
    rng = np.random.default_rng(1)
    src = rng.integers(0, 2**62, (ROWS, 6), dtype=np.int64)[:, :4]
    dst_base = rng.integers(0, 2**62, (ROWS, 6), dtype=np.int64)
    dst = dst_base[:, :4]
    before = dst_base.copy()
    src_rows, dst_rows = np.array([3, 8, 1, 30, 22, 5]), np.array([10, 11, 12, 13, 2, 39])
    for unit in plan_copies(src_rows, dst_rows, 4):
        apply_unit(src, dst, unit)
    before[dst_rows, :4] = src[src_rows]
    np.testing.assert_array_equal(dst_base, before)  # padding columns untouched


def test_source_view_is_the_same_memory_as_contiguous_pages():
    # One layer of a block-interleaved pool: rows a whole block (3 widths) apart.
    base = np.arange(ROWS * 3 * 4, dtype=np.int64).reshape(ROWS, 3, 4)
    rows = base[:, 1, :]
    src = source(rows)
    assert src.pages is not None and src.pages.flags.c_contiguous and src.step == 3
    np.testing.assert_array_equal(src.pages[np.arange(ROWS) * 3], rows)
    assert np.shares_memory(src.pages, base)
    # from the first row's first byte to the last row's last byte, nothing beyond
    assert src.pages.ctypes.data == rows.ctypes.data
    assert src.pages.ctypes.data + src.pages.nbytes == rows[-1].ctypes.data + rows[-1].nbytes
    contiguous = np.zeros((ROWS, 4), dtype=np.int64)
    assert source(contiguous).pages is contiguous
    assert source(np.zeros((ROWS, 6), dtype=np.int64)[:, :4]).pages is None  # padded: no such view


@pytest.mark.parametrize("width", [4, row_plan.ROW_COPY_BYTES // 8])  # below and at the per-row size
@pytest.mark.parametrize("src_layers", [1, 3])
@pytest.mark.parametrize("dst_layers", [1, 3])
def test_gathers_between_strided_rows_are_exact_and_never_copy_the_source(
    width, src_layers, dst_layers, monkeypatch
):
    """np.take copies a source that is not C-contiguous whole before gathering (the
    numpy copier's cliff: a load from an interleaved pool copied the pool per call)."""
    rng = np.random.default_rng(width + src_layers)
    src_base = rng.integers(0, 2**62, (ROWS, src_layers, width), dtype=np.int64)
    dst_base = rng.integers(0, 2**62, (ROWS, dst_layers, width), dtype=np.int64)
    src, dst = src_base[:, -1, :], dst_base[:, 0, :]
    want = dst_base.copy()
    src_rows, dst_rows = np.array([9, 2, 30, 4, 17, 11, 0, 25]), np.arange(8, 16)
    want[dst_rows, 0, :] = src[src_rows]
    real_take = np.take

    def take(a, *args, **kwargs):
        assert a.flags.c_contiguous, "np.take would copy the whole source first"
        return real_take(a, *args, **kwargs)

    monkeypatch.setattr(np, "take", take)
    units = plan_copies(src_rows, dst_rows, 8)
    assert _kinds(units) == {"gather"}
    for unit in units:
        apply_unit(source(src), dst, unit)
    np.testing.assert_array_equal(dst_base, want)  # other layers' rows untouched


def test_plan_rejects_mismatched_rows():
    with pytest.raises(ValueError, match="3 source rows for 2 destination rows"):
        plan_copies(np.arange(3), np.arange(2), 4)
    with pytest.raises(ValueError, match="3 source rows for 2 destination rows"):
        plan_runs(np.arange(3), np.arange(2), 4)
    assert plan_copies(np.arange(0), np.arange(0), 4) == []
    assert plan_runs(np.arange(0), np.arange(0), 4) == []


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(row_pairs())
def test_run_plans_copy_exactly_the_requested_rows(case):
    src_rows, dst_rows, unit_rows, op_rows = case
    rng = np.random.default_rng(len(src_rows))
    src = rng.integers(0, 2**62, (ROWS, 3), dtype=np.int64)
    dst = rng.integers(0, 2**62, (ROWS, 3), dtype=np.int64)
    want = dst.copy()
    want[dst_rows] = src[src_rows]
    cap = unit_rows if op_rows is None else min(op_rows, unit_rows)
    seen: list[int] = []
    for s_first, d_first, rows in plan_runs(src_rows, dst_rows, unit_rows, op_rows):
        assert rows.min() >= 1 and rows.max() <= cap
        assert rows.sum() < unit_rows + cap  # a unit overshoots by less than one run
        for s0, d0, n in zip(s_first.tolist(), d_first.tolist(), rows.tolist()):
            dst[d0 : d0 + n] = src[s0 : s0 + n]
            seen.extend(range(d0, d0 + n))
    np.testing.assert_array_equal(dst, want)
    assert len(seen) == len(set(seen)) == len(dst_rows)  # units share no destination row


def test_run_plans_join_rows_consecutive_on_both_sides_only():
    # 0..3 -> 10..13 is one run; 7 -> 14 and 5 -> 15 continue the destination but not
    # the source; 8, 9 -> 2, 3 is a run of two.
    units = plan_runs(np.array([0, 1, 2, 3, 7, 5, 8, 9]), np.array([10, 11, 12, 13, 14, 15, 2, 3]), 100)
    ((s_first, d_first, rows),) = units
    assert list(zip(s_first.tolist(), d_first.tolist(), rows.tolist())) == [
        (8, 2, 2),
        (0, 10, 4),
        (7, 14, 1),
        (5, 15, 1),
    ]


@pytest.mark.parametrize("threads", [1, 2, 5])
def test_pool_runs_every_task_once(threads):
    pool = CopyPool(threads)
    seen, lock = [], threading.Lock()

    def task(i):
        with lock:
            seen.append(i)

    try:
        pool.run([(i,) for i in range(100)], task)
        assert sorted(seen) == list(range(100))
        pool.run([], task)
    finally:
        pool.close()
        pool.close()


def test_pool_error_waits_for_started_tasks_and_skips_the_rest():
    pool = CopyPool(3)
    finished, lock = [], threading.Lock()

    def task(i):
        if i == 0:
            raise OSError("copy failed")
        time.sleep(0.05)
        with lock:
            finished.append(i)

    try:
        with pytest.raises(OSError, match="copy failed"):
            pool.run([(i,) for i in range(200)], task)
        done = list(finished)
        time.sleep(0.2)
        assert finished == done  # nothing still ran after run() raised
        assert len(done) < 199  # the rest were skipped
    finally:
        pool.close()


def test_pool_serves_two_callers_at_once():
    pool = CopyPool(2)
    counts = {"a": 0, "b": 0}
    lock = threading.Lock()

    def task(name):
        time.sleep(0.001)
        with lock:
            counts[name] += 1

    callers = [threading.Thread(target=pool.run, args=([(n,)] * 50, task)) for n in counts]
    for c in callers:
        c.start()
    for c in callers:
        c.join()
    pool.close()
    assert counts == {"a": 50, "b": 50}


def test_pool_rejects_bad_thread_counts():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="copy threads"):
            CopyPool(bad)
