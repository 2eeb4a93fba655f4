"""The ``switch_interval_s`` key: how long kvoffload's I/O threads may wait for the GIL
while the engine's loop holds it."""

from __future__ import annotations

import pytest

from kvoffload.integrations.vllm.config import DEFAULT_SWITCH_INTERVAL_S, parse_extra_config


def interval(**extra) -> float:
    return parse_extra_config({"cpu_bytes_to_use": 1 << 20, **extra}, 16).switch_interval_s


def test_default_and_explicit_values():
    assert interval() == DEFAULT_SWITCH_INTERVAL_S
    assert interval(switch_interval_s=0) == 0
    assert interval(switch_interval_s=0.001) == 0.001


@pytest.mark.parametrize("bad", [-0.001, 1, "fast", True, None])
def test_bad_values_are_named(bad):
    with pytest.raises(ValueError, match=r"\['switch_interval_s'\] must be seconds in \[0, 0.1\], got"):
        parse_extra_config({"cpu_bytes_to_use": 1 << 20, "switch_interval_s": bad}, 16)
