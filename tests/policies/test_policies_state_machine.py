"""Manager invariants under every registered eviction policy (hypothesis state machine).

Random sequences of prepare_store / complete_store (success or failure) / lookup /
prepare_load / complete_load / touch / reset against ``CPUOffloadingManager`` with events
on, checked against a model of the contract: never more than ``num_blocks`` slots used;
pinned and in-flight blocks never evicted; ``HIT`` exactly for completed, non-evicted
keys; the event stream replayed from the start reproduces the set of loadable keys.
Parametrised over ``available_policies()`` so every registered policy is covered.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kvoffload.cpu import CPUOffloadingManager
from kvoffload.keys import make_offload_key
from kvoffload.manager import LookupResult, RequestContext
from kvoffload.policies import BlockStatus, CachePolicy, available_policies, resolve_policy

POOL = [make_offload_key(i.to_bytes(8, "big"), 0) for i in range(10)]
keys_st = st.lists(st.sampled_from(POOL), min_size=1, max_size=6)


def tracked_keys(policy: CachePolicy) -> list[bytes]:
    """Every resident key a policy tracks, once per entry.

    There is no public view of a policy's contents, so this looks at its attributes: a
    resident entry is a dict item whose value is the key's ``BlockStatus`` (alone or first
    in a tuple), in a dict attribute or a list of them. Ghost/history entries carry no
    status and are not counted. Generic on purpose, so it covers every registered policy
    (and survives renames); the invariant below compares it with the tier's keys, so a
    policy whose layout this misses fails loudly instead of passing vacuously.
    """
    found: list[bytes] = []

    def visit(value: object) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                if isinstance(item, tuple) and item:
                    item = item[0]
                if isinstance(item, BlockStatus):
                    found.append(key)
        elif isinstance(value, list):
            for item in value:
                visit(item)

    names = set(getattr(policy, "__dict__", ()))
    names.update(name for cls in type(policy).__mro__ for name in getattr(cls, "__slots__", ()))
    for name in names:
        if not name.endswith("_index"):  # an index over the other entries (ghosts too), not one more
            visit(getattr(policy, name, None))
    return found


def machine_for(policy: str, num_blocks: int = 4) -> type[RuleBasedStateMachine]:
    class ManagerMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.m = CPUOffloadingManager(num_blocks, policy, enable_events=True)
            self.ready: set[bytes] = set()
            self.in_flight: set[bytes] = set()
            self.pins: dict[bytes, int] = {}
            self.loads: list[list[bytes]] = []
            self.announced: set[bytes] = set()
            self.slots: dict[bytes, int] = {}
            self.requests: list[tuple[RequestContext, list[bytes]]] = []
            self.next_request = 0

        @rule(keys=keys_st)
        def prepare_store(self, keys):
            before_used = self.m.stats().used
            out = self.m.prepare_store(keys)
            if out is None:
                assert self.m.stats().used == before_used
                return
            present = self.ready | self.in_flight
            new = [k for k in dict.fromkeys(keys) if k not in present]
            assert set(out.keys_to_store) <= set(new)
            if resolve_policy(policy).admits_all:
                assert out.keys_to_store == new
            for key in out.evicted_keys:
                assert key in self.ready, "evicted a key that was not loadable"
                assert self.pins.get(key, 0) == 0, "evicted a pinned key"
                assert key not in keys, "evicted a key named in the call"
                self.ready.discard(key)
            self.in_flight |= set(out.keys_to_store)
            assert len(out.store_spec.block_ids) == len(out.keys_to_store)
            for key in out.evicted_keys:
                self.slots.pop(key)
            self.slots.update(zip(out.keys_to_store, out.store_spec.block_ids.tolist()))

        @rule(data=st.data(), success=st.booleans())
        def complete_store(self, data, success):
            keys = data.draw(st.lists(st.sampled_from(POOL), max_size=6))
            self.m.complete_store(keys, success=success)
            done = self.in_flight & set(keys)
            self.in_flight -= done
            if success:
                self.ready |= done
            else:
                for key in done:
                    self.slots.pop(key)

        @rule(key=st.sampled_from(POOL))
        def lookup(self, key):
            expected = (
                LookupResult.HIT
                if key in self.ready
                else LookupResult.PENDING
                if key in self.in_flight
                else LookupResult.MISS
            )
            assert self.m.lookup(key) is expected

        @precondition(lambda self: self.ready)
        @rule(data=st.data())
        def prepare_load(self, data):
            keys = data.draw(st.lists(st.sampled_from(sorted(self.ready)), min_size=1, max_size=4))
            spec = self.m.prepare_load(keys)
            assert spec.block_ids.tolist() == [self.slots[key] for key in keys]
            for key in keys:
                self.pins[key] = self.pins.get(key, 0) + 1
            self.loads.append(keys)

        @precondition(lambda self: self.loads)
        @rule(data=st.data())
        def complete_load(self, data):
            keys = self.loads.pop(data.draw(st.integers(0, len(self.loads) - 1)))
            self.m.complete_load(keys)
            for key in keys:
                self.pins[key] -= 1

        @rule(keys=keys_st)
        def touch(self, keys):
            self.m.touch(keys)

        @rule(keys=keys_st)
        def new_request(self, keys):
            # announced, then its one touch, as the scheduler does
            ctx = RequestContext(f"r{self.next_request}")
            self.next_request += 1
            self.m.on_new_request(ctx)
            self.m.touch(keys)
            self.requests.append((ctx, keys))

        @precondition(lambda self: self.requests)
        @rule(data=st.data())
        def finish_request(self, data):
            ctx, keys = self.requests.pop(data.draw(st.integers(0, len(self.requests) - 1)))
            keys = keys + data.draw(st.lists(st.sampled_from(POOL), max_size=3))  # blocks it generated
            inserted = set(data.draw(st.lists(st.sampled_from(keys), max_size=4)))
            reused = set(data.draw(st.lists(st.sampled_from(keys), max_size=4))) - inserted
            self.m.on_request_finished(ctx, [keys], inserted, reused)

        @rule()
        def reset(self):
            self.m.reset()
            self.ready.clear()
            self.in_flight.clear()
            self.pins.clear()
            self.loads.clear()
            self.slots.clear()

        @invariant()
        def occupancy(self):
            stats = self.m.stats()
            assert stats.used <= num_blocks
            assert stats.used == len(self.ready) + len(self.in_flight)
            assert stats.in_flight == len(self.in_flight)
            assert stats.pinned == sum(1 for count in self.pins.values() if count > 0)
            assert stats.idle == len(self.ready) - stats.pinned

        @invariant()
        def slots_unique_and_in_range(self):
            assert set(self.slots) == self.ready | self.in_flight
            assert len(set(self.slots.values())) == len(self.slots)
            assert all(0 <= slot < num_blocks for slot in self.slots.values())

        @invariant()
        def hits_exactly_ready(self):
            for key in POOL:
                result = self.m.lookup(key)
                assert (result is LookupResult.HIT) == (key in self.ready)
                assert (result is LookupResult.PENDING) == (key in self.in_flight)

        @invariant()
        def events_reproduce_loadable(self):
            for event in self.m.take_events():
                if event.removed:
                    self.announced -= set(event.keys)
                else:
                    self.announced |= set(event.keys)
            assert self.announced == self.ready

        @invariant()
        def policy_tracks_only_what_the_tier_holds(self):
            held = self.ready | self.in_flight
            tracked = tracked_keys(self.m.policy)
            leaked = set(tracked) - held
            assert not leaked, f"policy tracks keys the tier dropped: {sorted(k.hex() for k in leaked)}"
            assert len(tracked) <= self.m.stats().used
            # ... and each held key exactly once: an untracked key could never be evicted.
            assert sorted(tracked) == sorted(held)

    ManagerMachine.__name__ = f"ManagerMachine_{policy}"
    return ManagerMachine


@pytest.mark.parametrize("policy", available_policies())
def test_manager_invariants(policy):
    run_state_machine_as_test(
        machine_for(policy),
        settings=settings(
            max_examples=60,
            stateful_step_count=40,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
