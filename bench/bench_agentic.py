"""Session retention on agentic traffic (issue 41, item 3): hit ratio over all turns and over
resumed turns, with and without a cache flood, at 1%, 5% and 10% host capacity.

Traces:

* ``conversation (Mooncake)``: the public Mooncake FAST'25 conversation trace (read from
  ``../shared/traces/``), which has no session ids: sessions are derived from ``hash_ids``
  (``kvoffload.sim.sessions``: a request continues the session of the earlier request whose
  full blocks, at least 2, are the longest prefix of its own), a pause is the time between a
  turn's arrival and the previous turn's;
* ``agentic (generated)``: the built-in ``agentic`` workload (seed 0), whose sessions the
  generator names and whose pauses are its tool-call gaps (exponential, mean 8 s).

Each is replayed as is and under a flood (``kvoffload.sim.flood``): every median pause of the
trace (from half of it on), a burst of one-off 16-block requests whose blocks total ``--flood-size`` of the
trace's unique blocks (default 10%, the largest host tier, so a burst flushes an LRU tier),
spread over 1 s. Capacity is a fraction of the trace's unique blocks (the flood's excluded).

Configurations, host tier only (no device tier), through the real managers:

* ``hints``: kvoffload's ``CPUOffloadingManager`` with turn-aware LRU, the best policy
  without hints, and the retain model of ``kvoffload.sim.sessions`` on the trace's clock:
  every turn releases its session's retention on arrival and, unless it is its session's
  last, retains its full blocks for ``--ttl`` seconds (default: the trace's 90th percentile
  pause) within a retention budget of ``--retention-fraction`` of the tier (default 0.5);
* ``turnlru`` and ``lru``: the same manager without hints;
* ``vllm lru`` / ``vllm arc``: vLLM 0.32's own ``CPUOffloadingManager`` with its policies,
  driven by the same protocol with its request contexts (left out when vLLM is absent).

Ratios count blocks (hit blocks / blocks) over the trace's requests; the flood's requests,
which can never hit, are left out. ``ceiling`` is what an unbounded tier hits. Targets:
hints / turnlru >= 1.3x on resumed turns and >= 1.0x overall at equal capacity.

Run: ``.venv/bin/python bench/bench_agentic.py`` (about 6 minutes on a shared 2-core machine
at load ~9, 2 without vLLM's manager: ``--no-vllm``); ``--quick`` replays the first 3,000
requests of the Mooncake trace only (under a minute).
"""

from __future__ import annotations

import argparse
import sys
import time

from _workloads import MOONCAKE_TRACE  # noqa: E402 (bench/ is on sys.path)
from kvoffload.cpu import CPUOffloadingManager
from kvoffload.sim.flood import Flood, inject_flood
from kvoffload.sim.replay import to_key_lists
from kvoffload.sim.session_replay import TraceClock, replay_with_hints, session_report
from kvoffload.sim.sessions import pause_quantile, pauses, retain_hints, session_turns
from kvoffload.sim.trace import Trace, read_trace
from kvoffload.sim.workloads import builtin_workload

FRACTIONS = (0.01, 0.05, 0.10)
BASELINES = ("turnlru", "lru")
VLLM_POLICIES = ("lru", "arc")


def vllm_hits(num_blocks: int, policy: str, requests, key_lists) -> list[int]:
    """Each request's hit blocks in vLLM 0.32's own CPU manager, driven like
    ``replay_with_hints`` without hints (lookup, touch, load, store, finish)."""
    from vllm.v1.kv_offload.base import LookupResult, ReqContext
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager as VLLMManager

    manager = VLLMManager(num_blocks, policy)
    out = []
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
        manager.touch(keys, ctx)
        if h:
            manager.prepare_load(keys[:h], ctx)
            manager.complete_load(keys[:h], ctx)
        stored = manager.prepare_store(keys[h:], ctx)
        if stored is not None:
            manager.complete_store(stored.keys_to_store, ctx)
        manager.on_request_finished(ctx)
        out.append(h)
    return out


def vllm_available() -> bool:
    try:
        import vllm.v1.kv_offload.cpu.manager  # noqa: F401
    except Exception:
        return False
    return True


def traces(quick: bool) -> list[tuple[str, Trace]]:
    out = []
    if MOONCAKE_TRACE.exists():
        trace = read_trace(MOONCAKE_TRACE)
        if quick:
            trace = Trace(trace.requests[:3000], trace.block_size, trace.name)
        out.append(("conversation (Mooncake)", trace))
    else:
        print(f"(skipping the Mooncake trace: {MOONCAKE_TRACE} not found)", file=sys.stderr)
    if not quick:
        out.append(("agentic (generated, seed 0)", builtin_workload("agentic")))
    return out


