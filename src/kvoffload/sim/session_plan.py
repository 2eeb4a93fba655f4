"""``kvoffload sim``'s session replay: every (policy, capacity), without and with hints.

``plan_sessions`` replays a trace (a flood laid over it first when one is given,
``kvoffload.sim.flood``) through a host tier behind the device tier of ``device_blocks``,
for every policy and capacity: once without hints and, with ``hints="retain"``, once with
the retain model of ``kvoffload.sim.sessions`` (TTL ``ttl_s``, a retention budget of
``retention_fraction`` of the tier) on the trace's clock (``kvoffload.sim.session_replay``).
Capacities are ``kvoffload.sim.planning`` specs of the trace's unique blocks, the flood's
left out. Each ``SessionRow`` gives the hit ratio over all of the trace's requests and over
its resumed turns (the flood's requests are counted in neither), and how many blocks the
hints retained and how many the budget trimmed. ``format_session_table`` prints them,
``write_session_csv`` writes every field.
"""

from __future__ import annotations

import csv
import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvoffload.cpu import CPUOffloadingManager
from kvoffload.sim.flood import Flood, inject_flood
from kvoffload.sim.planning import parse_capacity, validate_policies
from kvoffload.sim.replay import to_key_lists
from kvoffload.sim.session_replay import TraceClock, replay_with_hints, session_report
from kvoffload.sim.sessions import retain_hints, session_turns
from kvoffload.sim.tiered import device_prefixes
from kvoffload.sim.trace import Trace

HINTS = ("none", "retain")


@dataclass(frozen=True)
class SessionRow:
    """One (policy, capacity, hints) replay."""

    policy: str
    capacity: str
    blocks: int
    hints: str
    requests: int
    resumed_requests: int
    hit_ratio: float
    resumed_hit_ratio: float
    retained: int
    trimmed: int
    replay_s: float


def plan_sessions(
    trace: Trace,
    policies: Sequence[str],
    capacities: Sequence[str],
    *,
    hints: str = "none",
    ttl_s: float | None = None,
    retention_fraction: float = 0.5,
    flood: Flood | None = None,
    device_blocks: int = 0,
    block_bytes: int = 1,
    progress: Callable[[str], None] | None = None,
) -> list[SessionRow]:
    """Rows in (policy, capacity, hints) order; see the module docstring."""
    if hints not in HINTS:
        raise ValueError(f"unknown hints {hints!r}; known: {', '.join(HINTS)}")
    if hints == "retain" and ttl_s is None:
        raise ValueError("retain hints need a TTL")
    policies = validate_policies(policies)
    unique = trace.unique_blocks()
    sizes = [(spec, parse_capacity(spec, unique, block_bytes)) for spec in capacities]
    counted = None
    if flood is not None:
        flooded = inject_flood(trace, flood)
        trace, counted = flooded.trace, [not mark for mark in flooded.flood]
    turns = session_turns(trace)
    key_lists = to_key_lists(trace.requests)
    served = device_prefixes(key_lists, device_blocks)
    modes = [("none", None)]
    if hints == "retain":
        modes.append(("retain", retain_hints(turns, ttl_s)))
    rows = []
    for name in policies:
        for spec, blocks in sizes:
            for mode, directives in modes:
                if progress:
                    progress(f"{name} @ {spec}, hints {mode}")
                clock = TraceClock()
                tier = CPUOffloadingManager(blocks, name, retention_fraction=retention_fraction, clock=clock)
                start = time.perf_counter()
                hits = replay_with_hints(
                    tier, clock, trace.requests, key_lists, trace.block_size, directives, served
                )
                seconds = time.perf_counter() - start
                report = session_report(hits, key_lists, turns, counted)
                counts = tier.retention.counts
                rows.append(
                    SessionRow(
                        name,
                        spec,
                        blocks,
                        mode,
                        report.requests,
                        report.resumed_requests,
                        report.hit_ratio,
                        report.resumed_hit_ratio,
                        counts.retained,
                        counts.trimmed,
                        seconds,
                    )
                )
    return rows


def format_session_table(rows: Sequence[SessionRow]) -> str:
    """A fixed-width table of the rows."""
    header = (
        f"{'policy':<10} {'capacity':>9} {'blocks':>9} {'hints':>6} {'hit ratio':>9} "
        f"{'resumed':>8} {'retained':>10} {'trimmed':>9}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r.policy:<10} {r.capacity:>9} {r.blocks:>9,} {r.hints:>6} {r.hit_ratio:>9.3f} "
            f"{r.resumed_hit_ratio:>8.3f} {r.retained:>10,} {r.trimmed:>9,}"
        )
    return "\n".join(lines)


def write_session_csv(rows: Sequence[SessionRow], path: str | Path) -> None:
    """Every field of every row."""
    names = [f.name for f in dataclasses.fields(SessionRow)]
    with Path(path).open("w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)
        writer.writerow(names)
        for row in rows:
            writer.writerow([f"{v:.6g}" if isinstance(v, float) else v for v in dataclasses.astuple(row)])
