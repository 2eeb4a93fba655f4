"""Behaviour of the S3-FIFO and W-TinyLFU eviction policies, key by key.

Each test drives one policy through its public protocol (``insert``/``insert_many``,
``touch``, ``evict``) and asserts the exact keys evicted, in order, as the module
docstrings of ``kvoffload.policies.s3fifo`` and ``kvoffload.policies.wtinylfu`` define
them. The orders are chosen so that a policy with its promotion, ghost queue or
admission duel inverted (or ignored) evicts different keys and fails here: the
manager-level state machine only checks that *some* legal key is evicted.

Small capacities keep the shares easy to see: S3-FIFO(10) has a small queue of 1 key,
W-TinyLFU(5) a window of 1 key, a main area of 4 and a protected segment of 3.
"""

from __future__ import annotations

import pytest

from kvoffload.cpu import CPUOffloadingManager
from kvoffload.keys import make_offload_key
from kvoffload.manager import LookupResult
from kvoffload.policies import BlockStatus, CachePolicy, S3FIFOPolicy, WTinyLFUPolicy


def k(i: int) -> bytes:
    return make_offload_key(i.to_bytes(8, "big"), 0)


def ks(*ids: int) -> list[bytes]:
    return [k(i) for i in ids]


def store(policy: CachePolicy, *ids: int, ref: int = 0) -> dict[int, BlockStatus]:
    """Insert each key in its own call (so in the given order), already stored (idle)."""
    statuses = {}
    for i in ids:
        statuses[i] = BlockStatus(i, ref)
        policy.insert(k(i), statuses[i])
    return statuses


def use(policy: CachePolicy, i: int, times: int = 1) -> None:
    """``times`` requests naming key ``i`` alone."""
    for _ in range(times):
        policy.touch([k(i)])


# -- S3-FIFO -----------------------------------------------------------------------------


def test_s3fifo_shares():
    # The shares the scenarios below rely on.
    assert S3FIFOPolicy(10).small_target == 1
    assert S3FIFOPolicy(2).small_target == 1


def test_s3fifo_small_queue_is_fifo_one_hit_wonders_leave_and_used_keys_move_to_main():
    p = S3FIFOPolicy(10)
    store(p, 1, 2, 3)
    use(p, 1)  # 1 is used once while in S: it earned main
    # S is over its share: its oldest key, 1, was used, so it moves to M instead of
    # leaving; the next oldest, 2, was never used (a one-hit wonder) and is evicted.
    assert p.evict(1, ()) == [k(2)]
    store(p, 4, 5)
    # S = [3, 4, 5] is over its share, so S loses keys in FIFO order although 1 in M is
    # older than all of them.
    assert p.evict(2, ()) == ks(3, 4)
    # S = [5] is within its share: M's oldest goes (1's counter was reset on promotion).
    assert p.evict(1, ()) == [k(1)]
    # M is empty: S gives up its last key.
    assert p.evict(1, ()) == [k(5)]
    assert p.evict(1, ()) is None


def test_s3fifo_a_key_stored_again_while_in_the_ghost_queue_enters_main():
    p = S3FIFOPolicy(10)
    store(p, 1, 2, 3)
    assert p.evict(1, ()) == [k(1)]  # a one-hit wonder out of S, remembered as a ghost
    store(p, 1)  # back while a ghost: it left S too early, so it goes to M
    store(p, 4, 5, 6)
    # S = [2, 3, 4, 5, 6] drains in FIFO order; 1, now in M, is not among them although
    # it was stored before 4, 5 and 6 (in S it would have gone right after 3).
    assert p.evict(4, ()) == ks(2, 3, 4, 5)
    assert p.evict(1, ()) == [k(1)]  # S is within its share: M goes
    assert p.evict(1, ()) == [k(6)]


def test_s3fifo_keys_evicted_from_main_are_not_remembered_as_ghosts():
    p = S3FIFOPolicy(10)
    store(p, 1, 2)
    use(p, 1)
    assert p.evict(1, ()) == [k(2)]  # 1 promoted to M; 2 out of S into the ghost queue
    assert p.evict(1, ()) == [k(1)]  # 1 out of M: no ghost
    store(p, 1, 2, 3)  # 1 enters S (never a ghost); 2 enters M (it was a ghost)
    # S = [1, 3] is over its share: 1, unused, goes first; 2 stays in M.
    assert p.evict(1, ()) == [k(1)]
    assert p.evict(1, ()) == [k(2)]  # S = [3] within its share: M goes
    assert p.evict(1, ()) == [k(3)]


def test_s3fifo_main_gives_used_keys_a_second_chance():
    p = S3FIFOPolicy(10)
    store(p, 1, 2, 3)
    assert p.evict(2, ()) == ks(1, 2)
    store(p, 1, 2)  # both ghosts: M = [1, 2]; S = [3]
    use(p, 1)
    # M's oldest, 1, was used: its counter drops and it goes back to the new end of M;
    # 2 was not and is evicted.
    assert p.evict(1, ()) == [k(2)]
    assert p.evict(1, ()) == [k(1)]
    assert p.evict(1, ()) == [k(3)]