def run_trace(label: str, trace: Trace, args, names: list[str], with_vllm: bool, verdicts: list[str]) -> None:
    turns = session_turns(trace)
    gaps = pauses(turns)
    ttl = args.ttl if args.ttl is not None else round(pause_quantile(turns, 0.9))
    unique = trace.unique_blocks()
    keys = to_key_lists(trace.requests)
    ceiling = session_report(
        replay_with_hints(
            CPUOffloadingManager(unique, "lru"), TraceClock(), trace.requests, keys, trace.block_size
        ),
        keys,
        turns,
    )
    every = pause_quantile(turns, 0.5)
    flood = Flood(every_s=every, blocks=max(1, int(unique * args.flood_size)))
    print(
        f"{label}: {len(trace.requests):,} requests, {len({t.session for t in turns}):,} sessions, "
        f"{len(gaps):,} resumed turns; pauses p10/p50/p90 {pause_quantile(turns, 0.1):.1f} / {every:.1f} / "
        f"{pause_quantile(turns, 0.9):.1f} s; {unique:,} unique blocks; hints: TTL {ttl:g} s, retention "
        f"budget {args.retention_fraction:g} of the tier; flood: {flood.blocks:,} blocks every {every:.1f} s",
        flush=True,
    )
    print()
    print(
        f"| flood | capacity (blocks) | {' | '.join(names)} | ceiling | hints/turnlru resumed (>= 1.3x) "
        "| hints/turnlru overall (>= 1.0x) | s |"
    )
    print("|---|---|" + "---|" * len(names) + "---|---|---|---:|")
    for flooded in (False, True):
        if flooded:
            f = inject_flood(trace, flood)
            replayed, counted = f.trace, [not mark for mark in f.flood]
            r_turns, r_keys = session_turns(replayed), to_key_lists(replayed.requests)
        else:
            replayed, counted, r_turns, r_keys = trace, None, turns, keys
        hints = retain_hints(r_turns, ttl)
        for fraction in args.fractions:
            blocks = max(1, int(unique * fraction))
            start = time.perf_counter()
            reports = {}
            clock = TraceClock()
            tier = CPUOffloadingManager(
                blocks, "turnlru", clock=clock, retention_fraction=args.retention_fraction
            )
            hits = replay_with_hints(tier, clock, replayed.requests, r_keys, replayed.block_size, hints)
            reports["hints"] = session_report(hits, r_keys, r_turns, counted)
            for policy in BASELINES:
                clock = TraceClock()
                tier = CPUOffloadingManager(blocks, policy, clock=clock)
                hits = replay_with_hints(tier, clock, replayed.requests, r_keys, replayed.block_size)
                reports[policy] = session_report(hits, r_keys, r_turns, counted)
            if with_vllm:
                for policy in VLLM_POLICIES:
                    hits = vllm_hits(blocks, policy, replayed.requests, r_keys)
                    reports[f"vllm {policy}"] = session_report(hits, r_keys, r_turns, counted)
            seconds = time.perf_counter() - start
            print_row(label, flooded, fraction, blocks, reports, ceiling, seconds, verdicts)


def print_row(label, flooded, fraction, blocks, reports, ceiling, seconds, verdicts) -> None:
    hints, base = reports["hints"], reports["turnlru"]
    resumed = hints.resumed_hit_ratio / base.resumed_hit_ratio if base.resumed_hit_ratio else float("inf")
    overall = hints.hit_ratio / base.hit_ratio if base.hit_ratio else float("inf")
    cells = " | ".join(f"{r.hit_ratio:.3f} / {r.resumed_hit_ratio:.3f}" for r in reports.values())
    met_r, met_o = resumed >= 1.3, overall >= 1.0
    print(
        f"| {'flood' if flooded else 'none'} | {fraction:.0%} ({blocks:,}) | {cells} | "
        f"{ceiling.hit_ratio:.3f} / {ceiling.resumed_hit_ratio:.3f} | "
        f"{resumed:.2f}x {'met' if met_r else 'MISSED'} | "
        f"{overall:.2f}x {'met' if met_o else 'MISSED'} | {seconds:.1f} |",
        flush=True,
    )
    if not met_r:
        need = 1.3 * base.resumed_hit_ratio
        why = (
            f"1.3x turnlru's {base.resumed_hit_ratio:.3f} is {need:.3f}, above the ceiling "
            f"{ceiling.resumed_hit_ratio:.3f} that an unbounded tier reaches"
            if need > ceiling.resumed_hit_ratio
            else f"hints reach {hints.resumed_hit_ratio:.3f} of the {need:.3f} needed "
            f"(ceiling {ceiling.resumed_hit_ratio:.3f})"
        )
        verdicts.append(
            f"{label}, {'flood' if flooded else 'no flood'}, {fraction:.0%}: resumed {resumed:.2f}x: {why}"
        )
    if not met_o:
        verdicts.append(
            f"{label}, {'flood' if flooded else 'no flood'}, {fraction:.0%}: overall {overall:.2f}x < 1.0x"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ttl", type=float, default=None, help="retain TTL, s (default: p90 pause)")
    parser.add_argument(
        "--retention-fraction", type=float, default=0.5, help="retention budget (default 0.5)"
    )
    parser.add_argument(
        "--flood-size", type=float, default=0.10, help="burst, of unique blocks (default 0.10)"
    )
    parser.add_argument(
        "--fractions", type=lambda s: [float(x) for x in s.split(",")], default=list(FRACTIONS)
    )
    parser.add_argument("--quick", action="store_true", help="the first 3,000 Mooncake requests only")
    parser.add_argument("--no-vllm", action="store_true", help="leave vLLM's manager out")
    args = parser.parse_args()
    with_vllm = not args.no_vllm and vllm_available()
    names = ["hints (turnlru)", *BASELINES, *(f"vllm {p}" for p in VLLM_POLICIES if with_vllm)]
    started = time.perf_counter()
    print("cells: overall / resumed-turn hit ratio (hit blocks / blocks)")
    verdicts: list[str] = []
    for label, trace in traces(args.quick):
        print()
        run_trace(label, trace, args, names, with_vllm, verdicts)
    print()
    print("targets missed:" if verdicts else "every target met")
    for line in verdicts:
        print(f"- {line}")
    print(f"total {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
