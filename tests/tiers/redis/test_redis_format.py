"""The shared tier's pieces that need no server: values and their checks, key names,
URLs and credentials, the circuit breaker, the tier's configuration errors."""

from __future__ import annotations

import logging

import pytest

from kvoffload.keys import make_offload_key
from kvoffload.tiers.redis.breaker import CircuitBreaker
from kvoffload.tiers.redis.client import ServerSettings, check_url, redact
from kvoffload.tiers.redis.format import (
    CRC_AT,
    HEADER_BYTES,
    CorruptValue,
    KeyNames,
    check_head,
    decode,
    encode,
    head,
    head_template,
    redis_namespace,
)
from kvoffload.tiers.secondary import parse_secondary_tiers
from manual_clock import ManualClock

KEY = make_offload_key(b"\x07" * 32, 1)
NAMES = KeyNames("kvoffload", "kvr-test")
PAYLOAD = [bytes(range(256)) * 4, b"\xaa" * 512]


def test_a_value_round_trips_and_every_check_catches_its_fault():
    value = encode(KEY, PAYLOAD, NAMES.digest)
    assert bytes(decode(value, KEY, NAMES.digest, 1536)) == b"".join(PAYLOAD)
    flipped = bytearray(value)
    flipped[-1] ^= 1
    other_key = make_offload_key(b"\x08" * 32, 1)
    faults = {
        "CRC32C": (bytes(flipped), KEY, NAMES.digest, 1536),
        "another key": (value, other_key, NAMES.digest, 1536),
        "digest": (value, KEY, KeyNames("kvoffload", "kvr-other").digest, 1536),
        "payload of": (value[:-10], KEY, NAMES.digest, 1536),
        "shorter than the header": (value[: HEADER_BYTES - 1], KEY, NAMES.digest, 1536),
        "magic": (b"XXXX" + value[4:], KEY, NAMES.digest, 1536),
    }
    for words, args in faults.items():
        with pytest.raises(CorruptValue, match=words):
            decode(*args)


def test_the_head_template_is_the_head_but_for_its_crc():
    """A reader compares a value's head with the template either side of the CRC field: the
    template must be the writer's head exactly there, and differ from it only in the CRC."""
    real = head(KEY, PAYLOAD, NAMES.digest)
    template = head_template(KEY, 1536, NAMES.digest)
    assert len(template) == len(real) == HEADER_BYTES + len(KEY)
    assert template[:CRC_AT] == real[:CRC_AT] and template[CRC_AT + 4 :] == real[CRC_AT + 4 :]
    assert int.from_bytes(real[CRC_AT : CRC_AT + 4], "big") == check_head(
        real, KEY, NAMES.digest, 1536, len(real) + 1536
    )
    assert template[CRC_AT : CRC_AT + 4] == bytes(4)
    assert head_template(KEY, 1535, NAMES.digest) != template  # the payload length is in it


def test_key_names_invert_and_namespaces_follow_the_identity():
    name = NAMES.name(KEY)
    assert name.startswith(b"kvoffload:kvr-test:") and NAMES.key_of(name) == KEY
    assert NAMES.key_of(b"kvoffload:kvr-other:" + KEY.hex().encode()) is None
    assert NAMES.key_of(b"kvoffload:kvr-test:zz") is None
    base = {"model": "m", "dtype": "bf16", "block_size": 16, "rank": 0}
    assert redis_namespace(base) == redis_namespace(dict(reversed(base.items())))
    assert redis_namespace(base) != redis_namespace({**base, "dtype": "fp8"})
    assert redis_namespace(base) != redis_namespace({**base, "rank": 1})


def test_urls_are_checked_and_never_shown_with_their_password(monkeypatch):
    assert redact("redis://user:s3cret@host:6379/0") == "redis://user:***@host:6379/0"
    assert "s3cret" not in redact("rediss://:s3cret@host/0")
    for bad, words in [
        ("http://host:6379", "must start with"),
        ("redis://:s3cret@", "names no host"),
        ("unix://", "no socket path"),
        ("redis://host:99999", "not a valid URL"),
        (42, "must be a redis"),
    ]:
        with pytest.raises(ValueError, match=words) as info:
            check_url(bad)
        assert "s3cret" not in str(info.value)
    monkeypatch.delenv("KVO_TEST_PW", raising=False)
    with pytest.raises(ValueError, match="KVO_TEST_PW"):
        ServerSettings("redis://h:1/0", password_env="KVO_TEST_PW").password()
    monkeypatch.setenv("KVO_TEST_PW", "pw")
    assert ServerSettings("redis://h:1/0", password_env="KVO_TEST_PW").password() == "pw"


def test_bad_tier_settings_name_the_key_and_value():
    cases = [
        ({}, "needs 'url'"),
        ({"url": "redis://127.0.0.1:1/0", "colour": 1}, "colour"),
        ({"url": "redis://127.0.0.1:1/0", "cluster": "yes"}, "cluster must be true or false, got 'yes'"),
        ({"url": "redis://127.0.0.1:1/0", "bytes_to_use": 0}, "bytes_to_use"),
        ({"url": "redis://127.0.0.1:1/0", "timeout_s": -1}, "timeout_s must be a positive number"),
        ({"url": "redis://127.0.0.1:1/0", "namespace": "a:b"}, "namespace must be a non-empty name"),
        # an unset variable is read (and refused) when the tier is built: test_config_schema.py
        ({"url": "redis://127.0.0.1:1/0", "password_env": ""}, "password_env must name an environment"),
        ({"url": "ftp://x"}, "must start with"),
    ]
    for options, words in cases:
        with pytest.raises(ValueError, match=words) as info:
            parse_secondary_tiers([{"type": "redis", **options}])
        assert "secondary_tiers[0]" in str(info.value)
    entry = {"type": "redis", "url": "redis://127.0.0.1:1/0", "bytes_to_use": 10**6}
    (tier,) = parse_secondary_tiers([entry])
    assert tier.bytes_to_use == 10**6 and tier.server.cluster is False


def test_breaker_opens_backs_off_to_a_cap_and_closes_by_itself(caplog):
    clock = ManualClock(0.0)
    breaker = CircuitBreaker("t", base_delay=1.0, max_delay=4.0, clock=clock)
    assert breaker.allow()
    with caplog.at_level(logging.WARNING, "kvoffload.tiers.redis"):
        breaker.failure("refused")
        assert breaker.is_open and not breaker.allow()
        delays = []
        for _ in range(4):  # half-open probes that fail: 2, 4, 4, 4
            start = clock.now
            while not breaker.allow():
                clock.now += 0.5
            delays.append(clock.now - start)
            assert not breaker.allow()  # one probe at a time
            breaker.failure("refused")
        assert delays == [1.0, 2.0, 4.0, 4.0]
        clock.now += 4.0
        assert breaker.allow()
        breaker.success()
        assert not breaker.is_open and breaker.allow()
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2, messages  # one outage, one recovery: not one per failure
    assert "unavailable" in messages[0] and "answers again" in messages[1]
    assert (breaker.outages, breaker.recoveries) == (1, 1)
