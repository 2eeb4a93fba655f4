"""Sessions in the simulator: trace fields, derivation, hints, flood, replay and reports."""

from __future__ import annotations

import json

import pytest

from kvoffload.cpu import CPUOffloadingManager
from kvoffload.sessions import NO_DIRECTIVES, SessionId
from kvoffload.sim.flood import Flood, inject_flood
from kvoffload.sim.replay import to_key_lists
from kvoffload.sim.session_plan import plan_sessions
from kvoffload.sim.session_replay import TraceClock, replay_with_hints, session_report
from kvoffload.sim.sessions import pauses, retain_hints, session_turns
from kvoffload.sim.trace import Trace, TraceFormatError, TraceRequest, read_trace
from kvoffload.sim.workloads import builtin_workload

BS = 16


def req(t_ms: int, ids, session: str | None = None, partial: bool = True) -> TraceRequest:
    """A request whose last id is a partial block when ``partial``."""
    full = len(ids) - 1 if partial else len(ids)
    return TraceRequest(t_ms, full * BS + (BS // 2 if partial else 0), 1, tuple(ids), session)


def write_lines(path, objs) -> None:
    path.write_text("".join(json.dumps(o) + "\n" for o in objs))


# -- trace format ----------------------------------------------------------------------


def test_session_ids_and_delays_are_read_and_ordered(tmp_path):
    path = tmp_path / "t.jsonl"
    write_lines(
        path,
        [
            {"session_id": "a", "timestamp": 0, "input_length": 20, "hash_ids": [1, 2]},
            {"session_id": "a", "delay": 5000, "input_length": 40, "hash_ids": [1, 3, 4]},
            {"session_id": 7, "timestamp": 1000, "input_length": 20, "hash_ids": [5, 6]},
            {"session_id": 7, "delay": 500, "input_length": 20, "hash_ids": [5, 7]},
        ],
    )
    trace = read_trace(path, BS)
    assert [(r.timestamp, r.session_id) for r in trace.requests] == [
        (0, "a"),
        (1000, "7"),
        (1500, "7"),
        (5000, "a"),
    ]


def test_plain_lines_have_no_session_and_keep_their_order(tmp_path):
    path = tmp_path / "t.jsonl"
    write_lines(
        path,
        [
            {"timestamp": 9, "input_length": 1, "hash_ids": [1]},
            {"timestamp": 3, "input_length": 1, "hash_ids": [2]},
        ],
    )
    trace = read_trace(path, BS)
    assert [(r.timestamp, r.session_id) for r in trace.requests] == [(9, None), (3, None)]


@pytest.mark.parametrize(
    "lines, named",
    [
        ([{"delay": 5, "input_length": 1, "hash_ids": [1]}], "line 1: a delay needs a session_id"),
        ([{"session_id": "s", "delay": 5, "input_length": 1, "hash_ids": [1]}], "session 's'"),
        ([{"session_id": "", "timestamp": 0, "input_length": 1, "hash_ids": [1]}], "session_id"),
        ([{"session_id": "s", "timestamp": 0, "delay": -1, "input_length": 1, "hash_ids": [1]}], "delay"),
    ],
)
def test_bad_session_fields_are_named(tmp_path, lines, named):
    path = tmp_path / "t.jsonl"
    write_lines(path, lines)
    with pytest.raises(TraceFormatError, match=named):
        read_trace(path, BS)


# -- sessions and hints ----------------------------------------------------------------


def test_sessions_are_derived_from_extended_prefixes():
    requests = [
        req(0, [0, 1, 2, 100]),  # opens session #0
        req(1000, [0, 7, 101]),  # only the shared block 0 in common: opens #1
        req(4000, [0, 1, 2, 3, 102]),  # extends request 0
        req(9000, [0, 1, 2, 3, 4, 103]),  # extends request 2
        req(9500, [0, 1, 104]),  # request 0's full blocks are not a prefix: opens #4
    ]
    turns = session_turns(requests)
    assert [t.session for t in turns] == ["#0", "#1", "#0", "#0", "#4"]
    assert [(t.index, t.last) for t in turns] == [(0, False), (0, True), (1, False), (2, True), (0, True)]
    assert pauses(turns) == [4.0, 5.0]
    assert [t.resumed for t in turns] == [False, False, True, True, False]


def test_named_sessions_win_and_unnamed_requests_stand_alone():
    requests = [req(0, [0, 1, 2, 9], "x"), req(10, [0, 1, 2, 3, 8]), req(20, [5, 6], "x")]
    turns = session_turns(requests)
    assert [(t.session, t.index) for t in turns] == [("x", 0), ("#1", 0), ("x", 1)]


def test_builtin_agentic_workload_names_its_sessions():
    trace = builtin_workload("agentic")
    turns = session_turns(trace)
    sessions = {r.session_id for r in trace.requests}
    assert len(sessions) == 200 and None not in sessions
    assert sum(t.resumed for t in turns) == len(trace.requests) - len(sessions)


def test_retain_hints_follow_the_turns():
    turns = session_turns([req(0, [1, 2, 9], "a"), req(0, [5, 9], "solo"), req(5, [1, 2, 3, 9], "a")])
    first, solo, last = retain_hints(turns, 30.0, tenant="t")
    assert solo is NO_DIRECTIVES
    assert first.session == SessionId("t", "a") and first.retain_s == 30.0 and first.release
    assert last.session == SessionId("t", "a") and last.retain_s is None and last.release
    with pytest.raises(ValueError, match="TTL"):
        retain_hints(turns, 0)


# -- flood -----------------------------------------------------------------------------


def test_flood_bursts_are_fresh_and_marked():
    trace = Trace([req(0, [1, 2, 3, 9]), req(25_000, [1, 2, 3, 4, 10])], BS, "t")
    flooded = inject_flood(trace, Flood(every_s=10.0, blocks=10, request_blocks=4, spread_s=1.0))
    requests, marks = flooded.trace.requests, flooded.flood
    assert [r for r, m in zip(requests, marks) if not m] == trace.requests
    flood = [r for r, m in zip(requests, marks) if m]
    bursts = [5000, 15000, 25000]  # from every_s / 2 to the last arrival
    assert [r.timestamp for r in flood] == [t + dt for t in bursts for dt in (0, 333, 666)]
    assert [len(r.hash_ids) for r in flood] == [4, 4, 2] * 3
    ids = [h for r in flood for h in r.hash_ids]
    assert len(set(ids)) == len(ids) and min(ids) > 10
    assert [r.timestamp for r in requests] == sorted(r.timestamp for r in requests)


@pytest.mark.parametrize("kwargs", [{"every_s": 0, "blocks": 4}, {"every_s": 1, "blocks": 0}])
def test_bad_floods_are_refused(kwargs):
    with pytest.raises(ValueError):
        Flood(**kwargs)


# -- replay ----------------------------------------------------------------------------


def paused_session(ttl_gap_ms: int = 10_000) -> list[TraceRequest]:
    """A session's turn, two one-off requests filling an 8-block tier, then its next turn."""
    return [
        req(0, [1, 2, 3, 4, 90], "s"),
        req(1000, [11, 12, 13, 14, 91]),
        req(2000, [21, 22, 23, 24, 92]),
        req(ttl_gap_ms, [1, 2, 3, 4, 5, 93], "s"),
    ]


def replay(requests, policy: str, hints: bool, ttl: float = 60.0) -> list[int]:
    clock = TraceClock()
    tier = CPUOffloadingManager(8, policy, retention_fraction=0.5, clock=clock)
    turns = session_turns(requests)
    directives = retain_hints(turns, ttl) if hints else None
    return replay_with_hints(tier, clock, requests, to_key_lists(requests), BS, directives)


def test_a_resumed_turn_hits_with_hints_and_misses_with_lru_at_equal_capacity():
    requests = paused_session()
    assert replay(requests, "lru", hints=False)[-1] == 0
    assert replay(requests, "lru", hints=True)[-1] == 4
    assert replay(requests, "turnlru", hints=True)[-1] == 4


def test_retention_ends_at_its_ttl_on_the_trace_clock():
    # retained until 0.5 s: the one-off requests at 1 s and 2 s push the session out
    assert replay(paused_session(), "lru", hints=True, ttl=0.5)[-1] == 0


def test_session_report_splits_resumed_turns_and_leaves_out_uncounted():
    requests = paused_session()
    keys = to_key_lists(requests)
    turns = session_turns(requests)
    report = session_report([0, 0, 0, 4], keys, turns, counted=[True, False, True, True])
    assert (report.requests, report.keys, report.hits) == (3, 16, 4)
    assert (report.resumed_requests, report.resumed_keys, report.resumed_hits) == (1, 6, 4)
    assert report.hit_ratio == 0.25 and report.resumed_hit_ratio == pytest.approx(4 / 6)
    with pytest.raises(ValueError):
        session_report([0], keys, turns)


def test_plan_sessions_rows_with_hints_and_flood():
    trace = Trace(paused_session(), BS, "t")
    rows = plan_sessions(
        trace,
        ["lru"],
        ["8"],
        hints="retain",
        ttl_s=60.0,
        flood=Flood(every_s=4.0, blocks=8, request_blocks=4),
    )
    assert [(r.policy, r.capacity, r.blocks, r.hints) for r in rows] == [
        ("lru", "8", 8, "none"),
        ("lru", "8", 8, "retain"),
    ]
    none, retain = rows
    assert none.requests == retain.requests == 4 and none.resumed_requests == 1
    assert none.resumed_hit_ratio == 0.0 and retain.resumed_hit_ratio == pytest.approx(4 / 6)
    assert retain.retained >= 4 and none.retained == 0
    with pytest.raises(ValueError, match="hints"):
        plan_sessions(trace, ["lru"], ["8"], hints="prefetch")
