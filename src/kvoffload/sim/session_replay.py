"""Replay of a trace with session hints, and a report split into resumed turns and all.

``replay_with_hints`` drives one host tier through the requests in arrival order, the
tiered protocol of ``kvoffload.sim.tiered`` with the request's ``SessionDirectives``
around it:

1. the tier's clock (a ``TraceClock`` the caller built the tier with) is set to the
   request's arrival, in trace seconds, so retention deadlines run on the trace's time;
2. ``release``: the session's retention ends (its blocks stay where they are);
3. the device tier serves ``served[i]`` leading blocks, the host tier the next ones up to
   its first miss; the host's policy is touched with all the keys, the hit loaded, the
   rest stored;
4. ``retain_s``: the request's full blocks (``input_length // block_size`` of its keys; a
   partial last block never recurs) are retained until its arrival plus ``retain_s``.

It returns each request's hit blocks (device and host). Without directives it is the
plain tiered replay. ``session_report`` sums them over the counted requests (the flood's
are left out: they can never hit) into all turns and resumed turns (``SessionTurn``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvoffload.keys import OffloadKey
from kvoffload.manager import OffloadingManager
from kvoffload.sessions import SessionDirectives
from kvoffload.sim.sessions import SessionTurn
from kvoffload.sim.trace import TraceRequest


class TraceClock:
    """A clock whose time the replay sets (seconds); pass it as a tier's ``clock``."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass(frozen=True)
class SessionReport:
    """Hit blocks over all counted requests and over their resumed turns."""

    requests: int
    keys: int
    hits: int
    resumed_requests: int
    resumed_keys: int
    resumed_hits: int

    @property
    def hit_ratio(self) -> float:
        return self.hits / self.keys if self.keys else 0.0

    @property
    def resumed_hit_ratio(self) -> float:
        return self.resumed_hits / self.resumed_keys if self.resumed_keys else 0.0


def replay_with_hints(
    host: OffloadingManager,
    clock: TraceClock,
    requests: Sequence[TraceRequest],
    key_lists: Sequence[Sequence[OffloadKey]],
    block_size: int,
    directives: Sequence[SessionDirectives] | None = None,
    served: Sequence[int] | None = None,
) -> list[int]:
    """Each request's hit blocks under the protocol of the module docstring."""
    if len(requests) != len(key_lists) or any(
        other is not None and len(other) != len(requests) for other in (directives, served)
    ):
        raise ValueError("requests, key_lists, directives and served must have one entry per request")
    lookup_prefix, touch = host.lookup_prefix, host.touch
    out = []
    for i, (request, keys) in enumerate(zip(requests, key_lists)):
        clock.now = request.timestamp / 1000.0
        hint = directives[i] if directives is not None else None
        if hint is not None and hint.release and hint.session is not None:
            host.release(hint.session)
        d = served[i] if served is not None else 0
        rest = keys[d:] if d else keys
        h = lookup_prefix(rest)
        touch(keys)
        if h:
            host.prepare_load(rest[:h])
            host.complete_load(rest[:h])
        if d + h < len(keys):
            stored = host.prepare_store(rest[h:])
            if stored is not None:
                host.complete_store(stored.keys_to_store)
        if hint is not None and hint.retain_s is not None and hint.session is not None:
            full = keys[: request.input_length // block_size]
            if full:
                host.retain(hint.session, full, clock.now + hint.retain_s)
        out.append(d + h)
    return out


def session_report(
    hits: Sequence[int],
    key_lists: Sequence[Sequence[OffloadKey]],
    turns: Sequence[SessionTurn],
    counted: Sequence[bool] | None = None,
) -> SessionReport:
    """Sums of ``hits`` and keys over the counted requests (all by default), and over the
    resumed turns among them."""
    if not len(hits) == len(key_lists) == len(turns) or (counted is not None and len(counted) != len(hits)):
        raise ValueError("hits, key_lists, turns and counted must have one entry per request")
    requests = keys = hit = r_requests = r_keys = r_hits = 0
    for i, (h, ks, turn) in enumerate(zip(hits, key_lists, turns)):
        if counted is not None and not counted[i]:
            continue
        requests += 1
        keys += len(ks)
        hit += h
        if turn.resumed:
            r_requests += 1
            r_keys += len(ks)
            r_hits += h
    return SessionReport(requests, keys, hit, r_requests, r_keys, r_hits)
