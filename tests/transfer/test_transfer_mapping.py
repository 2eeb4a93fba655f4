"""The sub-block mapping, and random multi-group jobs against a loop-by-loop oracle."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvoffload.specs import CPULoadStoreSpec, DeviceLoadStoreSpec
from kvoffload.transfer import (
    HostBlockPool,
    KVLayout,
    TransferEngine,
    host_blocks_per_group,
    map_sub_blocks,
)
from transfer_oracle import assert_state, expected_after, randomize, snapshot


def test_mapping_enters_first_host_block_part_way():
    # F=4; group 0 starts at logical block 6 (skip 2), group 1 is empty, group 2 aligned.
    mappings = map_sub_blocks([10, 11, 12, 13, 14, 20], [5, 0, 1], [6, 3, 8], [7, 2, 9], 4)
    assert mappings[0].device_rows.tolist() == [10, 11, 12, 13, 14]
    assert mappings[0].host_rows.tolist() == [7 * 4 + 2, 7 * 4 + 3, 2 * 4, 2 * 4 + 1, 2 * 4 + 2]
    assert mappings[1].device_rows.tolist() == [] and mappings[1].host_rows.tolist() == []
    assert mappings[2].host_rows.tolist() == [9 * 4]


def test_host_blocks_per_group():
    assert host_blocks_per_group(np.array([5, 0, 1, 4, 3]), np.array([6, 3, 8, 0, 3]), 4).tolist() == [
        2,
        0,
        1,
        1,
        2,
    ]
    assert host_blocks_per_group(np.array([3]), np.array([7]), 1).tolist() == [3]


def test_mapping_counts_must_match():
    with pytest.raises(ValueError, match="host spec has 1 block ids but the device spec spans 2"):
        map_sub_blocks([1, 2], [2], [3], [0], 4)


@st.composite
def jobs(draw):
    f = draw(st.sampled_from([1, 2, 4]))
    sizes = draw(st.lists(st.integers(0, 6), min_size=3, max_size=3))
    indices = draw(st.lists(st.integers(0, 40), min_size=3, max_size=3))
    spans = host_blocks_per_group(np.array(sizes), np.array(indices), f)
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    device_ids = rng.choice(24, size=sum(sizes), replace=False).tolist()
    host_ids = rng.choice(24, size=int(spans.sum()), replace=False).tolist()
    return f, sizes, indices, device_ids, host_ids, draw(st.booleans()), seed


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(jobs())
def test_random_jobs_match_oracle(job):
    f, sizes, indices, device_ids, host_ids, store, seed = job
    gen = torch.Generator().manual_seed(seed)
    # Three groups with 64-, 80- and 8-byte pages; group 1 shares tensor 0 with group 0
    # (as vLLM's overlaid groups do). Ids are distinct, so no destination is hit twice.
    tensors = [torch.empty((24, page), dtype=torch.uint8) for page in (64, 16, 8)]
    for t in tensors:
        randomize(t, gen)
    layout = KVLayout(tensors, [[0], [0, 1], [2]])
    pool = HostBlockPool(layout, 24, blocks_per_offload_block=f)
    for t in pool.tensors:
        randomize(t, gen)
    before = snapshot(layout, pool)
    device, host = DeviceLoadStoreSpec(device_ids, sizes, indices), CPULoadStoreSpec(host_ids)
    # One-row chunks for odd seeds exercise chunk boundaries.
    with TransferEngine(layout, pool, chunk_bytes=1 if seed % 2 else 1 << 20) as engine:
        engine.submit(0, *((device, host) if store else (host, device)))
        engine.wait([0])
        (result,) = engine.poll()
    assert result.success, result.error
    assert_state(
        layout, pool, expected_after(layout, pool, before, store, device_ids, sizes, indices, host_ids)
    )
