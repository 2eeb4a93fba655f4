"""Sessions of a trace and the hints an application sends about them.

* **Sessions** (``session_turns``). Where the trace names sessions (``TraceRequest.session_id``,
  aiperf's multi-turn format, the built-in ``agentic`` workload), those are the sessions and a
  request without one is a session of its own. Otherwise they are derived from ``hash_ids``:
  a request continues the session of the earlier request ``p`` whose full blocks (all of
  ``p``'s ids but its last, usually partial, one; at least ``min_blocks`` of them) are the
  longest prefix of its own ids, the latest such ``p`` on a tie; any other request opens a
  session.
* **Turns.** A request is a session's *resumed* turn when an earlier request of its session
  exists; its *pause* is the time from its session's previous turn's arrival to its own (a
  replay has no service time, so arrival to arrival). A turn is its session's *last* when no later one
  exists.
* **Hints** (``retain_hints``): the directives an application that knows its sessions sends
  with each request: every turn of a multi-turn session releases the session's retention
  when it arrives, and every turn but the last retains its full blocks for ``ttl_s``
  seconds once it is stored (an agent framework knows, between tool calls, that its
  session goes on, and when its task is done). A single-turn session sends nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvoffload.sessions import NO_DIRECTIVES, SessionDirectives, SessionId
from kvoffload.sim.trace import Trace, TraceRequest
from kvoffload.validation import positive_int


@dataclass(frozen=True)
class SessionTurn:
    """One request's place in its session: ``index`` 0 is the session's first turn;
    ``pause_s`` is ``None`` there, else the seconds since the previous turn arrived."""

    session: str
    index: int
    last: bool
    pause_s: float | None

    @property
    def resumed(self) -> bool:
        return self.index > 0


def session_turns(trace: Trace | Sequence[TraceRequest], min_blocks: int = 2) -> list[SessionTurn]:
    """Each request's ``SessionTurn`` (see the module docstring), in trace order."""
    positive_int("min_blocks", min_blocks)
    requests = trace.requests if isinstance(trace, Trace) else trace
    if any(r.session_id is not None for r in requests):
        names = [r.session_id if r.session_id is not None else f"#{i}" for i, r in enumerate(requests)]
    else:
        names = _derived_sessions(requests, min_blocks)
    previous: dict[str, tuple[int, int]] = {}  # session -> (index of its latest turn, turn number)
    turns: list[SessionTurn] = []
    for i, (request, name) in enumerate(zip(requests, names)):
        before = previous.get(name)
        if before is None:
            turns.append(SessionTurn(name, 0, True, None))
        else:
            j, number = before
            turns[j] = SessionTurn(name, turns[j].index, False, turns[j].pause_s)
            pause = (request.timestamp - requests[j].timestamp) / 1000.0
            turns.append(SessionTurn(name, number + 1, True, pause))
        previous[name] = (i, turns[-1].index)
    return turns


def _derived_sessions(requests: Sequence[TraceRequest], min_blocks: int) -> list[str]:
    # full-block prefix of a request -> the session of the latest request with that prefix
    by_prefix: dict[tuple[int, ...], str] = {}
    names = []
    for i, request in enumerate(requests):
        ids = request.hash_ids
        name = None
        for end in range(len(ids), min_blocks - 1, -1):
            name = by_prefix.get(ids[:end])
            if name is not None:
                break
        name = name or f"#{i}"
        names.append(name)
        if len(ids) > min_blocks:
            by_prefix[ids[:-1]] = name
    return names


def retain_hints(turns: Sequence[SessionTurn], ttl_s: float, tenant: str = "") -> list[SessionDirectives]:
    """The directives of each request under the retain model (module docstring)."""
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or not ttl_s > 0:
        raise ValueError(f"retain TTL must be a positive number of seconds, got {ttl_s!r}")
    out = []
    for turn in turns:
        if turn.index == 0 and turn.last:
            out.append(NO_DIRECTIVES)
            continue
        session = SessionId(tenant, turn.session)
        out.append(SessionDirectives(session, retain_s=None if turn.last else float(ttl_s), release=True))
    return out


def pauses(turns: Sequence[SessionTurn]) -> list[float]:
    """The pauses of the resumed turns, in trace order."""
    return [t.pause_s for t in turns if t.pause_s is not None]


def pause_quantile(turns: Sequence[SessionTurn], q: float) -> float | None:
    """The ``q`` quantile (lower) of the pauses, ``None`` without a resumed turn."""
    ordered = sorted(pauses(turns))
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else None
