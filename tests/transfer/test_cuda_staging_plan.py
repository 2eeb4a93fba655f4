"""Staging plans: few copies per job, inside the staging cap, never across a pinned chunk."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvoffload.transfer import HostBlockPool, KVLayout
from kvoffload.transfer.staging_plan import plan_batches

LAYERS, PAGE, NUM_HOST = 6, 64, 40


def one_group_layout(layers=LAYERS, page=PAGE) -> KVLayout:
    return KVLayout.from_layer_tensors(
        {f"l{i}": torch.zeros((48, page), dtype=torch.uint8) for i in range(layers)}
    )


def pieces(layout, device_rows, host_rows):
    device_rows, host_rows = np.asarray(device_rows), np.asarray(host_rows)
    return [(t, device_rows, host_rows) for t in range(len(layout.tensors))]


def copies(batches):
    return sum(b.num_copies for b in batches)


CONSECUTIVE = np.arange(10, 18)
SCATTERED = np.array([3, 30, 7, 21, 15, 9, 27, 1])


def test_interleaved_pool_copies_one_range_per_run_of_host_ids_across_all_layers():
    layout = one_group_layout()
    pool = HostBlockPool(layout, NUM_HOST, interleave=True)
    assert copies(plan_batches(pieces(layout, np.arange(8), CONSECUTIVE), pool, 1 << 20)) == 1
    assert copies(plan_batches(pieces(layout, np.arange(8), SCATTERED), pool, 1 << 20)) == 8
    two_runs = np.array([5, 6, 7, 20, 21, 22, 23, 24])
    (batch,) = plan_batches(pieces(layout, np.arange(8), two_runs), pool, 1 << 20)
    row = LAYERS * PAGE
    assert batch.host.tolist() == [5 * row, 20 * row]
    assert batch.nbytes.tolist() == [3 * row, 5 * row]
    assert batch.staging.tolist() == [0, 3 * row]


def test_tensor_major_pool_copies_one_range_per_tensor_and_run():
    layout = one_group_layout()
    pool = HostBlockPool(layout, NUM_HOST, interleave=False)
    assert copies(plan_batches(pieces(layout, np.arange(8), CONSECUTIVE), pool, 1 << 20)) == LAYERS
    assert copies(plan_batches(pieces(layout, np.arange(8), SCATTERED), pool, 1 << 20)) == LAYERS * 8


def test_per_row_path_copies_every_page():
    layout = one_group_layout()
    pool = HostBlockPool(layout, NUM_HOST, interleave=True)
    batches = plan_batches(pieces(layout, np.arange(8), CONSECUTIVE), pool, 1 << 20, coalesce=False)
    assert copies(batches) == LAYERS * 8
    assert all(n == PAGE for b in batches for n in b.nbytes.tolist())


@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("cap", [1, 3 * LAYERS * PAGE, 1 << 20])
def test_staging_bytes_stay_under_the_cap_and_every_page_is_planned_once(interleave, cap):
    layout = one_group_layout()
    pool = HostBlockPool(layout, NUM_HOST, interleave=interleave)
    device_rows = np.array([4, 0, 9, 2, 7, 5, 1, 3])
    batches = plan_batches(pieces(layout, device_rows, SCATTERED), pool, cap)
    row = LAYERS * PAGE
    assert all(b.staging_bytes <= max(cap, row) for b in batches)
    assert len(batches) == (1 if cap >= 8 * row else -(-8 // max(1, cap // row)))
    # Every (tensor, row) pair is gathered once and its staging page is copied to the
    # host page of its host row: replay the plan on byte labels.
    seen = {}
    for b in batches:
        staging_to_host = {}
        for h, s, n in zip(b.host.tolist(), b.staging.tolist(), b.nbytes.tolist()):
            for k in range(0, n, PAGE):
                staging_to_host[s + k] = h + k
        for gather in b.gathers:
            for col in gather.columns:
                for i, d in enumerate(gather.device_rows.tolist()):
                    seen[col.tensor, d] = staging_to_host[col.offset + i * col.stride]
    host_of = dict(zip(device_rows.tolist(), SCATTERED.tolist()))
    assert seen == {
        (t, d): pool.row_offset(t) + host_of[d] * pool.row_stride(t)
        for t in range(LAYERS)
        for d in device_rows.tolist()
    }


@pytest.mark.parametrize("coalesce", [True, False])
def test_copies_are_split_where_a_registration_chunk_ends(coalesce):
    layout = one_group_layout()
    row = LAYERS * PAGE  # 384 bytes: rows straddle the 4096-byte chunk ends
    pool = HostBlockPool(layout, NUM_HOST, interleave=True, register_chunk_bytes=4096)
    assert [off for off, _ in pool.register_bounds] == [0, 4096, 8192, 12288]
    (batch,) = plan_batches(pieces(layout, np.arange(12), np.arange(2, 14)), pool, 1 << 20, coalesce)
    ends = batch.host + batch.nbytes
    for h, e in zip(batch.host.tolist(), ends.tolist()):
        assert h // 4096 == (e - 1) // 4096  # inside one chunk
    if coalesce:
        assert batch.host.tolist() == [2 * row, 4096]
        assert batch.nbytes.tolist() == [4096 - 2 * row, 14 * row - 4096]
    # still every byte exactly once, staging in host order
    assert batch.nbytes.sum() == 12 * row
    assert (np.diff(batch.staging) == batch.nbytes[:-1]).all()
    assert (batch.staging - batch.host == -2 * row).all()


def test_groups_with_their_own_tensors_stage_only_their_tensors():
    caches = {f"l{i}": torch.zeros((16, 32 * (i + 1)), dtype=torch.uint8) for i in range(3)}
    layout = KVLayout.from_layer_tensors(caches, [["l0", "l1"], ["l2"]])
    pool = HostBlockPool(layout, 8, interleave=True)
    rows_0, host_0 = np.array([1, 2]), np.array([3, 4])
    rows_1, host_1 = np.array([5]), np.array([6])
    (batch,) = plan_batches([(0, rows_0, host_0), (1, rows_0, host_0), (2, rows_1, host_1)], pool, 1 << 20)
    assert batch.staging_bytes == 2 * (32 + 64) + 96
    # group 0 covers the first 96 bytes of its rows, group 1 the last 96 of row 6
    assert batch.host.tolist() == [3 * 192, 4 * 192, 6 * 192 + 96]
    assert batch.nbytes.tolist() == [96, 96, 96]
