"""Session controls through the scheduler (``scheduler.sessions``): requests' directives
(retain when finished, release and prefetch on arrival, tier choice) and the controls an
endpoint calls, over the CPU tier and a tiered manager, with a fake clock."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvoffload.cpu import CPUOffloadingManager
from kvoffload.scheduler import KVGroup, OffloadingScheduler, StepRequest
from kvoffload.scheduler.sessions import SessionRegistry
from kvoffload.sessions import RetainOutcome, SessionDirectives, SessionId, TierChoice
from kvoffload.tiers.tiered import TieredOffloadingManager
from manual_clock import ManualClock
from scheduler_requests import Req
from shelf_tier import Shelf

A = SessionId("tenant-a", "chat")
B = SessionId("tenant-b", "chat")  # the same name in another tenant


def cpu_scheduler(blocks=8, fraction=0.5):
    clock = ManualClock(100.0)
    cpu = CPUOffloadingManager(blocks, "lru", retention_fraction=fraction, clock=clock)
    sched = OffloadingScheduler(cpu, [KVGroup(4)], hash_block_size=4)
    sched.sessions = SessionRegistry(cpu, clock=clock)
    return clock, cpu, sched


def tiered_scheduler(cpu_blocks=4, shelf_blocks=32):
    clock = ManualClock(100.0)
    primary = CPUOffloadingManager(cpu_blocks, "lru", retention_fraction=0.5, clock=clock)
    shelf = Shelf(shelf_blocks, "lru", retention_fraction=0.5, clock=clock)
    tiered = TieredOffloadingManager(primary, [shelf])
    sched = OffloadingScheduler(tiered, [KVGroup(4)], hash_block_size=4)
    sched.sessions = SessionRegistry(tiered, clock=clock)
    return clock, primary, shelf, sched


def serve(sched, req_id, tokens, directives=None, blocks=None):
    """One request: matched, prefilled (its whole blocks stored), finished."""
    req = Req(req_id, tokens)
    n = sched.match(req, 0, directives=directives)
    blocks = blocks or [list(range(len(tokens) // 4 + 1))]
    sched.on_allocated(req_id, blocks, n or 0)
    plan = sched.build_step([StepRequest(req_id, None, len(tokens))])
    sched.complete_jobs([(job.job_id, True) for job in plan.loads + plan.stores])
    assert not sched.request_finished(req_id)
    return n, plan


def settle(sched):
    """Run the transfers between tiers until none is left (as the worker would)."""
    for _ in range(10):
        plan = sched.build_step([])
        if not plan.transfers:
            return
        sched.complete_jobs([(job.job_id, True) for job in plan.transfers])


def test_a_finished_request_of_a_session_is_retained_past_pressure_until_its_ttl():
    clock, cpu, sched = cpu_scheduler()
    serve(sched, "a", list(range(9)), SessionDirectives(A, retain_s=30))  # two blocks
    retained = sched.sessions.inspect(A)
    assert len(retained) == 2 and {b.medium for b in retained} == {"CPU"}
    assert {b.until for b in retained} == {clock.now + 30}
    for i in range(6):  # others' prompts fill the tier over and over
        serve(sched, f"o{i}", list(range(1000 * (i + 1), 1000 * (i + 1) + 17)))
    assert all(cpu.state(b.key) == 0 for b in retained)
    again = Req("a2", list(range(9)))
    assert sched.match(again, 0) == 8  # the session's next turn finds its blocks
    sched.request_finished("a2")
    clock.now += 30
    assert sched.sessions.inspect(A) == []
    for i in range(6):
        serve(sched, f"p{i}", list(range(50000 + 100 * i, 50000 + 100 * i + 17)))
    assert all(cpu.state(b.key) is None for b in retained)
    assert sched.sessions.stats().expired == 2


def test_controls_retain_release_and_inspect_the_sessions_last_keys():
    clock, cpu, sched = cpu_scheduler()
    sessions = sched.sessions
    assert not sessions.known(A) and sessions.retain(A, 10) == RetainOutcome()
    serve(sched, "a", list(range(13)), SessionDirectives(A))  # three blocks, no retention asked
    assert sessions.known(A) and sessions.inspect(A) == []
    assert sessions.retain(A, 10) == RetainOutcome(retained=3)
    assert [b.key for b in sessions.inspect(A)] == cpu.keys()  # head to tail
    assert sessions.release(A) == 3 and sessions.inspect(A) == []
    stats = sessions.stats()
    assert (stats.retains, stats.retained, stats.releases, stats.released) == (2, 3, 1, 3)


def test_a_retention_over_the_budget_is_trimmed_tail_first_and_counted():
    clock, cpu, sched = cpu_scheduler(blocks=8, fraction=0.25)  # two blocks
    serve(sched, "a", list(range(17)), SessionDirectives(A, retain_s=5))  # four blocks
    keys = list(cpu.keys())[:4]
    assert [b.key for b in sched.sessions.inspect(A)] == keys[:2]
    assert sched.sessions.stats().trimmed == 2


def test_another_tenants_session_of_the_same_name_reaches_nothing():
    clock, primary, shelf, sched = tiered_scheduler()
    serve(sched, "a", list(range(9)), SessionDirectives(A, retain_s=60))
    settle(sched)
    mine = sched.sessions.inspect(A)
    keys = list(dict.fromkeys(b.key for b in mine))
    assert len(keys) == 2
    sessions = sched.sessions
    assert not sessions.known(B)
    assert sessions.inspect(B) == []
    assert sessions.retain(B, 60) == RetainOutcome()
    assert sessions.retain(B, 60, keys) == RetainOutcome(absent=2)  # refused: A's keys
    assert sessions.prefetch(B) == 0 and sessions.prefetch(B, keys) == 0
    assert sessions.release(B) == 0
    assert sessions.inspect(A) == mine  # A's retention untouched
    assert sessions.stats().tenant_refusals == 4
    assert sessions.retain(A, 60, keys).retained == 4  # its own keys: both tiers


def test_release_on_arrival_ends_the_sessions_retention():
    clock, cpu, sched = cpu_scheduler()
    serve(sched, "a", list(range(9)), SessionDirectives(A, retain_s=60))
    assert len(sched.sessions.inspect(A)) == 2
    serve(sched, "b", list(range(500, 505)), SessionDirectives(A, release=True))
    assert sched.sessions.inspect(A) == []


def test_prefetch_on_arrival_promotes_the_sessions_blocks_from_below():
    clock, primary, shelf, sched = tiered_scheduler(cpu_blocks=4)
    serve(sched, "a", list(range(9)), SessionDirectives(A))
    settle(sched)
    last = shelf.keys()
    for i in range(3):  # push the session's blocks out of the CPU tier
        serve(sched, f"o{i}", list(range(1000 * (i + 1), 1000 * (i + 1) + 9)))
        settle(sched)
    assert [primary.state(key) for key in last] == [None, None]
    other = Req("b", list(range(7000, 7003)))  # shares nothing with the session's blocks
    assert sched.match(other, 0, directives=SessionDirectives(A, prefetch=True)) == 0
    (promotion,) = sched.build_step([]).transfers
    assert (promotion.src_spec.medium, promotion.dst_spec.medium) == ("SHELF", "CPU")
    sched.complete_jobs([(promotion.job_id, True)])
    assert [primary.state(key) for key in last] == [0, 0]
    assert sched.sessions.stats().prefetched == 2


def test_a_one_off_prompt_is_stored_nowhere():
    clock, primary, shelf, sched = tiered_scheduler()
    _, plan = serve(sched, "a", list(range(9)), SessionDirectives(tiers=TierChoice.of(store_to=[])))
    assert plan.stores == [] and primary.stats().used == 0
    settle(sched)
    assert shelf.stats().used == 0
    serve(sched, "b", list(range(9)))  # the same prompt without a choice is stored
    assert primary.stats().used == 2


def test_store_to_cpu_only_keeps_blocks_out_of_the_lower_tiers():
    clock, primary, shelf, sched = tiered_scheduler(cpu_blocks=8)
    serve(sched, "a", list(range(9)), SessionDirectives(tiers=TierChoice.of(store_to=["cpu"])))
    assert primary.stats().used == 2
    assert sched.build_step([]).transfers == []  # no write-through
    serve(sched, "b", list(range(100, 109)))
    settle(sched)
    assert shelf.stats().used == 2 and primary.stats().used == 4  # b's only


def test_load_from_cpu_only_promotes_nothing_and_without_cpu_loads_nothing():
    clock, primary, shelf, sched = tiered_scheduler(cpu_blocks=4)
    serve(sched, "a", list(range(9)))
    settle(sched)
    cpu_only = SessionDirectives(tiers=TierChoice.of(load_from=["CPU"]))
    assert sched.match(Req("b", list(range(9))), 0, directives=cpu_only) == 8  # held in CPU
    sched.request_finished("b")
    for i in range(3):
        serve(sched, f"o{i}", list(range(1000 * (i + 1), 1000 * (i + 1) + 9)))
        settle(sched)
    assert sched.match(Req("c", list(range(9))), 0, directives=cpu_only) == 0  # in SHELF only
    assert sched.build_step([]).transfers == []  # and not promoted
    sched.request_finished("c")
    nothing = SessionDirectives(tiers=TierChoice.of(load_from=[]))
    serve(sched, "d", list(range(9)))
    assert sched.match(Req("e", list(range(9))), 0, directives=nothing) == 0
    assert sched.match(Req("f", list(range(9))), 0) == 8


def test_sessions_remembered_are_bounded_oldest_forgotten():
    clock, cpu, sched = cpu_scheduler()
    sched.sessions = SessionRegistry(cpu, clock=clock, max_sessions=2)
    names = [SessionId("t", f"s{i}") for i in range(3)]
    for i, session in enumerate(names):
        serve(sched, f"r{i}", list(range(10 * i, 10 * i + 5)), SessionDirectives(session))
    assert [sched.sessions.known(s) for s in names] == [False, True, True]
    assert sched.sessions.stats().sessions_forgotten == 1


def test_bad_values_are_named():
    clock, cpu, sched = cpu_scheduler()
    with pytest.raises(ValueError, match="ttl_s"):
        sched.sessions.retain(A, 0)
    with pytest.raises(ValueError, match="retain_s"):
        SessionDirectives(A, retain_s=-1)
    with pytest.raises(TypeError, match="SessionId"):
        sched.sessions.release("chat")
    with pytest.raises(ValueError, match="session or keys"):
        sched.sessions.prefetch()
    with pytest.raises(ValueError, match="max_sessions"):
        SessionRegistry(cpu, max_sessions=0)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["serve", "retain", "release", "prefetch", "tick"]),
            st.sampled_from(["tenant-a", "tenant-b"]),
            st.sampled_from(["x", "y"]),
            st.integers(0, 3),
        ),
        max_size=25,
    )
)
def test_no_control_ever_reaches_another_tenants_blocks(ops):
    """Random requests and controls of two tenants using the same session names: what a
    session retains are always blocks its own tenant's requests produced."""
    clock, primary, shelf, sched = tiered_scheduler(cpu_blocks=6, shelf_blocks=12)
    produced: dict[str, set] = {"tenant-a": set(), "tenant-b": set()}
    for n, (op, tenant, name, prompt) in enumerate(ops):
        session = SessionId(tenant, name)
        if op == "serve":
            tokens = list(range(prompt * 8, prompt * 8 + 9))
            req = Req(f"r{n}", tokens)
            req.block_hashes = None  # hashed by the scheduler with the tenant's salt
            req.hashed, req.cache_salt = False, tenant
            before = set(primary.keys())
            n_tokens = sched.match(req, 0, directives=SessionDirectives(session, retain_s=5))
            sched.on_allocated(req.request_id, [[0, 1, 2]], n_tokens or 0)
            plan = sched.build_step([StepRequest(req.request_id, None, 9)])
            sched.complete_jobs([(job.job_id, True) for job in plan.loads + plan.stores])
            produced[tenant] |= set(primary.keys()) - before
            sched.request_finished(req.request_id)
        elif op == "retain":
            sched.sessions.retain(session, 5, list(produced["tenant-a"] | produced["tenant-b"]))
        elif op == "release":
            sched.sessions.release(session)
        elif op == "prefetch":
            sched.sessions.prefetch(session, list(produced["tenant-a"] | produced["tenant-b"]))
        else:
            clock.now += 2
        settle(sched)
        for t in produced:
            for s in ("x", "y"):
                held = {b.key for b in sched.sessions.inspect(SessionId(t, s))}
                other = "tenant-b" if t == "tenant-a" else "tenant-a"
                assert not held & (produced[other] - produced[t])


