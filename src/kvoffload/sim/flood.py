"""A cache flood: bursts of one-off requests laid over a trace.

``inject_flood(trace, flood)`` returns the trace with, every ``every_s`` seconds from
``every_s / 2`` until the trace's last arrival, a burst of ``blocks`` blocks cut into
requests of ``request_blocks`` full blocks each, spread evenly over ``spread_s`` seconds.
Every flood block id is new (above the trace's largest), so nothing in a burst is ever
reused: under LRU a burst at least as large as the host tier pushes out everything older,
and the sessions paused across it come back to an empty tier. The result keeps the trace's
requests in order, the flood's merged in by arrival (a trace request first on a tie), and
says which requests are the flood's, so that reports can leave them out.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvoffload.sim.trace import Trace, TraceRequest


@dataclass(frozen=True)
class Flood:
    """A burst of ``blocks`` one-off blocks every ``every_s`` seconds (see the module doc)."""

    every_s: float
    blocks: int
    request_blocks: int = 16
    spread_s: float = 1.0

    def __post_init__(self) -> None:
        if not self.every_s > 0:
            raise ValueError(f"flood period must be positive seconds, got {self.every_s!r}")
        if self.blocks <= 0 or self.request_blocks <= 0:
            raise ValueError(
                f"flood blocks and blocks per request must be positive, "
                f"got {self.blocks} and {self.request_blocks}"
            )
        if not self.spread_s >= 0:
            raise ValueError(f"flood spread must be seconds >= 0, got {self.spread_s!r}")


@dataclass(frozen=True)
class FloodedTrace:
    """A trace with a flood in it; ``flood[i]`` is true for the flood's requests."""

    trace: Trace
    flood: list[bool]


def inject_flood(trace: Trace, flood: Flood) -> FloodedTrace:
    """``trace`` with ``flood`` laid over it (module docstring)."""
    requests = trace.requests
    if not requests:
        return FloodedTrace(trace, [])
    next_id = max((max(r.hash_ids) for r in requests if r.hash_ids), default=-1) + 1
    end_ms = max(r.timestamp for r in requests)
    per_burst = -(-flood.blocks // flood.request_blocks)
    extra: list[TraceRequest] = []
    start_s = flood.every_s / 2
    while start_s * 1000 <= end_ms:
        left = flood.blocks
        for k in range(per_burst):
            n = min(flood.request_blocks, left)
            left -= n
            at_ms = int((start_s + flood.spread_s * k / per_burst) * 1000)
            ids = tuple(range(next_id, next_id + n))
            next_id += n
            extra.append(TraceRequest(at_ms, n * trace.block_size, 1, ids))
        start_s += flood.every_s
    extra.sort(key=lambda r: r.timestamp)  # bursts overlap when spread_s > every_s
    merged: list[TraceRequest] = []
    marks: list[bool] = []
    j = 0
    for request in requests:
        while j < len(extra) and extra[j].timestamp < request.timestamp:
            merged.append(extra[j])
            marks.append(True)
            j += 1
        merged.append(request)
        marks.append(False)
    merged += extra[j:]
    marks += [True] * (len(extra) - j)
    return FloodedTrace(Trace(merged, trace.block_size, f"{trace.name}+flood"), marks)
