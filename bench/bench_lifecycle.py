"""Replay with the request lifecycle: hits against vLLM 0.32's own CPU manager, and
whether the reuse filter (``store_threshold=2``) helps.

Protocol, per request (what ``OffloadingScheduler`` does for a request served in one
step, and what vLLM 0.32's offloading scheduler does with a touch at lookup time):

1. ``on_new_request(ctx)``;
2. look up its keys until the first non-hit (``h`` hits);
3. touch all its keys (once);
4. load the hit prefix (prepare and complete): these are ``reused``;
5. with a store threshold, count the request's keys once and hold back the keys after
   the prefix that fewer requests asked for (``skipped``); store the rest (prepare and
   complete): the keys stored are ``inserted``;
6. ``on_request_finished(ctx, [keys], inserted, reused)``.

Every block id of the trace is one key of KV-cache group 0, the trailing partial block
included; capacities are fractions of the trace's unique blocks. vLLM's manager is driven
through the same steps (its ``ReqContext`` carries each key's end position); vLLM's own
scheduler makes no touch at lookup, so its figures without step 3 are shown too.

Speed: the replay with the lifecycle (keys/s) against vLLM's manager of the same policy
(its LRU for S3-FIFO, W-TinyLFU and the turn-aware LRU), taken in turns, first.

    .venv/bin/python bench/bench_lifecycle.py [--policies lru,arc,turnlru] [--no-vllm]
        [--speed-policies lru,arc,...] [--speed-fraction 0.05] [--reps 3] [--only-speed]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence

from _workloads import FRACTIONS, MOONCAKE_TRACE, benchmark_traces  # noqa: E402 (bench/ is on sys.path)
from kvoffload.cpu import CPUOffloadingManager
from kvoffload.keys import OffloadKey
from kvoffload.manager import RequestContext
from kvoffload.scheduler.reuse import ReuseFilter
from kvoffload.sim.replay import replay_keys, to_key_lists
from kvoffload.sim.trace import read_trace

# vLLM 0.32's LRU on the conversation trace with this protocol (issue 12)
VLLM_REFERENCE = {0.05: 56_479, 0.10: 80_466}


def replay_lifecycle(
    manager: CPUOffloadingManager, key_lists: Sequence[Sequence[OffloadKey]], store_threshold: int = 1
) -> tuple[int, int, int, float]:
    """(hit keys, stored keys, skipped keys, seconds) of the protocol above."""
    reuse = ReuseFilter(store_threshold)
    hits = stored = skipped = 0
    start = time.perf_counter()
    for i, keys in enumerate(key_lists):
        ctx = RequestContext(str(i))
        manager.on_new_request(ctx)
        h = manager.lookup_prefix(keys)
        manager.touch(keys)
        prefix = keys[:h]
        if h:
            manager.prepare_load(prefix)
            manager.complete_load(prefix)
            hits += h
        inserted: list[OffloadKey] = []
        rest = keys[h:]
        if reuse.active:
            reuse.count(keys)
            allowed = [key for key in rest if reuse.allows(key)]
            skipped += len(rest) - len(allowed)
            rest = allowed
        if rest:
            out = manager.prepare_store(rest)
            if out is not None:
                manager.complete_store(out.keys_to_store)
                inserted = out.keys_to_store
                stored += len(inserted)
        manager.on_request_finished(ctx, [keys], frozenset(inserted), frozenset(prefix))
    return hits, stored, skipped, time.perf_counter() - start


def replay_vllm(num_blocks: int, policy: str, key_lists, touch: bool = True) -> int:
    """Hit keys of vLLM 0.32's ``CPUOffloadingManager`` driven by the same protocol."""
    from vllm.v1.kv_offload.base import LookupResult, ReqContext
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager as VLLMManager

    manager = VLLMManager(num_blocks, policy)
    hits = 0
    for i, keys in enumerate(key_lists):
        ctx = ReqContext(str(i))
        for j, key in enumerate(keys):
            ctx.set_offload_key_position(key, j + 1)
        manager.on_new_request(ctx)
        h = 0
        for key in keys:
            if manager.lookup(key, ctx) is not LookupResult.HIT:
                break
            h += 1
        if touch:
            manager.touch(keys, ctx)
        if h:
            manager.prepare_load(keys[:h], ctx)
            manager.complete_load(keys[:h], ctx)
            hits += h
        out = manager.prepare_store(keys[h:], ctx)
        if out is not None:
            manager.complete_store(out.keys_to_store, ctx)
        manager.on_request_finished(ctx)
    return hits


