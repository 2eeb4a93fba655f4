"""The ``"mooncake"`` entry of ``secondary_tiers``: every bad value is an error naming the
key and the value; parsing touches nothing (no client, no process)."""

from __future__ import annotations

import pytest

from kvoffload.tiers.factory import TierConfig, host_row_prefix
from kvoffload.tiers.mooncake.objects import SLOT_BYTES
from kvoffload.tiers.mooncake.tier import MOONCAKE_KEYS, MooncakeTierType
from kvoffload.tiers.secondary import parse_secondary_tiers


def parse(**options):
    (tier,) = parse_secondary_tiers([{"type": "mooncake", **options}])
    return tier


def test_defaults_and_the_client_settings_they_give():
    tier = parse(master="10.0.0.5:50051")
    assert isinstance(tier, MooncakeTierType)
    client = tier.client
    assert (client.master, client.metadata_server, client.protocol, client.segment_bytes) == (
        "10.0.0.5:50051", "P2PHANDSHAKE", "tcp", 0,
    )  # fmt: skip
    http = parse(
        master="h:1", metadata="http", metadata_server="http://h:8080/metadata", segment_bytes=1 << 30
    )
    assert http.client.metadata_server == "http://h:8080/metadata" and http.client.segment_bytes == 1 << 30
    assert parse(master="h:1", protocol="rdma", rdma_devices="mlx5_0").client.rdma_devices == "mlx5_0"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({}, "the mooncake tier needs 'master' (e.g. '10.0.0.5:50051')"),
        ({"master": "10.0.0.5"}, "master must be 'host:port' with a port in [1, 65535], got '10.0.0.5'"),
        ({"master": "h:70000"}, "master must be 'host:port' with a port in [1, 65535], got 'h:70000'"),
        ({"master": "h:1", "metadata": "etcd"}, "metadata must be one of ['p2p', 'http'], got 'etcd'"),
        ({"master": "h:1", "metadata": "http"}, "metadata='http' but no 'metadata_server' URL"),
        ({"master": "h:1", "metadata_server": "http://h:1/metadata"}, "metadata='p2p' uses none"),
        (
            {"master": "h:1", "metadata": "http", "metadata_server": "h:1"},
            "metadata_server must be an http:// URL",
        ),
        ({"master": "h:1", "protocol": "udp"}, "protocol must be one of ['tcp', 'rdma'], got 'udp'"),
        ({"master": "h:1", "segment_bytes": -1}, "segment_bytes must be a non-negative int, got -1"),
        ({"master": "h:1", "bytes_to_use": 0}, "bytes_to_use must be a positive int, got 0"),
        ({"master": "h:1", "namespace": "a:b"}, "namespace must be a non-empty name without spaces or ':'"),
        (
            {"master": "h:1", "probe_timeout_s": 0},
            "probe_timeout_s must be a positive number of seconds, got 0",
        ),
        ({"master": "h:1", "io_threads": True}, "io_threads must be a positive int, got True"),
        ({"master": "h:1", "url": "redis://x"}, "unknown key(s) ['url'] for the mooncake tier"),
    ],
)
def test_a_bad_entry_is_an_error_naming_the_key_and_the_value(options, message):
    with pytest.raises(ValueError) as info:
        parse(**options)
    assert message in str(info.value) and str(info.value).startswith("secondary_tiers[0]: ")


def test_every_key_has_a_meaning_for_the_readme_table():
    table = MOONCAKE_KEYS.markdown('`"type": "mooncake"` key')
    assert all(f"| `{name}` |" in table for name in MOONCAKE_KEYS.names)


def test_the_host_pool_keeps_a_header_prefix_only_beside_a_mooncake_tier():
    """``factory.host_row_prefix``: 0 without a Mooncake tier (the default layout) and for
    tensor-major pools; the object header's slot with one; a whole 4 KiB page when a disk
    tier reads with O_DIRECT and blocks are whole pages (its reads stay aligned)."""
    mooncake = {"type": "mooncake", "master": "h:1"}
    disk = {"type": "fs", "root_dir": "/nonexistent", "bytes_to_use": 1 << 30}

    def prefix(*entries, f=1, block=1 << 16):
        return host_row_prefix(
            TierConfig(1 << 30, f, secondary_tiers=parse_secondary_tiers(list(entries))), block
        )

    assert prefix() == 0 and prefix(disk) == 0
    assert prefix(mooncake) == SLOT_BYTES == 128
    assert prefix(mooncake, f=4) == 0
    assert prefix(mooncake, disk) == prefix(disk, mooncake) == 4096
    assert prefix(mooncake, {**disk, "direct_reads": False}) == SLOT_BYTES
    assert prefix(mooncake, disk, block=(1 << 16) + 64) == SLOT_BYTES  # unaligned anyway: no page spent
