"""A host pool with a row prefix (``row_prefix_bytes``): the views start after each block's
prefix, every copier and planner moves payload bytes only (a prefix is never read into the
device nor written), and a block's payload is still one byte range (``HostRows``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvoffload.specs import CPULoadStoreSpec, DeviceLoadStoreSpec
from kvoffload.tiers.host_rows import HostRows
from kvoffload.transfer import HostBlockPool, KVLayout, TransferEngine, native
from kvoffload.transfer.cpu_executor import CPUExecutor
from kvoffload.transfer.staging_plan import plan_batches
from transfer_oracle import assert_state, expected_after, randomize, snapshot, three_group_layer_caches

PREFIX, NUM_DEVICE, NUM_HOST = 128, 24, 12
SENTINEL = 0xA5


def prefixed(layout: KVLayout, num_host: int = NUM_HOST, prefix: int = PREFIX) -> HostBlockPool:
    pool = HostBlockPool(layout, num_host, row_prefix_bytes=prefix)
    pool.region.fill_(SENTINEL)
    return pool


def prefix_bytes(pool: HostBlockPool) -> torch.Tensor:
    """Every block's prefix, as rows."""
    rows = pool.region.view(pool.num_blocks, pool.block_stride)
    return rows[:, : pool.row_prefix_bytes]


def three_groups(seed: int = 0) -> KVLayout:
    caches, groups = three_group_layer_caches(NUM_DEVICE, torch.Generator().manual_seed(seed))
    return KVLayout.from_layer_tensors(caches, groups)


def test_views_start_after_each_prefix_and_tile_the_payloads():
    layout = three_groups()
    pool = prefixed(layout)
    pages = [layout.page_bytes(t) for t in range(len(layout.tensors))]
    assert pool.block_bytes == sum(pages) and pool.block_stride == PREFIX + sum(pages)
    assert pool.nbytes == pool.region.numel() == NUM_HOST * (PREFIX + sum(pages))
    assert [pool.row_offset(t) for t in range(len(pages))] == [
        PREFIX + sum(pages[:t]) for t in range(len(pages))
    ]
    assert {pool.row_stride(t) for t in range(len(pages))} == {pool.block_stride}
    base = pool.region.data_ptr()
    for t in range(len(pages)):
        assert pool.tensors[t][5].data_ptr() == base + 5 * pool.block_stride + pool.row_offset(t)
    pool.region.zero_()
    for t in range(len(pages)):  # every view's byte once: payloads all 1, prefixes all 0
        pool.sub_blocks(t).add_(1)
    rows = pool.region.view(NUM_HOST, pool.block_stride)
    assert torch.all(rows[:, :PREFIX] == 0) and torch.all(rows[:, PREFIX:] == 1)


def test_a_prefix_needs_an_interleaved_pool_and_a_non_negative_size():
    layout = three_groups()
    with pytest.raises(ValueError, match="row_prefix_bytes=64 needs an interleaved host pool"):
        HostBlockPool(layout, 4, 2, row_prefix_bytes=64)
    with pytest.raises(ValueError, match="row_prefix_bytes=64 needs an interleaved host pool"):
        HostBlockPool(layout, 4, interleave=False, row_prefix_bytes=64)
    with pytest.raises(ValueError, match="row_prefix_bytes must be a non-negative int, got -1"):
        HostBlockPool(layout, 4, row_prefix_bytes=-1)
    assert HostBlockPool(layout, 4).row_prefix_bytes == 0  # the default layout is unchanged


def test_host_rows_give_a_block_as_one_view_of_its_payload():
    layout = three_groups()
    pool = prefixed(layout)
    randomize(pool.region, torch.Generator().manual_seed(3))
    rows = HostRows(pool)
    assert rows.block_bytes == pool.block_bytes and len(rows.segments) == 1
    for b in (0, 7, NUM_HOST - 1):
        (view,) = rows.block(b)
        start = b * pool.block_stride + PREFIX
        assert bytes(view) == pool.region[start : start + pool.block_bytes].numpy().tobytes()
    assert not rows.aligned(4096)  # a 128-byte prefix: payloads are not page-aligned
    page_layout = KVLayout.from_layer_tensors({"l": torch.zeros((4, 4096), dtype=torch.uint8)})
    assert HostRows(HostBlockPool(page_layout, 3, row_prefix_bytes=4096)).aligned(4096)