def test_a_request_load_goes_first_with_a_flood_of_prefetches_queued():
    """Prefetches queued by the thousand: a request whose prefix is below the CPU tier has
    its promotion and its load (chained on it) in the very step it is allocated, and no
    prefetch rides in that step; prefetches go on in the steps after, a few at a time."""
    clock, primary, shelf, sched = tiered_scheduler(cpu_blocks=8, shelf_blocks=256)
    for i in range(40):  # forty two-block prompts, written through to the shelf
        serve(sched, f"o{i}", list(range(1000 * (i + 1), 1000 * (i + 1) + 9)))
        settle(sched)
    held_below = shelf.keys()
    flood = [key for key in held_below if primary.state(key) is None]
    assert sched.sessions.prefetch(keys=flood) == len(flood) > 60
    req = Req("r", list(range(1000, 1009)))  # the first prompt again: below the CPU tier
    n = sched.match(req, 0)
    assert n == 8
    sched.on_allocated("r", [[0, 1, 2]], n)
    plan = sched.build_step([StepRequest("r", None, 9)])
    assert len(plan.loads) == 1 and len(plan.transfers) == 1  # its promotion, nothing else
    sched.complete_jobs([(job.job_id, True) for job in plan.transfers + plan.loads + plan.stores])
    later = sched.build_step([]).transfers
    assert 1 <= len(later) <= 2  # prefetches: prefetch_in_flight at most
