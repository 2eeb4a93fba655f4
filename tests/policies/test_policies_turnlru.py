"""Turn-aware LRU: final blocks go first, returning conversations outlive newer one-shots."""

from __future__ import annotations

import pytest

from kvoffload.cpu import CPUOffloadingManager
from kvoffload.keys import make_offload_key
from kvoffload.manager import LookupResult
from kvoffload.policies import TurnLRUPolicy, resolve_policy


def k(name: str) -> bytes:
    return make_offload_key(name.encode().ljust(8, b"_"), 0)


def serve(manager: CPUOffloadingManager, names: list[str]) -> int:
    """One request with the replay protocol; returns its hit-prefix length."""
    keys = [k(name) for name in names]
    hit = manager.lookup_prefix(keys)
    manager.touch(keys)
    if hit:
        manager.prepare_load(keys[:hit])
        manager.complete_load(keys[:hit])
    out = manager.prepare_store(keys[hit:])
    assert out is not None
    manager.complete_store(out.keys_to_store)
    return hit


def loadable(manager: CPUOffloadingManager, name: str) -> bool:
    return manager.lookup(k(name)) is LookupResult.HIT


def test_registered():
    assert resolve_policy("turnlru") is TurnLRUPolicy


def test_final_block_of_a_request_is_evicted_first():
    m = CPUOffloadingManager(4, "turnlru")
    serve(m, ["x1", "x2", "xF"])
    serve(m, ["y1", "yF"])  # one eviction: LRU would take x1, the oldest
    assert not loadable(m, "xF")
    assert all(loadable(m, n) for n in ("x1", "x2", "y1", "yF"))


def run_returning_scenario(policy: str) -> CPUOffloadingManager:
    m = CPUOffloadingManager(12, policy)
    serve(m, ["P", "a1", "a2", "aF"])
    serve(m, ["b1", "b2", "bF"])
    assert serve(m, ["P", "a1", "a2", "a3", "aG"]) == 3  # conversation a comes back
    for name in "cdef":
        serve(m, [f"{name}1", f"{name}2", f"{name}F"])  # newer one-shot requests
    return m


def test_returning_conversation_outlives_newer_one_shot_blocks():
    m = run_returning_scenario("turnlru")
    assert m.policy.turn_gap == 2  # measured: a came back two requests later
    assert all(loadable(m, n) for n in ("P", "a1", "a2", "a3"))
    assert not loadable(m, "c1") and not loadable(m, "b1")
    # Plain LRU on the same requests drops the returning conversation instead.
    lru = run_returning_scenario("lru")
    assert not loadable(lru, "a1") and loadable(lru, "c1")


def test_evicted_conversation_still_counts_as_returning():
    m = CPUOffloadingManager(5, "turnlru")
    serve(m, ["P", "a1", "a2", "aF"])
    for name in "bc":
        serve(m, [f"{name}1", f"{name}2", f"{name}F"])  # evicts all of a
    assert not any(loadable(m, n) for n in ("P", "a1", "a2"))
    assert m.policy.turn_gap is None
    assert serve(m, ["P", "a1", "a2", "a3", "aG"]) == 0
    assert m.policy.turn_gap == 3  # remembered in the ghost list: a is back after 3 requests


@pytest.mark.parametrize(
    "bad", [{"levels": 0}, {"gap_weight": 0.0}, {"gap_weight": 2.0}, {"ghost_factor": -1}]
)
def test_bad_configuration_is_rejected(bad):
    with pytest.raises(ValueError):
        TurnLRUPolicy(8, **bad)
