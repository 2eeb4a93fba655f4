import pytest

from kvoffload.cpu import CPUOffloadingManager
from kvoffload.policies import (
    ARCPolicy,
    BlockStatus,
    CachePolicy,
    LRUPolicy,
    available_policies,
    resolve_policy,
)


def k(i: int) -> bytes:
    return i.to_bytes(8, "big") + b"\x00\x00\x00\x00"


def ready(policy: CachePolicy, *ids: int) -> dict[int, BlockStatus]:
    statuses = {}
    for i in ids:
        statuses[i] = BlockStatus(i, 0)
        policy.insert(k(i), statuses[i])
    return statuses


def test_lru_touch_walks_in_reverse_so_prefix_tail_goes_first():
    lru = LRUPolicy(8)
    ready(lru, 1, 2, 3, 4)
    lru.touch([k(1), k(2), k(3)])  # a prefix: 1 is its head
    assert lru.evict(4, ()) == [k(4), k(3), k(2), k(1)]


def test_lru_evict_all_or_nothing_and_skips_busy():
    lru = LRUPolicy(8)
    st = ready(lru, 1, 2, 3)
    st[1].ref = 2  # pinned
    st[2].ref = -1  # in flight
    assert lru.evict(2, ()) is None
    assert lru.evict(1, ()) == [k(3)]
    assert lru.evict(1, ()) is None
    st[1].ref = 0
    assert lru.evict(1, {k(1)}) is None
    assert lru.evict(1, ()) == [k(1)]


def test_arc_second_access_promotes_to_t2_and_t1_is_evicted_first():
    arc = ARCPolicy(4)
    ready(arc, 1, 2, 3)
    arc.touch([k(1)])  # second access: T2
    assert arc.evict(2, ()) == [k(2), k(3)]  # p = 0: T1 goes first
    assert arc.evict(1, ()) == [k(1)]


def test_arc_touch_while_in_flight_is_not_a_second_access():
    arc = ARCPolicy(4)
    st = BlockStatus(0, -1)
    arc.insert(k(1), st)
    ready(arc, 2)
    arc.touch([k(2)])  # 2 -> T2
    arc.touch([k(1)])  # in flight: stays in T1
    st.ref = 0
    assert arc.evict(1, ()) == [k(1)]


def test_arc_ghost_hits_adapt_target_and_readmit_to_t2():
    arc = ARCPolicy(2)
    ready(arc, 1, 2)
    assert arc.evict(1, ()) == [k(1)]  # 1 -> B1
    assert arc.target_t1 == 0
    arc.touch([k(1)])  # ghost hit in B1: p grows by max(1, |B2|/|B1|) = 1
    assert arc.target_t1 == 1
    arc.insert(k(1), BlockStatus(0, 0))  # re-stored: seen before, so T2
    ready(arc, 3)
    # |T1| = 2 (2 and 3) > p = 1: T1's LRU goes; 1 in T2 survives
    assert arc.evict(1, ()) == [k(2)]
    # now |T1| = 1 == p, so T2 is preferred
    assert arc.evict(1, ()) == [k(1)]
    arc.touch([k(1)])  # ghost hit in B2: p shrinks by max(1, |B1|/|B2|) = 1
    assert arc.target_t1 == 0


def test_arc_falls_back_to_other_list_when_preferred_has_nothing_evictable():
    arc = ARCPolicy(4)
    st = ready(arc, 1, 2)
    arc.touch([k(1), k(2)])  # both in T2; reverse walk leaves 2 least recent
    ready(arc, 3)[3].ref = 1  # T1 (preferred, p = 0) holds only a pinned block
    assert arc.evict(1, ()) == [k(2)]
    arc.target_t1 = 4.0  # now T2 is preferred, but its only block is pinned
    st[1].ref = 1
    ready(arc, 4)
    assert arc.evict(1, ()) == [k(4)]
    assert arc.evict(1, ()) is None


def test_arc_ghost_lists_bounded_by_capacity():
    arc = ARCPolicy(2)
    for i in range(10):
        ready(arc, i)
        arc.evict(1, ())
    assert len(arc._b1) <= 2


def test_registry_resolves_names_paths_and_classes():
    assert {"lru", "arc"} <= set(available_policies())
    assert resolve_policy("LRU") is LRUPolicy
    assert resolve_policy("kvoffload.policies.arc:ARCPolicy") is ARCPolicy
    assert resolve_policy(ARCPolicy) is ARCPolicy
    m = CPUOffloadingManager(2, "kvoffload.policies.lru:LRUPolicy")
    assert isinstance(m.policy, LRUPolicy)


@pytest.mark.parametrize(
    "bad, message",
    [
        ("nope", "unknown eviction policy 'nope'"),
        ("no.such.module:X", "cannot import eviction policy 'no.such.module:X'"),
        ("kvoffload.keys:BlockHasher", "not a CachePolicy subclass"),
        ("", "eviction policy must be"),
    ],
)
def test_registry_errors_name_the_value(bad, message):
    with pytest.raises(ValueError, match=message):
        resolve_policy(bad)
