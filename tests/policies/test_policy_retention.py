"""Retention under every registered policy: what retain, release and expiry do to eviction.

The contract (``kvoffload.manager``): eviction passes over a retained block as over a
pinned one, and once no session retains it, takes it in the policy's order. So a tier
where blocks are retained must evict exactly what a twin tier evicts where the same
blocks are pinned instead, before and after the retention ends.
"""

from __future__ import annotations

import random

import pytest

from kvoffload.cpu import CPUOffloadingManager
from kvoffload.policies import available_policies
from kvoffload.sessions import RetainOutcome, SessionId
from manual_clock import ManualClock

POLICIES = available_policies()
S1 = SessionId("t", "one")
S2 = SessionId("t", "two")


def k(i: int) -> bytes:
    return i.to_bytes(8, "big") + b"\x00\x00\x00\x01"


def keys(ids) -> list[bytes]:
    return [k(i) for i in ids]


def fill(m: CPUOffloadingManager, ids) -> list[bytes]:
    """Store ``ids`` one by one (touching each as a request would); the evictions."""
    evicted = []
    for i in ids:
        m.touch([k(i)])
        out = m.prepare_store([k(i)])
        if out is not None:
            evicted += out.evicted_keys
            m.complete_store(out.keys_to_store)
    return evicted


@pytest.mark.parametrize("policy", POLICIES)
def test_retained_blocks_survive_pressure(policy):
    clock = ManualClock(50.0)
    m = CPUOffloadingManager(16, policy, retention_fraction=0.25, clock=clock)
    fill(m, range(16))
    assert m.retain(S1, keys(range(4)), clock.now + 60).retained == 4
    evicted = fill(m, range(100, 200))
    assert evicted and not set(keys(range(4))) & set(evicted)
    assert m.lookup_prefix(keys(range(4))) == 4


@pytest.mark.parametrize("policy", POLICIES)
def test_retention_evicts_like_pinning_before_and_after_it_ends(policy):
    """Retained blocks are passed over as pinned ones are; when retention ends (expiry in
    one twin, unpinning in the other) both evict the same blocks in the same order."""
    rng = random.Random(7)
    clock = ManualClock(50.0)
    retained = CPUOffloadingManager(32, policy, retention_fraction=0.25, clock=clock)
    pinned = CPUOffloadingManager(32, policy)
    history = [rng.randrange(64) for _ in range(200)]
    kept = keys(range(3, 11))  # eight blocks: the whole budget
    for step, i in enumerate(history):
        ids = [i, (i * 7) % 64]
        for m in (retained, pinned):
            m.touch(keys(ids))
            out = m.prepare_store(keys(ids))
            if out is not None:
                m.complete_store(out.keys_to_store)
        assert retained.keys() == pinned.keys()
        if step == 40:
            present = [key for key in kept if retained.state(key) is not None]
            assert present == [key for key in kept if pinned.state(key) is not None]
            assert retained.retain(S1, present, clock.now + 10).retained == len(present)
            pinned.prepare_load(present)
    assert sorted(retained.keys()) == sorted(pinned.keys())
    clock.now += 10
    pinned.complete_load(present)
    evicted = []
    for i in range(200, 260):
        outs = [m.prepare_store([k(i)]) for m in (retained, pinned)]
        assert outs[0].evicted_keys == outs[1].evicted_keys
        evicted += outs[0].evicted_keys
        for m, out in zip((retained, pinned), outs):
            m.complete_store(out.keys_to_store)
    assert len(evicted) >= 50 and retained.retained(S1) == []


@pytest.mark.parametrize("policy", POLICIES)
def test_budget_is_trimmed_tail_first_and_counted(policy):
    clock = ManualClock(50.0)
    m = CPUOffloadingManager(16, policy, retention_fraction=0.25, clock=clock)  # 4 blocks
    fill(m, range(8))
    prefix = keys(range(8))
    assert m.retain(S1, prefix, clock.now + 5) == RetainOutcome(retained=4, trimmed=4)
    assert [block.key for block in m.retained(S1)] == prefix[:4]  # the head
    assert m.retention.counts.trimmed == 4
    evicted = fill(m, range(100, 140))
    assert not set(prefix[:4]) & set(evicted)


@pytest.mark.parametrize("policy", POLICIES)
def test_several_sessions_share_blocks_until_the_last_ends(policy):
    clock = ManualClock(50.0)
    m = CPUOffloadingManager(16, policy, retention_fraction=0.5, clock=clock)
    fill(m, range(16))
    shared, own = keys(range(2)), keys(range(2, 4))
    m.retain(S1, shared, clock.now + 5)
    m.retain(S2, shared + own, clock.now + 20)
    clock.now += 5  # S1's retention ended; S2 still holds every block
    assert not set(shared + own) & set(fill(m, range(100, 150)))
    assert m.release(S2) == 4
    fill(m, range(200, 260))
    assert not set(shared + own) & set(m.keys())


@pytest.mark.parametrize("policy", POLICIES)
def test_release_ends_retention_at_once(policy):
    clock = ManualClock(50.0)
    m = CPUOffloadingManager(8, policy, retention_fraction=0.5, clock=clock)
    fill(m, range(8))
    m.retain(S1, keys(range(4)), clock.now + 1000)
    assert m.release(S1) == 4
    fill(m, range(100, 140))
    assert not set(keys(range(4))) & set(m.keys())
