"""Keys of vLLM's own OffloadingConnector in kvoffload's extra config: taken where they mean
the same, refused with a hint where they do not; and the warning for a lower tier under
vLLM's default load-failure policy."""

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")
from kvoffload.integrations.vllm.config import parse_extra_config  # noqa: E402
from kvoffload.integrations.vllm.connector import warn_failure_policy  # noqa: E402

BASE = {"cpu_bytes_to_use": 1 << 20}


def test_vllm_keys_that_mean_the_same_are_taken():
    config = parse_extra_config({**BASE, "blocks_per_chunk": 4, "self_describing_kv_events": False,
                                 "max_tracker_size": 1000, "offload_prompt_only": True}, 16)  # fmt: skip
    assert config.tiers.blocks_per_offload_block == 4
    assert config.kv_events == "placeholder"
    assert config.store_threshold_memory == 1000
    assert config.offload_prompt_only is True
    assert parse_extra_config(BASE, 16).offload_prompt_only is False  # kvoffload's default


@pytest.mark.parametrize(
    "extra, message",
    [
        (
            {"blocks_per_chunk": 4, "block_size": 32},
            r"'blocks_per_chunk'\] \(4 engine blocks: 64 tokens\) disagrees with block_size=32",
        ),
        (
            {"self_describing_kv_events": True, "kv_events": "placeholder"},
            "disagrees with kv_events='placeholder'",
        ),
        ({"offload_prompt_only": "yes"}, r"'offload_prompt_only'\] must be true or false, got 'yes'"),
        (
            {"spec_name": "CPUOffloadingSpec"},
            r"'spec_name'\] is vLLM's OffloadingConnector's: kvoffload builds",
        ),
        ({"cache_policy_module_path": "m"}, "give the policy as eviction_policy='package.module:ClassName'"),
        ({"canonical_layout": True}, "engine's own page layout"),
    ],
)
def test_keys_that_do_not_fit_are_named_with_a_hint(extra, message):
    with pytest.raises(ValueError, match=message):
        parse_extra_config({**BASE, **extra}, 16)


def test_a_lower_tier_under_the_fail_policy_is_warned_about(tmp_path, caplog):
    tiers = {**BASE, "secondary_tiers": [{"type": "fs", "root_dir": str(tmp_path), "bytes_to_use": 1 << 30}]}
    with caplog.at_level("WARNING", logger="kvoffload.integrations.vllm.connector"):
        assert warn_failure_policy(
            parse_extra_config(tiers, 16), SimpleNamespace(kv_load_failure_policy="fail")
        )
        assert not warn_failure_policy(
            parse_extra_config(tiers, 16), SimpleNamespace(kv_load_failure_policy="recompute")
        )
        assert not warn_failure_policy(
            parse_extra_config(BASE, 16), SimpleNamespace(kv_load_failure_policy="fail")
        )
    assert caplog.text.count("kv_load_failure_policy='recompute'") == 1


def test_kv_offloading_size_replacing_the_connector_is_said_plainly(tiny_llama):
    """vLLM's kv_offloading_size swaps the connector's name for its own and keeps our
    module path: the lookup vLLM's factory does says what happened."""
    from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from kvoffload.demo.offline import kv_transfer_config

    transfer = KVTransferConfig(**kv_transfer_config(dict(BASE)))
    assert KVConnectorFactory.get_connector_class(transfer).__name__ == "KVOffloadConnector"
    # vLLM looks the connector up while it builds its config: the user sees this at start
    with pytest.raises(ValueError, match="--kv-offloading-size .* replaced KVOffloadConnector"):
        VllmConfig(
            model_config=ModelConfig(model=tiny_llama),
            cache_config=CacheConfig(kv_offloading_size=1.0),
            kv_transfer_config=transfer,
        )
