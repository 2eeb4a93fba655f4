"""Policies under the request lifecycle, and the small contract fixes of issue 12.

LRU re-ranks a finished request deepest-least-recent and never evicts the prefix a
running request reused before the suffix it stored; turn-aware LRU attributes stores and
finals by request, not by "the last touch"; every policy returns at once when asked for
more than it holds; the CPU tier does not ask when it has too few idle blocks; the
registry refuses a name twice; stats separate blocks in use from idle ones.
"""

from __future__ import annotations

import pytest

from kvoffload.cpu import CPUOffloadingManager
from kvoffload.keys import BlockHasher, make_offload_key
from kvoffload.manager import LookupResult, RequestContext
from kvoffload.policies import (
    BlockStatus,
    LRUPolicy,
    available_policies,
    register_policy,
    resolve_policy,
)
from kvoffload.scheduler import KVGroup, OffloadingScheduler, StepRequest

HIT = LookupResult.HIT


def k(name) -> bytes:
    return make_offload_key(str(name).encode().ljust(8, b"_"), 0)


def ks(*names) -> list[bytes]:
    return [k(n) for n in names]


def serve(m, rid, names, generated=(), finish=True):
    """One request the way the scheduler drives a tier: announce, look up, touch, load
    the hit prefix, store the rest (then blocks it generated, never touched), finish."""
    keys, extra = ks(*names), ks(*generated)
    ctx = RequestContext(rid)
    m.on_new_request(ctx)
    hit = m.lookup_prefix(keys)
    m.touch(keys)
    if hit:
        m.prepare_load(keys[:hit])
        m.complete_load(keys[:hit])
    inserted = []
    for part in (keys[hit:], extra):
        out = m.prepare_store(part) if part else None
        if out is not None:
            m.complete_store(out.keys_to_store)
            inserted += out.keys_to_store
    if finish:
        m.on_request_finished(ctx, [keys + extra], set(inserted), set(keys[:hit]))
    return ctx, inserted


def held(m, *names) -> list[bool]:
    return [m.lookup(k(n)) is HIT for n in names]


# -- LRU -------------------------------------------------------------------------------


def test_lru_finish_ranks_the_deepest_block_least_recent():
    # The first divergence: cache of 4, store [1,2,3] then [4,5]: vLLM evicts 3.
    m = CPUOffloadingManager(4, "lru")
    serve(m, "a", [1, 2, 3])
    _, inserted = serve(m, "b", [4, 5])
    assert inserted == ks(4, 5) and held(m, 1, 2, 3) == [True, True, False]
    # A block a request generated is stored on its own, above its prefix, until the
    # request's finish puts it below: then it goes first.
    m = CPUOffloadingManager(3, "lru")
    ctx, _ = serve(m, "a", [1, 2], generated=[3], finish=False)
    m.on_request_finished(ctx, [ks(1, 2, 3)], set(ks(1, 2, 3)), set())
    serve(m, "b", [4])
    assert held(m, 1, 2, 3) == [True, True, False]


def test_lru_keeps_the_prefix_a_request_just_reused():
    # Store [1,2] and [3,4]; a request hits [1,2] and stores [5,6]: [3,4] go (vLLM, which
    # re-ranks only at the finish, evicts [2,1]). Then [1,2] are the oldest blocks; d hits
    # them and, while it runs, e needs two slots: d's match refreshed [1,2], so c's
    # [5,6] go, not the prefix d just reused.
    hasher = BlockHasher()

    class Req:
        def __init__(self, rid, tokens):
            self.request_id, self.all_token_ids = rid, tokens
            self.num_prompt_tokens = len(tokens)
            self.block_hashes = hasher.hash_request(tokens, 4)

    manager = CPUOffloadingManager(4, "lru")
    sched = OffloadingScheduler(manager, [KVGroup(4)], hash_block_size=4)

    def run(req, device, finish=True):
        n = sched.match(req, 0)
        sched.on_allocated(req.request_id, [device], n)
        load = sched.build_step([]).loads  # the engine waits for a load before it computes
        sched.complete_jobs([(job.job_id, True) for job in load])
        plan = sched.build_step([StepRequest(req.request_id, None, req.num_prompt_tokens)])
        sched.complete_jobs([(job.job_id, True) for job in plan.stores])
        if finish:
            sched.request_finished(req.request_id)

    a, b = Req("a", list(range(8))), Req("b", list(range(100, 108)))
    run(a, [0, 1])
    run(b, [2, 3])
    c = Req("c", list(range(17)))  # a's 8 tokens, 8 new ones, 1 more to compute
    run(c, [4, 5, 6, 7, 8])
    assert sched.stats.blocks_loaded == 2
    keys = {r: [make_offload_key(h, 0) for h in r.block_hashes] for r in (a, b, c)}
    assert [manager.lookup(x) is HIT for x in keys[c][:4]] == [True] * 4
    assert [manager.lookup(x) is HIT for x in keys[b]] == [False, False]
    manager.touch(keys[c][2:])  # c's suffix used again: [1,2] are now the oldest
    run(Req("d", list(range(9))), [9, 10, 11], finish=False)  # hits [1,2]; still running
    run(Req("e", list(range(200, 208))), [12, 13])
    assert [manager.lookup(x) is HIT for x in keys[c][:4]] == [True, True, False, False]


