"""The control endpoint's keys in kv_connector_extra_config: defaults and clear errors."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from kvoffload.integrations.vllm.config import parse_extra_config  # noqa: E402


def parse(**keys):
    return parse_extra_config({"cpu_bytes_to_use": 1 << 20, **keys}, 16)


def test_off_by_default_and_on_loopback_when_on():
    config = parse()
    assert config.control_port is None
    assert (config.control_host, config.control_token, config.control_timeout_s) == ("127.0.0.1", None, 5.0)
    config = parse(control_port=8100, control_host="0.0.0.0", control_token="t", control_timeout_s=1)
    assert (config.control_port, config.control_host, config.control_token) == (8100, "0.0.0.0", "t")
    assert config.control_timeout_s == 1.0


@pytest.mark.parametrize(
    ("key", "value", "named"),
    [
        ("control_port", -1, "-1"),
        ("control_port", 70000, "70000"),
        ("control_port", True, "True"),
        ("control_port", "8100", "'8100'"),
        ("control_host", "", "''"),
        ("control_token", 123, "123"),
        ("control_token", "", "''"),
        ("control_timeout_s", 0, "0"),
        ("control_timeout_s", 601, "601"),
        ("control_tenant_tokens", ["t"], r"\['t'\]"),
    ],
)
def test_bad_values_are_named(key, value, named):
    with pytest.raises(ValueError, match=rf"kv_connector_extra_config\['{key}'\] must .*got {named}"):
        parse(**{key: value})


def test_tenant_tokens():
    config = parse(control_token="op", control_tenant_tokens={"a": "ta", "": "tn"})
    assert config.control_tenant_tokens == {"a": "ta", "": "tn"} and parse().control_tenant_tokens is None
    for tokens, named in [
        ({"a": ""}, r"\['a'\] must be a non-empty string token, got ''"),
        ({"a": 5}, r"\['a'\] must be a non-empty string token, got 5"),
        ({1: "t"}, "a tenant must be a string .*got 1"),
        ({"a": "op"}, "given to the operator and 'a'"),
        ({"a": "t", "b": "t"}, "given to 'a' and 'b'"),
    ]:
        key = r"kv_connector_extra_config\['control_tenant_tokens'\]"
        with pytest.raises(ValueError, match=rf"{key}.*{named}"):
            parse(control_token="op", control_tenant_tokens=tokens)
