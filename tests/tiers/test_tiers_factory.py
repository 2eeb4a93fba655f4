"""Tiers from configuration: both halves agree on the host block count; bad settings
raise errors naming the setting and the value."""

from __future__ import annotations

import pytest
import torch

from kvoffload.cpu import CPUOffloadingManager
from kvoffload.keys import make_offload_key
from kvoffload.policies import ARCPolicy
from kvoffload.specs import CPULoadStoreSpec, DeviceLoadStoreSpec
from kvoffload.tiers.factory import TierConfig, build_manager, build_worker
from kvoffload.transfer import KVLayout
from kvoffload.worker import WorkerRouter
from transfer_oracle import three_group_layer_caches


def test_manager_and_worker_hold_the_same_number_of_blocks():
    gen = torch.Generator().manual_seed(0)
    caches, groups = three_group_layer_caches(8, gen)
    layout = KVLayout.from_layer_tensors(caches, groups)
    block_bytes = sum(layout.page_bytes(t) for t in range(len(layout.tensors))) * 2
    config = TierConfig(
        cpu_bytes_to_use=block_bytes * 5 + block_bytes // 2, blocks_per_offload_block=2, eviction_policy="arc"
    )
    manager = build_manager(config, block_bytes)
    assert isinstance(manager, CPUOffloadingManager) and isinstance(manager.policy, ARCPolicy)
    assert manager.stats().capacity == 5
    with build_worker(config, layout, block_bytes) as worker:
        assert isinstance(worker, WorkerRouter)
        engine = worker.worker_for(("GPU", "CPU"))
        assert engine.host_pool.num_blocks == 5 and engine.host_pool.blocks_per_offload_block == 2
        # the last slot the manager can hand out is a block the worker can write
        keys = [make_offload_key(bytes([i]) * 32, 0) for i in range(5)]
        out = manager.prepare_store(keys)
        last = int(out.store_spec.block_ids[-1])
        assert last == 4
        worker.submit(0, DeviceLoadStoreSpec([6, 7], [2, 0, 0, 0], [0] * 4), CPULoadStoreSpec([last]))
        worker.wait([0])
        assert [(r.job_id, r.success) for r in worker.poll()] == [(0, True)]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(cpu_bytes_to_use=0), "cpu_bytes_to_use must be a positive int, got 0"),
        (dict(cpu_bytes_to_use=True), "cpu_bytes_to_use must be a positive int, got True"),
        (
            dict(cpu_bytes_to_use=1, blocks_per_offload_block=0),
            "blocks_per_offload_block must be a positive int, got 0",
        ),
        (dict(cpu_bytes_to_use=1, eviction_policy="nope"), "eviction_policy: unknown eviction policy 'nope'"),
    ],
)
def test_bad_settings_name_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TierConfig(**kwargs)


def test_a_budget_below_one_block_names_both_sizes():
    with pytest.raises(ValueError, match=r"cpu_bytes_to_use=100 holds no offloaded block \(101 bytes each\)"):
        build_manager(TierConfig(cpu_bytes_to_use=100), 101)


def test_secondary_tiers_build_a_tiered_manager_and_a_routed_worker():
    from kvoffload.tiers.secondary import parse_secondary_tiers
    from kvoffload.tiers.tiered import TieredOffloadingManager
    from shelf_tier import ShelfTierType

    gen = torch.Generator().manual_seed(0)
    caches, groups = three_group_layer_caches(8, gen)
    layout = KVLayout.from_layer_tensors(caches, groups)
    block_bytes = sum(layout.page_bytes(t) for t in range(len(layout.tensors)))
    tiers = parse_secondary_tiers([{"type": "shelf_tier:ShelfTierType", "blocks": 7}])
    config = TierConfig(cpu_bytes_to_use=block_bytes * 3, secondary_tiers=tiers)
    manager = build_manager(config, block_bytes, {"model": "m"})
    assert isinstance(manager, TieredOffloadingManager)
    assert [s.capacity for s in manager.tier_stats()] == [3, 7]
    with build_worker(config, layout, block_bytes, {"model": "m"}) as worker:
        assert worker.routes == {("GPU", "CPU"), ("CPU", "GPU"), ("CPU", "SHELF"), ("SHELF", "CPU")}
        assert worker.worker_for(("CPU", "SHELF")) is ShelfTierType.last_worker


@pytest.mark.parametrize(
    "entries, message",
    [
        ({"type": "fs"}, r"secondary_tiers must be a list of tier settings, got \{'type': 'fs'\}"),
        ([["fs"]], r"secondary_tiers\[0\] must be a dict with a 'type', got \['fs'\]"),
        ([{"root_dir": "/x"}], r"secondary_tiers\[0\] has no 'type'"),
        ([{"type": "tape"}], r"secondary_tiers\[0\]: unknown secondary tier type 'tape'; known: fs"),
        ([{"type": "no_such_module:Tier"}], r"secondary_tiers\[0\]: cannot import secondary tier type"),
        ([{"type": "kvoffload.cpu:CPUOffloadingManager"}], "is not a SecondaryTierType subclass"),
        (
            [{"type": "shelf_tier:ShelfTierType", "blocks": 0}],
            r"secondary_tiers\[0\]: blocks must be a positive",
        ),
        (
            [{"type": "shelf_tier:ShelfTierType", "blocks": 2, "x": 1}],
            r"secondary_tiers\[0\]: unknown key\(s\) \['x'\]",
        ),
    ],
)
def test_bad_secondary_tiers_name_the_entry_key_and_value(entries, message):
    from kvoffload.tiers.secondary import parse_secondary_tiers

    with pytest.raises(ValueError, match=message):
        parse_secondary_tiers(entries)