def test_lru_a_running_requests_suffix_goes_before_the_prefix_it_reused():
    # c reuses [1,2] and stores [5,6] but is still running when x needs two slots: the
    # deepest blocks go first, so c's prefix stays (plain LRU, with the new blocks above
    # the reused ones, would evict [2,1] and leave [5,6] unreachable).
    m = CPUOffloadingManager(4, "lru")
    serve(m, "a", [1, 2])
    serve(m, "c", [1, 2, 5, 6], finish=False)
    serve(m, "x", [7, 8])
    assert held(m, 1, 2, 5, 6, 7, 8) == [True, True, False, False, True, True]


def test_lru_finish_orders_blocks_by_token_position_across_groups():
    # group 0: 4-token blocks a0..a3 (end at 4, 8, 12, 16); group 1: 8-token b0, b1 (8, 16)
    lru = LRUPolicy(8)
    g0, g1 = ks("a0", "a1", "a2", "a3"), [make_offload_key(b"b" * 8, 1), make_offload_key(b"c" * 8, 1)]
    lru.insert_many(g0 + g1, [BlockStatus(i, 0) for i in range(6)])
    ctx = RequestContext("r", {}, (4, 8))
    lru.on_request_finished(ctx, [g0, g1], set(g0 + g1), set())
    assert lru.evict(6, ()) == [g1[1], g0[3], g0[2], g1[0], g0[1], g0[0]]


def test_lru_without_the_hooks_is_plain_lru():
    # a replay that never announces requests keeps the old order: new blocks above the
    # touched prefix, head first
    m = CPUOffloadingManager(4, "lru")
    for names in ([1, 2], [1, 2, 5, 6]):
        keys = ks(*names)
        hit = m.lookup_prefix(keys)
        m.touch(keys)
        m.complete_store(m.prepare_store(keys[hit:]).keys_to_store)
    m.complete_store(m.prepare_store(ks(7, 8)).keys_to_store)
    assert held(m, 1, 2, 5, 6) == [False, False, True, True]


# -- turn-aware LRU --------------------------------------------------------------------


def test_turnlru_stores_take_their_own_requests_level_whoever_touched_between():
    m = CPUOffloadingManager(32, "turnlru")
    serve(m, "a1", ["P", "a1", "a2"])
    ctx_a2 = RequestContext("a2")  # a returns (level 1) ...
    m.on_new_request(ctx_a2)
    m.touch(ks("P", "a1", "a2", "a3"))
    serve(m, "x", ["x1", "x2"])  # ... while a new request (level 0) runs to its end
    out = m.prepare_store(ks("a3"))  # then a stores its new block
    m.complete_store(out.keys_to_store)
    assert m.policy._level[k("a3")] == 1 and m.policy._level[k("x1")] == 0


def test_turnlru_blocks_a_request_generated_take_its_level_at_the_finish():
    m = CPUOffloadingManager(32, "turnlru")
    serve(m, "t1", ["P", "a1", "a2"])
    _, inserted = serve(m, "t2", ["P", "a1", "a2", "a3"], generated=["g1"])
    assert inserted == ks("a3", "g1")
    assert m.policy._level[k("a3")] == 1 and m.policy._level[k("g1")] == 1


def test_turnlru_final_block_only_when_the_request_ended_with_it():
    finals = CPUOffloadingManager(32, "turnlru").policy.levels
    m = CPUOffloadingManager(32, "turnlru")
    serve(m, "trace-like", ["x1", "x2", "xF"])  # ends with the last block its match named
    serve(m, "decoded", ["y1", "y2"], generated=["y3"])  # went on past it: y2 was whole
    level = m.policy._level
    assert (level[k("xF")], level[k("y2")], level[k("y3")]) == (finals, 0, 0)


