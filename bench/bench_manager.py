"""Replay the Mooncake conversation trace through CPUOffloadingManager, per policy.

Protocol per request (what a scheduler does): look up keys until the first non-hit, touch
all, load the hit prefix (prepare + complete), store the rest (prepare + complete).
Capacities are fractions of the trace's unique blocks. Throughput is block keys of the
request stream per second of wall time, best of ``--repeat`` runs.

    .venv/bin/python bench/bench_manager.py [--trace PATH] [--repeat N] [--policies lru,arc]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from _workloads import FRACTIONS  # noqa: E402 (bench/ is on sys.path)
from _workloads import MOONCAKE_TRACE as DEFAULT_TRACE
from kvoffload.cpu import CPUOffloadingManager
from kvoffload.sim.replay import replay_keys, to_key_lists
from kvoffload.sim.trace import read_trace


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--policies", default="lru,arc")
    args = parser.parse_args()
    if not args.trace.exists():
        print(f"trace not found: {args.trace}", file=sys.stderr)
        return 1
    trace = read_trace(args.trace)
    unique = trace.unique_blocks()
    key_lists = to_key_lists(trace.requests)
    print(
        f"trace {args.trace.name}: {len(trace.requests)} requests, {trace.block_references()} keys, "
        f"{unique} unique"
    )
    print()
    print(f"| policy | capacity | blocks | hit ratio | keys/s (best of {args.repeat}) |")
    print("|---|---:|---:|---:|---:|")
    for policy in args.policies.split(","):
        for frac in FRACTIONS:
            blocks = int(unique * frac)
            runs = [replay_keys(CPUOffloadingManager(blocks, policy), key_lists) for _ in range(args.repeat)]
            best = max(r.keys_per_second for r in runs)
            print(f"| {policy} | {frac:.0%} | {blocks} | {runs[0].hit_ratio:.4f} | {best:,.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
