"""A refused ``prepare_store`` changes nothing, on every tier and with every policy, also
when the keys the call names leave too few evictable blocks: capacity 4 holding idle
a-d, ``prepare_store([a, e, f, g, h])`` needs four evictions while a is protected by the
call, so it returns ``None``; a-d all still hit, and the next store evicts exactly what
it would have evicted without the refused call."""

from __future__ import annotations

import pytest

from kvoffload.cpu import CPUOffloadingManager
from kvoffload.keys import make_offload_key
from kvoffload.manager import LookupResult
from kvoffload.policies import available_policies
from kvoffload.tiers.fs.format import Geometry
from kvoffload.tiers.fs.manager import FSOffloadingManager

BLOCK = 4096


def k(name: str) -> bytes:
    return make_offload_key(name.encode().ljust(32, b"."), 0)


def cpu(tmp_path, policy, name):
    return CPUOffloadingManager(4, policy)


def disk(tmp_path, policy, name):
    return FSOffloadingManager(tmp_path, name, BLOCK, 4 * Geometry(BLOCK).stored_block_bytes, policy)


def filled(make, tmp_path, policy, name):
    m = make(tmp_path, policy, name)
    out = m.prepare_store([k(c) for c in "abcd"])
    m.complete_store(out.keys_to_store)
    m.touch([k("c"), k("a")])  # some order of use beyond insertion
    return m


@pytest.mark.parametrize("policy", available_policies())
@pytest.mark.parametrize("make", [cpu, disk], ids=["cpu", "disk"])
def test_a_refused_store_changes_nothing(tmp_path, make, policy):
    refused = filled(make, tmp_path, policy, "refused")
    control = filled(make, tmp_path, policy, "control")
    assert refused.prepare_store([k(c) for c in "aefgh"]) is None
    assert refused.stats() == control.stats() and refused.take_events() == control.take_events()
    assert [refused.lookup(k(c)) for c in "abcd"] == [LookupResult.HIT] * 4
    # the same next step: the same victims (or the same refusal)
    [control.lookup(k(c)) for c in "abcd"]
    after, expected = refused.prepare_store([k("x")]), control.prepare_store([k("x")])
    assert (after is None) == (expected is None)
    if after is not None:
        assert after.evicted_keys == expected.evicted_keys
        assert after.store_spec.block_ids.tolist() == expected.store_spec.block_ids.tolist()