def test_turnlru_time_counts_announced_requests_not_touches():
    # a request touching once per KV-cache group is still one request
    m = CPUOffloadingManager(32, "turnlru")
    serve(m, "a", ["P", "a1", "a2"])
    ctx = RequestContext("b")
    m.on_new_request(ctx)
    for group in ("b", "c"):
        m.touch(ks(f"{group}1", f"{group}2"))
    m.on_request_finished(ctx, [], set(), set())
    serve(m, "a2", ["P", "a1", "a2", "a3"])
    assert m.policy.turn_gap == 2


# -- contract fixes --------------------------------------------------------------------


def test_registering_a_name_twice_raises_and_keeps_the_first():
    with pytest.raises(ValueError, match="eviction policy name 'lru' is already registered"):
        register_policy(LRUPolicy)

    class Other(LRUPolicy):
        name = "ARC"

    with pytest.raises(ValueError, match="'arc' is already registered"):
        register_policy(Other)
    with pytest.raises(ValueError, match="'lru' is already registered"):
        register_policy(Other, "Lru")
    assert resolve_policy("arc").__name__ == "ARCPolicy" and resolve_policy("lru") is LRUPolicy


class Watched(BlockStatus):
    """A status that counts how often a policy looks at its state."""

    __slots__ = ("_ref",)
    reads = 0

    @property
    def ref(self):
        Watched.reads += 1
        return self._ref

    @ref.setter
    def ref(self, value):
        self._ref = value


@pytest.mark.parametrize("policy", available_policies())
def test_evict_returns_at_once_when_asked_for_more_than_it_holds(policy):
    p = resolve_policy(policy)(64)
    statuses = [Watched(i, 0) for i in range(40)]
    p.insert_many(ks(*range(40)), statuses)
    Watched.reads = 0
    assert p.evict(0, ()) == [] and p.evict(41, ()) is None
    assert Watched.reads == 0
    assert sorted(p.evict(40, ())) == sorted(ks(*range(40)))  # nothing was lost


@pytest.mark.parametrize("policy", available_policies())
@pytest.mark.parametrize("ref", [-1, 2])
def test_evict_with_nothing_evictable_returns_none_and_changes_nothing(policy, ref):
    p = resolve_policy(policy)(16)
    statuses = [BlockStatus(i, 0) for i in range(8)]
    p.insert_many(ks(*range(8)), statuses)
    p.touch(ks(*range(0, 8, 2)))
    for status in statuses:
        status.ref = ref
    assert p.evict(1, ()) is None and p.evict(8, ()) is None
    for status in statuses:
        status.ref = 0
    assert sorted(p.evict(8, ())) == sorted(ks(*range(8)))


class Counting(LRUPolicy):
    calls = 0

    def evict(self, n, protected):
        Counting.calls += 1
        return super().evict(n, protected)


def test_the_cpu_tier_does_not_ask_its_policy_when_too_few_blocks_are_idle():
    m = CPUOffloadingManager(4, Counting)
    m.complete_store(m.prepare_store(ks(1, 2)).keys_to_store)
    m.prepare_store(ks(3))  # in flight
    m.prepare_load(ks(1))  # pinned
    Counting.calls = 0
    assert m.prepare_store(ks(5, 6, 7)) is None  # needs 2 evictions, 1 idle block (2)
    assert Counting.calls == 0
    out = m.prepare_store(ks(5, 6))  # needs 1: asked, and 2 goes
    assert Counting.calls == 1 and out.evicted_keys == ks(2)


def test_stats_separate_blocks_in_use_from_idle_ones():
    m = CPUOffloadingManager(8, "lru")
    m.complete_store(m.prepare_store(ks(1, 2, 3, 4)).keys_to_store)
    m.prepare_store(ks(5))  # in flight
    m.prepare_load(ks(1, 1, 2))  # 1 pinned twice: still one block
    s = m.stats()
    assert (s.used, s.in_flight, s.pinned, s.in_use, s.idle, s.usage) == (5, 1, 2, 3, 2, 3 / 8)
    m.complete_load(ks(1, 2))
    m.complete_store(ks(5), success=False)
    s = m.stats()
    assert (s.used, s.in_use, s.idle) == (4, 1, 3)
    with pytest.raises(KeyError):
        m.complete_load(ks(1, 2))  # 2 is not pinned any more: 1 stays pinned
    with pytest.raises(KeyError):
        m.prepare_load(ks(3, 9))  # 9 is absent: 3 is not pinned
    s = m.stats()
    assert (s.pinned, s.idle) == (1, 3)
    m.complete_load(ks(1))
    m.reset()
    assert (m.stats().in_use, m.stats().idle) == (0, 0)