def test_s3fifo_a_store_enters_small_in_reverse_so_a_prefix_head_leaves_last():
    p = S3FIFOPolicy(10)
    p.insert_many(ks(1, 2, 3), [BlockStatus(i, 0) for i in range(3)])  # 1 is the head
    assert p.evict(3, ()) == ks(3, 2, 1)


def test_s3fifo_ghost_queue_is_bounded_by_the_capacity():
    p = S3FIFOPolicy(2)
    for i in (1, 2, 3):
        store(p, i)
        assert p.evict(1, ()) == [k(i)]  # each out of S: ghosts 1, 2, 3, bound 2
    store(p, 1, 3)  # 1 was forgotten, so it enters S; 3 is still a ghost: M
    # S = [1] is within its share and M has an evictable key, so M's 3 goes first; had
    # 1 still been a ghost, both would be in M and 1, the older, would go.
    assert p.evict(1, ()) == [k(3)]
    assert p.evict(1, ()) == [k(1)]


def test_s3fifo_skips_busy_keys_and_a_failed_evict_forgets_nothing():
    p = S3FIFOPolicy(10)
    st = store(p, 1, 2, 3)
    st[1].ref = 1  # pinned by a load
    st[2].ref = -1  # being written
    assert p.evict(2, ()) is None
    assert p.evict(1, {k(3)}) is None  # protected by the caller
    assert p.evict(1, ()) == [k(3)]
    st[1].ref = 0
    st[2].ref = 0
    assert p.evict(2, ()) == ks(1, 2)


# -- W-TinyLFU ---------------------------------------------------------------------------


def wtinylfu(capacity: int = 5, **kwargs) -> WTinyLFUPolicy:
    p = WTinyLFUPolicy(capacity, **kwargs)
    assert p.sketch.sample_size > 10  # no aging: these scenarios count at most 10 uses
    return p


def test_wtinylfu_shares():
    p = wtinylfu()
    assert (p.window_target, p.capacity - p.window_target, p.protected_target) == (1, 4, 3)


def test_wtinylfu_window_fills_the_main_area_before_any_duel():
    p = wtinylfu()
    store(p, 1, 2, 3, 4, 5)
    # The window is over its share but the main area is empty: 1..4 move to probation
    # without a duel, then the window is within its share and probation's oldest goes.
    assert p.evict(1, ()) == [k(1)]
    store(p, 6)
    # Window [5, 6]: 5 moves to the main area, which has room again; probation's
    # oldest goes.
    assert p.evict(1, ()) == [k(2)]
    assert p.evict(3, ()) == ks(3, 4, 5)
    assert p.evict(1, ()) == [k(6)]  # the main area is empty: the window gives up its key


@pytest.mark.parametrize(
    ("candidate_uses", "victim_uses", "evicted"),
    [
        (0, 0, "candidate"),  # a tie: the newcomer loses, one-time keys cannot push out
        (3, 3, "candidate"),
        (1, 0, "victim"),  # a frequent candidate beats a rare victim ...
        (3, 1, "victim"),
        (1, 3, "candidate"),  # ... and a rare candidate loses to a frequent victim
        (0, 1, "candidate"),
    ],
)
def test_wtinylfu_admission_duel_keeps_the_more_frequent_key(candidate_uses, victim_uses, evicted):
    p = wtinylfu()
    # Requests named 1 (the future main victim) and 9 (the future candidate) before
    # they were stored: the sketch counts every key a request names.
    use(p, 1, victim_uses)
    use(p, 9, candidate_uses)
    assert (p.sketch.estimate(k(9)), p.sketch.estimate(k(1))) == (candidate_uses, victim_uses)
    store(p, 1, 2, 3, 4, 9, 5)
    # 1..4 fill the main area; 9, the window's oldest, then duels probation's oldest, 1.
    if evicted == "candidate":
        assert p.evict(1, ()) == [k(9)]
        assert p.evict(4, ()) == ks(1, 2, 3, 4)  # the window (5) is within its share
        assert p.evict(1, ()) == [k(5)]
    else:
        assert p.evict(1, ()) == [k(1)]
        # 9 was admitted to probation, behind 2..4.
        assert p.evict(4, ()) == ks(2, 3, 4, 9)
        assert p.evict(1, ()) == [k(5)]


def test_wtinylfu_a_use_in_probation_protects_the_key():
    p = wtinylfu()
    store(p, 1, 2, 3, 4, 5, 6)
    assert p.evict(1, ()) == [k(5)]  # 1..4 to probation; 5 loses its duel with 1 (a tie)
    use(p, 1)  # 1 is used while in probation: protected
    use(p, 6, 2)  # 6, in the window, becomes frequent
    store(p, 7)
    # Window [6, 7]: 6 duels the main area's victim, probation's oldest, now 2 (1 is
    # older but protected), and wins.
    assert p.evict(1, ()) == [k(2)]
    # Probation [3, 4, 6] goes before protected [1], though 6 entered the main area
    # last (had 1 merely moved to probation's new end, it would go before 6).
    assert p.evict(3, ()) == ks(3, 4, 6)
    assert p.evict(1, ()) == [k(1)]
    assert p.evict(1, ()) == [k(7)]


