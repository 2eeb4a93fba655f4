"""Estimated best hit ratio of online policies that decide by (class, block age), at
1%, 5%, 10% and 25% of the unique blocks, on the Mooncake conversation trace and on the
built-in ``agentic``, ``documents`` and ``chat`` workloads.

Each row is ``kvoffload.sim.ttl_bound.ttl_bound`` for one feature set (request features,
plus ``freq``: how many earlier requests named the block; class-chosen TTLs,
fractional admission, average-occupancy budget, no prefix constraint: a relaxation, not
a proof), and ``oracle`` the same LP with each reference's exact reuse gap as its class.
Hit ratio = hit block ids / all block ids, the trailing block included, as in
``bench/bench_sim.py``; compare with its LRU, best online policy and Belady rows.

Run: ``.venv/bin/python bench/bench_policy_bound.py`` (prints a Markdown table).
"""

from __future__ import annotations

import sys
import time

from _workloads import FRACTIONS, benchmark_traces  # noqa: E402 (bench/ is on sys.path)
from kvoffload.sim.ttl_bound import (
    FEATURE_SETS,
    block_references,
    oracle_bound,
    reference_classes,
    request_features,
    ttl_bound,
)


def main() -> int:
    traces = benchmark_traces()
    print("| workload | classes by | classes | 1% | 5% | 10% | 25% |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for label, trace in traces:
        start = time.perf_counter()
        refs, features = block_references(trace.requests), request_features(trace.requests)
        capacities = [max(1, int(trace.unique_blocks() * fraction)) for fraction in FRACTIONS]
        for feature_set in FEATURE_SETS:
            classes = reference_classes(refs, features, feature_set)
            cells = " | ".join(f"{ttl_bound(refs, classes, c):.3f}" for c in capacities)
            print(f"| {label} | {feature_set} | {classes.max() + 1} | {cells} |", flush=True)
        cells = " | ".join(f"{oracle_bound(refs, c):.3f}" for c in capacities)
        print(f"| {label} | oracle (exact gap) | – | {cells} |", flush=True)
        print(f"({label}: {time.perf_counter() - start:.2f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
