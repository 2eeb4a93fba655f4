"""The traces every policy benchmark replays: the Mooncake conversation trace (when the
shared directory holds it) and the built-in ``agentic``, ``documents`` and ``chat``
workloads (default parameters, seed 0), at 1%, 5%, 10% and 25% of their unique blocks."""

from __future__ import annotations

import sys
from pathlib import Path

from kvoffload.sim.trace import Trace, read_trace
from kvoffload.sim.workloads import builtin_workload

MOONCAKE_TRACE = (
    Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_fast25_conversation_trace.jsonl"
)
FRACTIONS = (0.01, 0.05, 0.10, 0.25)


def benchmark_traces() -> list[tuple[str, Trace]]:
    """(label, trace) pairs; the Mooncake trace is skipped with a note when absent."""
    traces = []
    if MOONCAKE_TRACE.exists():
        traces.append(("conversation (Mooncake)", read_trace(MOONCAKE_TRACE)))
    else:
        print(f"(skipping the Mooncake trace: {MOONCAKE_TRACE} not found)", file=sys.stderr)
    traces += [
        (f"{name} (generated, seed 0)", builtin_workload(name)) for name in ("agentic", "documents", "chat")
    ]
    return traces
