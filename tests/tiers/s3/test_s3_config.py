"""The ``"s3"`` entry of ``secondary_tiers``: every bad value is an error naming the key
and the value; parsing touches nothing (no client, no environment); the S3 client's
answers map to the tier's outcomes; object names read back to their keys."""

from __future__ import annotations

import pytest

from kvoffload.tiers.factory import TierConfig, host_row_prefix
from kvoffload.tiers.mooncake.objects import SLOT_BYTES
from kvoffload.tiers.s3.names import ObjectNames
from kvoffload.tiers.s3.store import DENIED, DOWN, EXISTS, MISSING, REJECTED, S3Settings, classify
from kvoffload.tiers.s3.tier import S3_KEYS, S3TierType
from kvoffload.tiers.secondary import parse_secondary_tiers

BASE = {"endpoint": "http://10.0.0.5:8333", "bucket": "kv-cache"}


def parse(**options):
    (tier,) = parse_secondary_tiers([{"type": "s3", **options}])
    return tier


def test_defaults_and_the_client_settings_they_give():
    tier = parse(**BASE)
    assert isinstance(tier, S3TierType)
    assert tier.settings == S3Settings("http://10.0.0.5:8333", "kv-cache")
    s = tier.settings
    assert (s.access_key_env, s.secret_key_env, s.timeout, s.connect_timeout, s.retries) == (
        "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", 5.0, 1.0, 0,
    )  # fmt: skip
    assert (tier.prefix, tier.concurrency, tier.lifetime, tier.bytes_to_use) == ("kvoffload", 8, None, None)
    other = parse(endpoint="https://s3.eu-west-1.amazonaws.com/", bucket="b.c-d", region="eu-west-1",
                  prefix="fleet/a", virtual_hosted=True, lifetime_s=86400, timeout_s=2)  # fmt: skip
    assert other.settings.endpoint == "https://s3.eu-west-1.amazonaws.com" and other.settings.virtual_hosted
    assert (other.prefix, other.lifetime, other.settings.timeout) == ("fleet/a", 86400.0, 2.0)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"bucket": "kv"}, "the s3 tier needs 'endpoint' (e.g. 'http://10.0.0.5:8333')"),
        ({"endpoint": "http://h:1"}, "the s3 tier needs 'bucket' (e.g. 'kv-cache')"),
        (
            {**BASE, "endpoint": "s3://bucket"},
            "endpoint must be an http:// or https:// URL, got 's3://bucket'",
        ),
        ({**BASE, "endpoint": "http://u:secret@h:1"}, "endpoint must not carry credentials"),
        ({**BASE, "endpoint": "http://h:1/kv"}, "endpoint must be scheme://host[:port] only"),
        ({**BASE, "endpoint": "http://h:99999"}, "endpoint has a bad port"),
        ({**BASE, "bucket": "KV_Cache"}, "bucket must be an S3 bucket name"),
        ({**BASE, "prefix": "/a//b"}, "prefix must be '/'-separated names"),
        ({**BASE, "secret_key_env": "MY SECRET"}, "secret_key_env must name an environment variable"),
        ({**BASE, "bytes_to_use": 0}, "bytes_to_use must be a positive int, got 0"),
        ({**BASE, "lifetime_s": -1}, "lifetime_s must be a positive number of seconds, got -1"),
        ({**BASE, "concurrency": 0}, "concurrency must be a positive int, got 0"),
        ({**BASE, "retries": -1}, "retries must be a non-negative int, got -1"),
        ({**BASE, "virtual_hosted": "yes"}, "virtual_hosted must be true or false"),
        ({**BASE, "url": "redis://x"}, "unknown key(s) ['url'] for the s3 tier"),
    ],
)
def test_a_bad_entry_is_an_error_naming_the_key_and_the_value(options, message):
    with pytest.raises(ValueError) as info:
        parse(**options)
    assert message in str(info.value) and str(info.value).startswith("secondary_tiers[0]: ")


def test_every_key_has_a_meaning_for_the_readme_table():
    table = S3_KEYS.markdown('`"type": "s3"` key')
    assert all(f"| `{name}` |" in table for name in S3_KEYS.names)


def test_the_host_pool_keeps_the_object_header_prefix_beside_an_object_tier():
    def prefix(*entries, f=1):
        return host_row_prefix(
            TierConfig(1 << 30, f, secondary_tiers=parse_secondary_tiers(list(entries))), 4096
        )

    assert prefix({"type": "s3", **BASE}) == SLOT_BYTES
    assert prefix({"type": "s3", **BASE}, f=2) == 0  # tensor-major pool: values are joined instead


def test_the_clients_errors_map_to_outcomes():
    from obstore import exceptions as errors

    assert classify(FileNotFoundError("x")) == MISSING
    assert classify(errors.AlreadyExistsError("x")) == EXISTS
    assert classify(errors.PermissionDeniedError("x")) == DENIED
    status = "Error performing PUT http://h/b/k in 2ms - Server returned non-2xx status code: {}: <?xml"
    assert classify(errors.GenericError(status.format("500 Internal Server Error"))) == REJECTED
    assert classify(errors.GenericError(status.format("403 Forbidden"))) == DENIED
    assert classify(errors.GenericError(status.format("404 Not Found"))) == MISSING
    assert classify(errors.GenericError("Error performing GET http://h/b in 2s - HTTP error: error sending "
                                        "request")) == DOWN  # fmt: skip


def test_object_names_are_folders_of_one_namespace_and_read_back():
    names = ObjectNames("fleet/a/", "kvr-0123")
    key = bytes(range(36))
    assert names.name(key) == "fleet/a/kvr-0123/" + key.hex() and names.folder == "fleet/a/kvr-0123"
    assert names.key_of(names.name(key)) == key
    assert (
        names.key_of("fleet/a/kvr-9999/" + key.hex()) is None and names.key_of(names.folder + "/zz") is None
    )
    assert ObjectNames("", "kvr-1").name(b"\x01") == "kvr-1/01"
    assert names.digest != ObjectNames("fleet/a", "kvr-0124").digest