def test_staging_plans_copy_payloads_only_one_range_per_block():
    """Consecutive host ids are no longer one byte range: the device planner copies each
    block's payload alone, never a prefix byte, every page where the views say."""
    page, layers = 64, 6
    layout = KVLayout.from_layer_tensors(
        {f"l{i}": torch.zeros((48, page), dtype=torch.uint8) for i in range(layers)}
    )
    pool = prefixed(layout, 40)
    device, host = np.array([4, 0, 9, 2, 7, 5, 1, 3]), np.array([10, 11, 12, 13, 30, 7, 21, 22])
    (batch,) = plan_batches([(t, device, host) for t in range(layers)], pool, 1 << 20)
    assert batch.num_copies == 8
    assert set(batch.nbytes.tolist()) == {pool.block_bytes}
    staging_to_host = {}
    for h, s, n in zip(batch.host.tolist(), batch.staging.tolist(), batch.nbytes.tolist()):
        assert h % pool.block_stride == PREFIX  # a whole payload, from its first byte
        for k in range(0, n, page):
            staging_to_host[s + k] = h + k
    seen = {}
    for gather in batch.gathers:
        for col in gather.columns:
            for i, d in enumerate(gather.device_rows.tolist()):
                seen[col.tensor, d] = staging_to_host[col.offset + i * col.stride]
    host_of = dict(zip(device.tolist(), host.tolist()))
    assert seen == {
        (t, d): pool.row_offset(t) + host_of[d] * pool.row_stride(t)
        for t in range(layers)
        for d in device.tolist()
    }


COPIERS = [
    pytest.param(True, id="native", marks=pytest.mark.skipif(not native.AVAILABLE, reason="no _rowcopy")),
    pytest.param(False, id="numpy"),
]


@pytest.mark.parametrize("native_copies", COPIERS)
@pytest.mark.parametrize("layout_kind", ["three groups", "one tensor"])
def test_cpu_jobs_move_payloads_byte_exact_and_never_touch_a_prefix(native_copies, layout_kind):
    """Stores and loads of consecutive and scattered host ids on a prefixed pool (rows of
    one tensor are then a stride apart that is not their width): the oracle's bytes,
    and every prefix byte as it was."""
    gen = torch.Generator().manual_seed(1)
    if layout_kind == "one tensor":
        raw = torch.empty((NUM_DEVICE, 4096), dtype=torch.uint8)
        randomize(raw, gen)
        layout, sizes, indices = KVLayout.from_layer_tensors({"l": raw}), [8], [0]
    else:
        layout, sizes, indices = three_groups(1), [3, 2, 3, 0], [0, 0, 0, 0]
    pool = prefixed(layout)
    for t in pool.tensors:
        randomize(t, gen)
    executor = CPUExecutor(layout, pool, 1 << 20, native_copies=native_copies)
    job = 0
    with TransferEngine(layout, pool, executor=executor) as engine:
        for store in (True, False):
            for host_ids in ([2, 3, 4, 5, 6, 7, 8, 9], [11, 0, 6, 3, 9, 1, 4, 7]):
                device_ids = list(range(job, job + sum(sizes)))
                job += 1
                before = snapshot(layout, pool)
                dev, host = (
                    DeviceLoadStoreSpec(device_ids, sizes, indices),
                    CPULoadStoreSpec(host_ids[: sum(sizes)]),
                )
                engine.submit(job, *((dev, host) if store else (host, dev)))
                engine.wait([job])
                (result,) = engine.poll()
                assert result.success, result.error
                want = expected_after(layout, pool, before, store, device_ids, sizes, indices, host_ids)
                assert_state(layout, pool, want)
                assert torch.all(prefix_bytes(pool) == SENTINEL)
