"""Disk-tier admission: write every block through to disk, or only blocks seen twice
(Dynamo KVBM's rule)? Measured with the simulator on the Mooncake conversation trace and
the built-in ``agentic``, ``documents`` and ``chat`` workloads, CPU tier at 1% and 5% and
disk tier at 10%, 25% and 100% of each trace's unique blocks, LRU in both tiers, no device
tier in front.

Replay protocol: ``kvoffload.sim.disk`` (the real ``TieredOffloadingManager``; promotions
and write-through copies complete at once). "seen twice" is
``kvoffload.tiers.admission.SeenTwice``: a block is *seen* each time a store of it completes
in the CPU tier (it was computed by prefill), and goes to disk from its second time on; the
memory of keys seen holds as many keys as the disk tier has blocks (a second table varies
it). Hit ratios are of all block references; "disk GB w" is what the disk tier was written
(Llama-3-8B in bf16, 128 KiB of KV per token), in brackets as a mean rate over the trace's
span of arrival times; "prefill s" is the prefill time saved under
the default cost model (8,000 prefill tokens/s, 25 GB/s host-to-device, 5 GB/s disk reads).

Run: ``.venv/bin/python bench/bench_disk_sim.py`` (prints Markdown tables; well under two
minutes).
"""

from __future__ import annotations

import sys
import time

from _workloads import benchmark_traces  # noqa: E402 (bench/ is on sys.path)
from kvoffload.cpu import CPUOffloadingManager
from kvoffload.sim.disk import build_tiers, replay_disk
from kvoffload.sim.planning import CostModel
from kvoffload.sim.replay import to_key_lists
from kvoffload.sim.tiered import replay_tiered
from kvoffload.tiers.admission import SeenTwice

CPU = (0.01, 0.05)
DISK = (0.10, 0.25, 1.00)
COST = CostModel()


def _saved(result, block_bytes: int) -> float:
    tokens = result.device_tokens + result.cpu_tokens + result.disk_tokens
    return (
        tokens / COST.prefill_tokens_per_s
        - result.loaded * block_bytes / COST.bandwidth_bytes_per_s
        - result.promoted * block_bytes / COST.disk_bandwidth_bytes_per_s
    )


def _cells(result, block_bytes: int, duration_s: float) -> str:
    gb = result.written * block_bytes / 1e9
    return (
        f"{result.cpu_hit_ratio:.3f} | {result.disk_hit_ratio:.3f} | **{result.hit_ratio:.3f}** | "
        f"{gb:,.0f} ({gb / duration_s:.2f}) | {_saved(result, block_bytes):,.0f}"
    )


def main() -> int:
    start = time.perf_counter()
    traces = benchmark_traces()
    summary = {"all": [0.0, 0.0], "seen-twice": [0.0, 0.0]}  # hit ratio sum, GB written sum
    print(
        "| workload | CPU | disk | CPU only: total | all: CPU | disk | total | disk GB w (GB/s) | prefill s "
        "| seen twice: CPU | disk | total | disk GB w (GB/s) | prefill s |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    prepared, unpromoted = [], []
    for label, trace in traces:
        keys = to_key_lists(trace.requests)
        lengths = [r.input_length for r in trace.requests]
        served = [0] * len(keys)
        unique = trace.unique_blocks()
        block_bytes = trace.block_size * COST.kv_bytes_per_token
        stamps = [r.timestamp for r in trace.requests]
        duration_s = max(1.0, (max(stamps) - min(stamps)) / 1000)
        prepared.append((label, keys, lengths, served, unique, trace.block_size))
        for cpu_fraction in CPU:
            cpu_blocks = max(1, int(unique * cpu_fraction))
            alone = replay_tiered(
                CPUOffloadingManager(cpu_blocks, "lru"), keys, served, lengths, trace.block_size
            )
            for disk_fraction in DISK:
                disk_blocks = max(1, int(unique * disk_fraction))
                cells = []
                for rule, admit in (("all", None), ("seen-twice", SeenTwice(disk_blocks))):
                    tiers = build_tiers(cpu_blocks, disk_blocks, "lru", admit=admit)
                    result = replay_disk(tiers, keys, served, lengths, trace.block_size)
                    summary[rule][0] += result.hit_ratio
                    summary[rule][1] += result.written * block_bytes / 1e9
                    cells.append(_cells(result, block_bytes, duration_s))
                    if result.not_promoted:
                        unpromoted.append(
                            f"{label}, CPU {cpu_fraction:.0%} ({cpu_blocks:,} blocks), "
                            f"disk {disk_fraction:.0%}, {rule}: {result.not_promoted:,}"
                        )
                print(
                    f"| {label} | {cpu_fraction:.0%} | {disk_fraction:.0%} | {alone.hit_ratio:.3f} | "
                    f"{cells[0]} | {cells[1]} |",
                    flush=True,
                )
    if unpromoted:
        print("\nBlocks found on disk but not promoted (the batch was larger than the CPU tier):\n")
        for line in unpromoted:
            print(f"- {line}")
    cases = len(traces) * len(CPU) * len(DISK)
    for rule, (ratio, written) in summary.items():
        print(f"\n{rule}: mean total hit ratio {ratio / cases:.3f}, disk written {written:,.0f} GB in all")

    print("\nSeen-twice memory (keys remembered), CPU 5%, disk 25%:\n")
    print("| workload | memory | total hit | disk GB w |")
    print("|---|---|---:|---:|")
    for label, keys, lengths, served, unique, block_size in prepared:
        cpu_blocks, disk_blocks = max(1, int(unique * 0.05)), max(1, int(unique * 0.25))
        for name, memory in (("disk blocks", disk_blocks), ("4x disk blocks", 4 * disk_blocks)):
            tiers = build_tiers(cpu_blocks, disk_blocks, "lru", admit=SeenTwice(memory))
            result = replay_disk(tiers, keys, served, lengths, block_size)
            gb = result.written * block_size * COST.kv_bytes_per_token / 1e9
            print(f"| {label} | {name} ({memory:,}) | {result.hit_ratio:.3f} | {gb:,.0f} |", flush=True)
    print(f"\n({time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
