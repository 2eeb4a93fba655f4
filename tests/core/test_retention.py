"""Session retention in the CPU tier: what retain, release and expiry do to eviction.

The clock is a fake one the tests move, so deadlines need no sleeps.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvoffload.cpu import CPUOffloadingManager
from kvoffload.manager import LookupResult
from kvoffload.retention import RetentionIndex
from kvoffload.sessions import RetainedBlock, RetainOutcome, SessionId
from manual_clock import ManualClock

A = SessionId("tenant-a", "chat")
B = SessionId("tenant-b", "chat")  # same name, other tenant
A2 = SessionId("tenant-a", "other")


def k(i: int) -> bytes:
    return i.to_bytes(8, "big") + b"\x00\x00\x00\x00"


def keys(*ids: int) -> list[bytes]:
    return [k(i) for i in ids]


def store(m: CPUOffloadingManager, *ids: int):
    out = m.prepare_store(keys(*ids))
    assert out is not None
    m.complete_store(out.keys_to_store)
    return out


def manager(n: int = 8, fraction: float = 0.5, policy: str = "lru"):
    clock = ManualClock(1000.0)
    return CPUOffloadingManager(n, policy, retention_fraction=fraction, clock=clock), clock


def test_retained_blocks_survive_pressure_and_expiry_returns_them():
    m, clock = manager()
    store(m, 1, 2, 3, 4)
    assert m.retain(A, keys(1, 2), clock.now + 10) == RetainOutcome(retained=2)
    store(m, 5, 6, 7, 8)
    out = store(m, 9, 10, 11, 12)  # full: four evictions, never 1 or 2
    assert sorted(out.evicted_keys) == keys(3, 4, 5, 6)
    assert m.lookup_prefix(keys(1, 2)) == 2
    clock.now += 10  # deadline reached: back in the policy's order (the least recent)
    out = store(m, 13, 14)
    assert out.evicted_keys == keys(1, 2)
    assert m.retained(A) == []


def test_retained_block_stays_idle_in_stats():
    m, clock = manager()
    store(m, 1, 2)
    m.retain(A, keys(1, 2), clock.now + 5)
    stats = m.stats()
    assert (stats.used, stats.pinned, stats.in_flight, stats.idle) == (2, 0, 0, 2)


def test_release_returns_blocks_at_once():
    m, clock = manager()
    store(m, 1, 2, 3, 4, 5, 6, 7, 8)
    m.retain(A, keys(1, 2), clock.now + 100)
    assert m.release(A) == 2
    assert m.release(A) == 0
    assert store(m, 9).evicted_keys == keys(1)


def test_budget_trims_tail_first_and_counts():
    m, clock = manager(8, 0.25)  # two blocks
    store(m, 1, 2, 3, 4)
    outcome = m.retain(A, keys(1, 2, 3, 99), clock.now + 10)
    assert outcome == RetainOutcome(retained=2, trimmed=1, absent=1)
    assert [b.key for b in m.retained(A)] == keys(1, 2)
    assert m.retention.counts.trimmed == 1
    # Another session's retention of the same keys costs no budget; new ones are trimmed.
    assert m.retain(A2, keys(2, 4), clock.now + 10) == RetainOutcome(retained=1, trimmed=1)


def test_block_retained_by_several_sessions_stays_until_the_last_ends():
    m, clock = manager(4)
    store(m, 1, 2, 3, 4)
    m.retain(A, keys(1), clock.now + 10)
    m.retain(A2, keys(1), clock.now + 20)
    clock.now += 10
    assert m.retained(A) == [] and [b.key for b in m.retained(A2)] == keys(1)
    assert 1 not in [int.from_bytes(e[:8], "big") for e in store(m, 5).evicted_keys]
    assert m.lookup(k(1)) is LookupResult.HIT
    assert m.release(A2) == 1
    assert store(m, 6).evicted_keys == keys(1)


def test_retain_again_moves_the_deadline():
    m, clock = manager(4)
    store(m, 1, 2, 3, 4)
    m.retain(A, keys(1), clock.now + 10)
    m.retain(A, keys(1), clock.now + 30)
    clock.now += 15
    assert m.retained(A) == [RetainedBlock(k(1), "CPU", clock.now + 15)]
    assert k(1) not in store(m, 5).evicted_keys


def test_tenants_never_touch_each_others_retention():
    m, clock = manager()
    store(m, 1, 2)
    m.retain(A, keys(1, 2), clock.now + 10)
    assert m.retained(B) == []
    assert m.release(B) == 0
    assert [b.key for b in m.retained(A)] == keys(1, 2)


def test_full_of_retained_and_pinned_blocks_declines_stores_at_once():
    m, clock = manager(4, 0.5)
    store(m, 1, 2, 3, 4)
    m.retain(A, keys(1, 2), clock.now + 10)
    m.prepare_load(keys(3, 4))
    assert m.prepare_store(keys(5)) is None
    m.complete_load(keys(3))
    assert m.prepare_store(keys(5)).evicted_keys == keys(3)


def test_pinned_retained_block_counts_once():
    m, clock = manager(4, 0.5)
    store(m, 1, 2, 3, 4)
    m.retain(A, keys(1, 2), clock.now + 10)
    m.prepare_load(keys(1))  # retained and pinned: two idle blocks (3, 4) are evictable
    assert sorted(m.prepare_store(keys(5, 6)).evicted_keys) == keys(3, 4)


def test_in_flight_block_can_be_retained():
    m, clock = manager(4, 0.5)
    out = m.prepare_store(keys(1))
    assert m.retain(A, keys(1), clock.now + 10).retained == 1
    m.complete_store(out.keys_to_store)
    store(m, 2, 3, 4)
    assert k(1) not in store(m, 5).evicted_keys


def test_dropped_blocks_leave_retention():
    m, clock = manager(4, 1.0)
    out = m.prepare_store(keys(1, 2, 3))
    m.retain(A, keys(1, 2, 3), clock.now + 10)
    m.complete_store(keys(1), success=False)
    m.complete_store(keys(2, 3))
    m.discard(keys(2))
    assert [b.key for b in m.retained(A)] == keys(3)
    assert out.keys_to_store == keys(1, 2, 3)
    m.reset()
    assert m.retained(A) == [] and len(m.retention) == 0
    store(m, 1, 2, 3, 4)
    assert len(store(m, 5).evicted_keys) == 1


def test_zero_budget_retains_nothing():
    m, clock = manager(4, 0.0)
    store(m, 1)
    assert m.retain(A, keys(1), clock.now + 10) == RetainOutcome(trimmed=1)


@pytest.mark.parametrize("fraction", [-0.1, 1.5, "half", None, True, float("nan")])
def test_bad_retention_fraction_is_named(fraction):
    with pytest.raises(ValueError, match="retention_fraction"):
        CPUOffloadingManager(4, retention_fraction=fraction)


def test_bad_deadline_is_named():
    m, _ = manager()
    with pytest.raises(ValueError, match="deadline"):
        m.retain(A, keys(1), float("nan"))
    with pytest.raises(TypeError, match="SessionId"):
        m.retain("chat", keys(1), 1.0)


def test_retention_index_protect_is_cheap_when_empty():
    index = RetentionIndex(4, ManualClock(1000.0))
    named = set(keys(1))
    assert index.protect(named) is named
    index.retain(A, keys(2), 2000.0, lambda key: True)
    protected = index.protect(named)
    assert k(1) in protected and k(2) in protected and k(3) not in protected
    by_slot = index.protect({7}, key_of=lambda slot: k(slot))
    assert 7 in by_slot and 2 in by_slot and 3 not in by_slot


# -- a state machine: retention invariants under random operations ------------------------

SESSIONS = [A, A2, B]
N_BLOCKS = 6
FRACTION = 0.5
BUDGET = 3


class RetentionMachine(RuleBasedStateMachine):
    """A reference model of who retains what until when, checked against the CPU tier
    under stores, loads, discards, releases and a moving clock, for every policy."""

    @initialize(policy=st.sampled_from(["lru", "arc", "s3fifo", "wtinylfu", "turnlru"]))
    def start(self, policy):
        self.clock = ManualClock(1000.0)
        self.m = CPUOffloadingManager(N_BLOCKS, policy, retention_fraction=FRACTION, clock=self.clock)
        self.model: dict[SessionId, dict[bytes, float]] = {}
        self.pinned: list[bytes] = []

    def live(self) -> set[bytes]:
        return {key for held in self.model.values() for key, until in held.items() if until > self.clock.now}

    def forget(self, dropped) -> None:
        for held in self.model.values():
            for key in dropped:
                held.pop(key, None)

    @rule(ids=st.lists(st.integers(0, 11), min_size=1, max_size=4))
    def store(self, ids):
        live, named = self.live(), set(keys(*ids))
        new = [key for key in dict.fromkeys(keys(*ids)) if self.m.state(key) is None]
        held = self.m.keys()
        evictable = [key for key in held if self.m.state(key) == 0 and key not in live | named]
        out = self.m.prepare_store(keys(*ids))
        if out is None:
            if self.m.policy.admits_all:  # room was there: the tier had to make it
                assert len(new) > N_BLOCKS - len(held) + len(evictable)
            return
        assert not live & set(out.evicted_keys), "a retained block was evicted"
        self.forget(out.evicted_keys)
        self.m.complete_store(out.keys_to_store)

    @rule(ids=st.lists(st.integers(0, 11), min_size=1, max_size=4), session=st.sampled_from(SESSIONS),
          ttl=st.floats(0.5, 20))  # fmt: skip
    def retain(self, ids, session, ttl):
        until = self.clock.now + ttl
        held = [key for key in dict.fromkeys(keys(*ids)) if self.m.state(key) is not None]
        live = self.live()
        mine = {key for key, t in self.model.get(session, {}).items() if t > self.clock.now}
        outcome = self.m.retain(session, keys(*ids), until)
        expected = []
        for key in held:  # the reference: head to tail while the budget lasts
            if key in mine or key in live or len(live) < BUDGET:
                expected.append(key)
                live.add(key)
        assert outcome.retained == len(expected)
        assert outcome.trimmed == len(held) - len(expected)
        entry = self.model.setdefault(session, {})
        for key in list(entry):
            if entry[key] <= self.clock.now:
                del entry[key]
        entry.update(dict.fromkeys(expected, until))

    @rule(session=st.sampled_from(SESSIONS))
    def release(self, session):
        held = self.model.pop(session, {})
        assert self.m.release(session) == sum(until > self.clock.now for until in held.values())

    @rule(dt=st.floats(0, 10))
    def tick(self, dt):
        self.clock.now += dt

    @rule(i=st.integers(0, 11))
    def load(self, i):
        if self.m.state(k(i)) is not None and self.m.state(k(i)) >= 0:
            self.m.prepare_load([k(i)])
            self.pinned.append(k(i))

    @rule()
    def unload(self):
        if self.pinned:
            self.m.complete_load([self.pinned.pop()])

    @rule(i=st.integers(0, 11))
    def discard(self, i):
        if self.m.state(k(i)) == 0:
            self.m.discard([k(i)])
            self.forget([k(i)])

    @invariant()
    def retention_matches_the_model(self):
        if not hasattr(self, "m"):
            return
        live = self.live()
        assert len(live) <= BUDGET
        for session in SESSIONS:
            expected = {key: t for key, t in self.model.get(session, {}).items() if t > self.clock.now}
            got = {b.key: b.until for b in self.m.retained(session)}
            assert got == expected
            assert all(self.m.state(key) is not None for key in got)


RetentionMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_retention_state_machine = RetentionMachine.TestCase


def test_deadlines_stay_right_over_many_retains_of_the_same_keys():
    """A session retaining its growing prefix every turn: each key's latest deadline holds,
    however many retains came before (stale deadlines are compacted away)."""
    clock = ManualClock(1000.0)
    index = RetentionIndex(64, clock)
    for turn in range(600):
        last = clock.now + 50
        index.retain(A, keys(*range(turn % 40 + 1)), last, lambda key: True)
        clock.now += 0.1
    got = {b.key: b.until for b in index.retained(A, "CPU")}
    assert got == dict.fromkeys(keys(*range(40)), last)  # the last turn named all 40
    clock.now = last - 0.01
    assert len(index.retained(A, "CPU")) == 40
    clock.now = last
    assert sorted(index.expire()) == keys(*range(40))
    assert index.retained(A, "CPU") == [] and len(index) == 0
