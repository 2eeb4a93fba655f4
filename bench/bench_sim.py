"""Hit ratio of every eviction policy and of Belady's offline optimum (with bypass) at 1%,
5%, 10% and 25% of the unique blocks, on the Mooncake conversation trace and on the
built-in ``agentic``, ``documents`` and ``chat`` workloads, plus replay speed in requests per second.

Replay protocol (``kvoffload.sim.replay``), per request: look up its keys in the host tier
until the first non-hit, touch all of them, load the hit prefix (prepare and complete),
store the rest (prepare and complete). Every block id is one key, the trailing partial
block included; no device tier in front. Online policies run through the real
``CPUOffloadingManager``; Belady runs in ``kvoffload.sim.belady``.

Run: ``.venv/bin/python bench/bench_sim.py`` (prints a Markdown table).
"""

from __future__ import annotations

import sys

from _workloads import FRACTIONS, benchmark_traces  # noqa: E402 (bench/ is on sys.path)
from kvoffload.cpu import CPUOffloadingManager
from kvoffload.policies import available_policies
from kvoffload.sim.belady import replay_belady
from kvoffload.sim.replay import replay_keys, to_key_lists


def main() -> int:
    traces = benchmark_traces()
    policies = [*available_policies(), "belady"]
    print("| workload | policy | 1% | 5% | 10% | 25% | requests/s (slowest size) |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for label, trace in traces:
        keys = to_key_lists(trace.requests)
        unique = trace.unique_blocks()
        for policy in policies:
            ratios, slowest = [], float("inf")
            for fraction in FRACTIONS:
                blocks = max(1, int(unique * fraction))
                if policy == "belady":
                    result = replay_belady(keys, blocks)
                else:
                    result = replay_keys(CPUOffloadingManager(blocks, policy), keys)
                ratios.append(result.hit_ratio)
                slowest = min(slowest, result.requests / result.seconds)
            cells = " | ".join(f"{r:.3f}" for r in ratios)
            print(f"| {label} | {policy} | {cells} | {slowest:,.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
