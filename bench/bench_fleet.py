"""Fleet simulation: what each routing policy buys a fleet of engines, with the simulator of
``kvoffload.sim.fleet`` (``kvoffload sim --replicas``).

Workload: the Mooncake conversation trace (when the shared directory holds it) and the
built-in ``chat`` workload (seed 0). Every replica has a device tier (LRU) of 1,000 blocks
on Mooncake (512 tokens of Llama-3-8B in bf16 each: 64 GiB of KV) and of 50 blocks on
``chat`` (256-token blocks; a larger one holds all of chat's reuse and leaves the host tier
idle), and an LRU host tier of 1% or 5% of the trace's unique blocks (each replica its
own). Routers: round_robin, random (seed
0), least_load, kv_aware (a real ``kvoffload.index.BlockIndex`` fed every replica's
events, guard at max/mean load > 2 by default). Load: prefill tokens a replica computed
over the fleet's last 16 x N requests.

Tables (Markdown):

1. per routing at 8 replicas: hit ratio per tier, load imbalance (mean over arrivals of
   max/mean window load; and max/mean of the tokens computed per replica over the whole
   trace), prefill time saved under the default cost model (8,000 prefill tokens/s, 25
   GB/s host-to-device), the seconds the replay took. "pooled" is one engine with 8x the
   device and host tier (``kvoffload.sim.planning.plan``): the hit ratio of a fleet-wide
   shared cache, a reference no router reaches by routing alone;
2. kv_aware's guard threshold swept (8 replicas, host 1%);
3. round_robin and kv_aware at 4 and 16 replicas (host 1%).

Under table 1: the seconds all its fleet replays took together (2 capacities x 4
routings, what ``kvoffload sim TRACE --replicas 8 --device-blocks 1000`` replays).

Run: ``.venv/bin/python bench/bench_fleet.py`` (about two and a half minutes on 2 cores).
"""

from __future__ import annotations

import sys
import time

from _workloads import MOONCAKE_TRACE  # noqa: E402 (bench/ is on sys.path)
from kvoffload.sim.fleet import plan_fleet, simulate
from kvoffload.sim.planning import parse_capacity, plan
from kvoffload.sim.routing import ROUTINGS
from kvoffload.sim.trace import read_trace
from kvoffload.sim.workloads import builtin_workload

DEVICE = {"mooncake": 1000, "chat": 50}
REPLICAS = 8
CAPACITIES = ("1%", "5%")


def _row(label: str, r) -> str:
    return (
        f"| {label} | {r.capacity} | {r.device_hit_ratio:.3f} | {r.host_hit_ratio:.3f} | {r.hit_ratio:.3f} "
        f"| {r.imbalance_mean:.2f} | {r.work_imbalance:.2f} | {r.guarded / r.requests:.1%} "
        f"| {r.prefill_s_saved:,.0f} | {r.replay_s:.1f} |"
    )


def _pooled(trace, spec: str, replicas: int, device: int) -> str:
    blocks = parse_capacity(spec, trace.unique_blocks(), trace.block_size * 131072) * replicas
    start = time.perf_counter()
    (p,) = plan(trace, ["lru"], [str(blocks)], device_blocks=device * replicas)
    seconds = time.perf_counter() - start
    return (
        f"| pooled ({replicas}x one engine) | {spec} | {p.device_hit_ratio:.3f} | {p.host_hit_ratio:.3f} "
        f"| {p.hit_ratio:.3f} | - | - | - | {p.prefill_s_saved:,.0f} | {seconds:.1f} |"
    )


HEADER = (
    "| routing | host per replica | device | host | total | imbalance (mean max/mean) "
    "| work max/mean | guarded | prefill s saved | replay s |\n"
    "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"
)


def main() -> int:
    traces = []
    if MOONCAKE_TRACE.exists():
        traces.append(("conversation (Mooncake)", read_trace(MOONCAKE_TRACE), DEVICE["mooncake"]))
    else:
        print(f"(skipping the Mooncake trace: {MOONCAKE_TRACE} not found)", file=sys.stderr)
    traces.append(("chat (generated, seed 0)", builtin_workload("chat"), DEVICE["chat"]))
    for label, trace, device in traces:
        print(f"\n### {label}: {REPLICAS} replicas, device {device} blocks each\n")
        print(HEADER)
        start = time.perf_counter()
        rows = plan_fleet(trace, ["lru"], CAPACITIES, ROUTINGS, REPLICAS, device_blocks=device)
        total = time.perf_counter() - start
        for spec in CAPACITIES:
            for r in rows:
                if r.capacity == spec:
                    print(_row(r.routing, r), flush=True)
            print(_pooled(trace, spec, REPLICAS, device), flush=True)
        print(f"\nall {len(rows)} fleet replays: {total:.1f} s (trace loaded once, keys built once)")

    label, trace, device = traces[0]
    print(f"\n### {label}: kv_aware guard threshold, {REPLICAS} replicas, host 1%\n")
    print(HEADER.replace("| routing |", "| threshold |"))
    blocks = parse_capacity("1%", trace.unique_blocks(), trace.block_size * 131072)
    for threshold in (1.25, 1.5, 2, 3, float("inf")):
        r = simulate(
            trace,
            REPLICAS,
            "kv_aware",
            blocks,
            device_blocks=device,
            balance_threshold=threshold,
            capacity="1%",
        )
        print(_row(f"{threshold:g}", r), flush=True)

    print(f"\n### {label}: replicas, host 1% each\n")
    print(HEADER.replace("| routing |", "| replicas, routing |"))
    for replicas in (4, 16):
        for routing in ("round_robin", "kv_aware"):
            r = simulate(trace, replicas, routing, blocks, device_blocks=device, capacity="1%")
            print(_row(f"{replicas}, {routing}", r), flush=True)
        print(_pooled(trace, "1%", replicas, device), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
