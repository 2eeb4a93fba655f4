"""``kvoffload demo``: replay a generated multi-turn chat workload through the CPU tier
with each eviction policy, and print hit ratio and throughput."""

from __future__ import annotations

import argparse

from kvoffload.cpu import CPUOffloadingManager
from kvoffload.policies import available_policies
from kvoffload.sim.replay import replay_keys, to_key_lists
from kvoffload.sim.workloads import ChatWorkload, multi_turn_chat


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="replay a multi-turn chat workload through the CPU tier")
    p.add_argument("--conversations", type=int, default=400)
    p.add_argument("--capacity", type=float, default=0.10, help="CPU tier size as a fraction of the unique blocks")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if not 0 < args.capacity <= 1:
        raise SystemExit(f"--capacity must be in (0, 1], got {args.capacity}")
    trace = multi_turn_chat(ChatWorkload(conversations=args.conversations, seed=args.seed))
    unique = trace.unique_blocks()
    blocks = max(1, int(unique * args.capacity))
    key_lists = to_key_lists(trace.requests)
    print(
        f"multi-turn chat: {len(trace.requests)} requests, {trace.block_references()} block references, "
        f"{unique} unique blocks of {trace.block_size} tokens; CPU tier of {blocks} blocks"
    )
    print(f"{'policy':<10}{'hit ratio':>10}{'evictions':>11}{'keys/s':>12}")
    for name in available_policies():
        result = replay_keys(CPUOffloadingManager(blocks, name), key_lists)
        print(f"{name:<10}{result.hit_ratio:>10.3f}{result.evicted_keys:>11}{result.keys_per_second:>12,.0f}")
    return 0