def speed_table(policies: list[str], fraction: float, reps: int) -> None:
    """Replay time with the lifecycle against vLLM 0.32's manager of the same policy (its
    LRU for the policies it lacks), the two taken in turns ``reps`` times; the median of
    the per-turn ratios."""
    trace = read_trace(MOONCAKE_TRACE)
    keys = to_key_lists(trace.requests)
    total = trace.block_references()
    blocks = int(trace.unique_blocks() * fraction)
    print(f"## Replay speed with the lifecycle at {fraction:.0%} ({blocks} blocks), {reps} turns each")
    print()
    print(
        "| policy | hits | vLLM's policy | vLLM's hits | kvoffload keys/s | vLLM keys/s | speed-up | target |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---|")
    for policy in policies:
        theirs = policy if policy in ("lru", "arc") else "lru"
        ratios, ours_s, vllm_s = [], [], []
        for rep in range(reps):
            runs = ("ours", "vllm") if rep % 2 == 0 else ("vllm", "ours")
            for which in runs:
                if which == "ours":
                    hits, _, _, seconds = replay_lifecycle(CPUOffloadingManager(blocks, policy), keys)
                    ours_s.append(seconds)
                else:
                    start = time.perf_counter()
                    vllm_hits = replay_vllm(blocks, theirs, keys)
                    vllm_s.append(time.perf_counter() - start)
            ratios.append(vllm_s[-1] / ours_s[-1])
        ratio = statistics.median(ratios)
        print(
            f"| {policy} | {hits:,} | {theirs} | {vllm_hits:,} | {total / statistics.median(ours_s):,.0f} "
            f"| {total / statistics.median(vllm_s):,.0f} | {ratio:.2f}x "
            f"({min(ratios):.2f}-{max(ratios):.2f}) | >= 5x: {'**met**' if ratio >= 5 else '**missed**'} |",
            flush=True,
        )
    print()


def vllm_available() -> bool:
    try:
        import vllm.v1.kv_offload.cpu.manager  # noqa: F401
    except Exception:
        return False
    return True


def hits_table(policies: list[str], with_vllm: bool) -> None:
    trace = read_trace(MOONCAKE_TRACE)
    keys = to_key_lists(trace.requests)
    unique = trace.unique_blocks()
    print(f"## Hits on the conversation trace ({len(keys)} requests, {trace.block_references()} keys)")
    print()
    total = trace.block_references()
    vllm_cols = " vLLM 0.32 | vLLM 0.32, no touch |" if with_vllm else " vLLM 0.32 (issue 12) |"
    print(
        "| policy | capacity | blocks | kvoffload, lifecycle | keys/s, lifecycle | kvoffload, no hooks "
        f"| keys/s, no hooks |{vllm_cols}"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if with_vllm else ""))
    for policy in policies:
        for fraction in FRACTIONS:
            blocks = int(unique * fraction)
            ours, _, _, seconds = replay_lifecycle(CPUOffloadingManager(blocks, policy), keys)
            plain = replay_keys(CPUOffloadingManager(blocks, policy), keys)
            row = (
                f"| {policy} | {fraction:.0%} | {blocks} | {ours:,} | {total / seconds:,.0f} "
                f"| {plain.hit_keys:,} | {plain.keys_per_second:,.0f} |"
            )
            if with_vllm and policy in ("lru", "arc"):
                with_touch = replay_vllm(blocks, policy, keys)
                no_touch = replay_vllm(blocks, policy, keys, touch=False)
                row += f" {with_touch:,} | {no_touch:,} |"
            elif with_vllm:
                row += " - | - |"
            else:
                reference = VLLM_REFERENCE.get(fraction) if policy == "lru" else None
                row += f" {reference:,} |" if reference else " - |"
            print(row, flush=True)
    print()


def threshold_table(policies: list[str]) -> None:
    print("## store_threshold=2 against 1 (hit ratio, keys stored)")
    print()
    print("| workload | policy | capacity | hits, 1 | hits, 2 | stored, 1 | stored, 2 | skipped, 2 | helps |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---|")
    for label, trace in benchmark_traces():
        keys = to_key_lists(trace.requests)
        total = trace.block_references()
        unique = trace.unique_blocks()
        for policy in policies:
            for fraction in FRACTIONS:
                blocks = max(1, int(unique * fraction))
                one = replay_lifecycle(CPUOffloadingManager(blocks, policy), keys, 1)
                two = replay_lifecycle(CPUOffloadingManager(blocks, policy), keys, 2)
                verdict = "yes" if two[0] > one[0] else "no" if two[0] < one[0] else "same"
                print(
                    f"| {label} | {policy} | {fraction:.0%} | {one[0] / total:.4f} | {two[0] / total:.4f} "
                    f"| {one[1]:,} | {two[1]:,} | {two[2]:,} | {verdict} |",
                    flush=True,
                )
    print()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", default="lru,arc,turnlru")
    parser.add_argument("--threshold-policies", default="lru,arc")
    parser.add_argument("--no-vllm", action="store_true", help="print the issue's vLLM figures instead")
    parser.add_argument("--speed-policies", default="lru,arc,s3fifo,wtinylfu,turnlru")
    parser.add_argument("--speed-fraction", type=float, default=0.05)
    parser.add_argument("--reps", type=int, default=3, help="turns of each side in the speed table")
    parser.add_argument("--only-speed", action="store_true", help="the speed table alone")
    args = parser.parse_args()
    if MOONCAKE_TRACE.exists() and not args.no_vllm and vllm_available():
        speed_table(args.speed_policies.split(","), args.speed_fraction, args.reps)
    if args.only_speed:
        return 0
    if MOONCAKE_TRACE.exists():
        hits_table(args.policies.split(","), not args.no_vllm and vllm_available())
    else:
        print(f"(skipping the hits table: {MOONCAKE_TRACE} not found)", file=sys.stderr)
    threshold_table(args.threshold_policies.split(","))
    return 0


if __name__ == "__main__":
    sys.exit(main())
