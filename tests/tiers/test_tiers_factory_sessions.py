"""The session-control settings of the tiers from configuration: ``retention_fraction``
bounds what sessions retain in every built tier (CPU and disk), ``prefetch_in_flight`` and
``prefetch_batch`` reach the tiered manager; bad values name the setting and the value,
as TierConfig fields and as vLLM connector keys."""

from __future__ import annotations

import pytest

from kvoffload.integrations.vllm.config import parse_extra_config
from kvoffload.keys import make_offload_key
from kvoffload.sessions import SessionId
from kvoffload.tiers.factory import TierConfig, build_manager
from kvoffload.tiers.secondary import parse_secondary_tiers
from redis_server import redis_server  # noqa: F401 - fixture

BLOCK_BYTES = 4096
S = SessionId("t", "chat")


def keys(n, start=0):
    return [make_offload_key(i.to_bytes(32, "big"), 0) for i in range(start, start + n)]


def store(manager, ks):
    out = manager.prepare_store(ks)
    manager.complete_store(out.keys_to_store)


def test_the_defaults_are_the_tiers_own():
    config = parse_extra_config({"cpu_bytes_to_use": 1 << 20}, 16).tiers
    assert (config.retention_fraction, config.prefetch_in_flight, config.prefetch_batch) == (0.25, 2, 64)
    manager = build_manager(config, BLOCK_BYTES)
    assert manager.retention.budget == 256 // 4


def test_connector_keys_reach_the_tier_config():
    extra = {
        "cpu_bytes_to_use": 1 << 20,
        "retention_fraction": 0.5,
        "prefetch_in_flight": 3,
        "prefetch_batch": 8,
    }
    config = parse_extra_config(extra, 16).tiers
    assert (config.retention_fraction, config.prefetch_in_flight, config.prefetch_batch) == (0.5, 3, 8)
    assert (
        parse_extra_config({"cpu_bytes_to_use": 1, "retention_fraction": 1}, 16).tiers.retention_fraction == 1
    )


@pytest.mark.parametrize(
    "key, bad, message",
    [
        ("retention_fraction", 1.5, r"\['retention_fraction'\] must be a number in \[0, 1\], got 1.5"),
        ("retention_fraction", -0.1, r"\['retention_fraction'\] must be a number in \[0, 1\], got -0.1"),
        ("retention_fraction", True, r"\['retention_fraction'\] must be a number in \[0, 1\], got True"),
        ("retention_fraction", "0.5", r"\['retention_fraction'\] must be a number in \[0, 1\], got '0.5'"),
        ("prefetch_in_flight", 0, r"\['prefetch_in_flight'\] must be a positive int, got 0"),
        ("prefetch_in_flight", 1.5, r"\['prefetch_in_flight'\] must be a positive int, got 1.5"),
        ("prefetch_batch", -1, r"\['prefetch_batch'\] must be a positive int, got -1"),
        ("prefetch_batch", "8", r"\['prefetch_batch'\] must be a positive int, got '8'"),
    ],
)
def test_bad_connector_keys_name_the_value(key, bad, message):
    with pytest.raises(ValueError, match=r"kv_connector_extra_config" + message):
        parse_extra_config({"cpu_bytes_to_use": 1 << 20, key: bad}, 16)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(retention_fraction=2), r"retention_fraction must be a number in \[0, 1\], got 2"),
        (dict(prefetch_in_flight=0), "prefetch_in_flight must be a positive int, got 0"),
        (dict(prefetch_batch=False), "prefetch_batch must be a positive int, got False"),
    ],
)
def test_bad_tier_config_fields_name_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TierConfig(1 << 20, **kwargs)


def test_a_configured_fraction_bounds_retention_in_the_cpu_tier_alone():
    manager = build_manager(TierConfig(BLOCK_BYTES * 40, retention_fraction=0.1), BLOCK_BYTES)
    ks = keys(10)
    store(manager, ks)
    outcome = manager.retain(S, ks, until=1e12)
    assert (outcome.retained, outcome.trimmed) == (4, 6)  # 10% of 40 blocks, the tail trimmed
    assert {block.key for block in manager.retained(S)} == set(ks[:4])


def test_a_configured_fraction_bounds_retention_in_every_built_tier(tmp_path):
    tiers = parse_secondary_tiers(
        [{"type": "fs", "root_dir": str(tmp_path), "bytes_to_use": BLOCK_BYTES * 100}]
    )
    config = TierConfig(BLOCK_BYTES * 40, secondary_tiers=tiers, retention_fraction=0.1, prefetch_in_flight=3,
                        prefetch_batch=5)  # fmt: skip
    manager = build_manager(config, BLOCK_BYTES, {"model": "m"})
    try:
        assert (manager.prefetch_in_flight, manager.prefetch_batch) == (3, 5)
        disk = manager.secondaries[0]
        capacity = disk.stats().capacity  # the disk's slots, less its own headers
        assert disk.medium == "DISK" and 90 <= capacity <= 100
        assert (manager.primary.retention.budget, disk.retention.budget) == (4, capacity // 10)
        ks = keys(12)
        for tier in (manager.primary, disk):  # each tier holds the blocks
            store(tier, ks[:10] if tier is manager.primary else ks)
        outcome = manager.retain(S, ks, until=1e12)
        by_tier = {}
        for block in manager.retained(S):
            by_tier.setdefault(block.medium, set()).add(block.key)
        assert by_tier == {"CPU": set(ks[:4]), "DISK": set(ks[:9])}
        assert outcome.retained == 4 + 9 and outcome.trimmed == 6 + 3  # the tail over each budget
        assert outcome.absent == 2  # the CPU tier does not hold the last two
    finally:
        manager.close()


def test_a_zero_fraction_retains_nothing():
    manager = build_manager(TierConfig(BLOCK_BYTES * 8, retention_fraction=0), BLOCK_BYTES)
    store(manager, keys(3))
    assert manager.retain(S, keys(3), until=1e12).retained == 0


def test_a_configured_fraction_bounds_a_shared_store_tiers_retention(redis_server):  # noqa: F811
    tiers = parse_secondary_tiers(
        [{"type": "redis", "url": redis_server.url, "bytes_to_use": BLOCK_BYTES * 50, "timeout_s": 1.0}]
    )
    config = TierConfig(BLOCK_BYTES * 8, secondary_tiers=tiers, retention_fraction=0.2)
    manager = build_manager(config, BLOCK_BYTES, {"model": "m"})
    try:
        shared = manager.secondaries[0]
        assert shared.medium != "CPU"
        assert shared.retention.budget == int(shared.stats().capacity * 0.2) > 0
        assert manager.primary.retention.budget == 1  # 20% of 8 blocks
    finally:
        manager.close()