def test_wtinylfu_protected_overflow_goes_back_to_probation():
    # Capacity 6 with a 40% protected share: window 1, main 5, protected at most 2.
    p = wtinylfu(6, protected_fraction=0.4)
    assert (p.window_target, p.protected_target) == (1, 2)
    store(p, 1, 2, 3, 4, 5, 6, 7)
    assert p.evict(1, ()) == [k(6)]  # 1..5 to probation; 6 loses its duel with 1 (a tie)
    use(p, 1)
    use(p, 2)
    use(p, 3)  # protected [1, 2, 3] is over its share: 1 goes back to probation's new end
    use(p, 7, 2)  # 7, in the window, becomes frequent
    store(p, 8)
    # Window [7, 8]: 7 duels probation's oldest, 4, and wins.
    assert p.evict(1, ()) == [k(4)]
    # Probation is now [5, 1, 7]: the demoted 1 goes before 7, admitted after it (had 1
    # stayed protected, 7 would go first), and before protected [2, 3].
    assert p.evict(5, ()) == ks(5, 1, 7, 2, 3)


def test_wtinylfu_a_store_enters_the_window_in_reverse_so_a_prefix_head_is_newest():
    p = wtinylfu(3)  # window 1, main 2
    p.insert_many(ks(1, 2, 3, 4), [BlockStatus(i, 0) for i in range(4)])  # 1 is the head
    # Window [4, 3, 2, 1]: 4 and 3 fill the main area; 2 then loses a tie against 4.
    assert p.evict(1, ()) == [k(2)]
    assert p.evict(3, ()) == ks(4, 3, 1)


def test_wtinylfu_touch_walks_in_reverse_so_a_prefix_head_is_most_recent():
    p = wtinylfu(3)
    store(p, 1, 2, 3, 4)
    p.touch(ks(3, 2, 1))  # a prefix with head 3: window order becomes [4, 1, 2, 3]
    # 4 and 1 fill the main area; 2 (one use) beats 4 (none) in the duel.
    assert p.evict(1, ()) == [k(4)]
    assert p.evict(3, ()) == ks(1, 2, 3)


def test_wtinylfu_skips_busy_keys_and_a_failed_evict_forgets_nothing():
    p = wtinylfu()
    st = store(p, 1, 2, 3)
    st[1].ref = 2  # pinned
    st[2].ref = -1  # being written
    assert p.evict(2, ()) is None
    assert p.evict(1, {k(3)}) is None
    assert p.evict(1, ()) == [k(3)]
    st[1].ref = 0
    st[2].ref = 0
    assert p.evict(2, ()) == ks(1, 2)
    assert p.evict(1, ()) is None


# -- admission through the manager ----------------------------------------------------------


class _EvenOnly:
    """Mixin: the policy declines keys whose block id is odd."""

    admits_all = False

    def admit(self, key: bytes) -> bool:
        return key[7] % 2 == 0


class _EvenOnlyS3FIFO(_EvenOnly, S3FIFOPolicy):
    pass


class _EvenOnlyWTinyLFU(_EvenOnly, WTinyLFUPolicy):
    pass


@pytest.mark.parametrize("policy", [S3FIFOPolicy, WTinyLFUPolicy])
def test_both_policies_admit_every_key_at_store_time(policy):
    # W-TinyLFU's admission is the duel at eviction time, not a refusal to store.
    assert policy.admits_all and policy(4).admit(k(1))
    m = CPUOffloadingManager(4, policy)
    out = m.prepare_store(ks(1, 2, 3, 4))
    assert out.keys_to_store == ks(1, 2, 3, 4) and out.evicted_keys == []


@pytest.mark.parametrize("policy", [_EvenOnlyS3FIFO, _EvenOnlyWTinyLFU])
def test_keys_the_policy_declines_are_not_stored_cost_no_eviction_and_are_not_tracked(policy):
    m = CPUOffloadingManager(2, policy, enable_events=True)
    out = m.prepare_store(ks(1, 2, 3, 4))
    assert out.keys_to_store == ks(2, 4) and out.store_spec.block_ids.tolist() == [0, 1]
    m.complete_store(out.keys_to_store)
    # The tier is full, yet declined keys make no room: nothing is evicted for them.
    out = m.prepare_store(ks(5, 7))
    assert out.keys_to_store == [] and out.evicted_keys == []
    hit, miss = LookupResult.HIT, LookupResult.MISS
    assert [m.lookup(key) for key in ks(1, 2, 3, 4, 5, 7)] == [miss, hit, miss, hit, miss, miss]
    assert [(e.keys, e.removed) for e in m.take_events()] == [(ks(2, 4), False)]
    # The policy never heard of the declined keys: it can evict exactly the two it holds.
    assert sorted(m.policy.evict(2, ())) == ks(2, 4)
    assert m.policy.evict(1, ()) is None
