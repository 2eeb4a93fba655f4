"""``kvoffload sim``: replay a trace (a Mooncake JSONL path, or a built-in synthetic
workload) for a list of eviction policies and host-tier capacities, print hit ratios per
tier, tokens saved, bytes moved and an estimate of prefill time saved, and write a CSV and
a PNG of hit ratio against capacity.

With ``--disk-capacities`` a disk tier sits below the host (CPU) tier
(``kvoffload.sim.disk``): every (policy, CPU capacity, disk capacity) is replayed, the
table gives hit ratios of the device, CPU and disk tiers and GB read/written per tier, the
cost model adds the disk read bandwidth (``--disk-bandwidth``), and the plot draws the hit
ratio against the disk capacity. Belady has no two-tier replay and is left out there.
``--object-capacity`` adds an object-storage tier (S3) below the disk tier
(``kvoffload.sim.object_tier``), read at ``--object-bandwidth`` after ``--object-latency``
per request, filled by write-through or, ``--object-writes on-eviction``, by the disk
tier's evictions: the table gains its hit ratio and GB read/written.

With ``--replicas N`` the trace is replayed over a fleet (``kvoffload.sim.fleet``): N
engines, each with its own device tier (``--device-blocks``) and host tier (each
``--capacities`` entry is per replica), every request routed by each ``--routing``
policy in turn (``kvoffload.sim.routing``: round_robin, random (``--seed``),
least_load, kv_aware by the index's tier-weighted scores under a load-balance guard,
``--balance-threshold``). Load is the prefill tokens a replica computed over the last
``--load-window`` requests. The table gives hit ratios per tier, load imbalance
(max/mean) and prefill time saved per (policy, capacity, routing); the plot draws hit
ratio and imbalance against the capacity per replica. Belady and the disk tier are left
out there; ``--policies`` defaults to lru and ``--capacities`` to 1%,5%.
``--shared-capacity`` adds one shared tier (a Redis server, say) under every replica's
host tier, sized for the whole fleet, read at ``--remote-bandwidth``: what sharing
buys a fleet that routes without affinity shows as its ``shared`` column.

With ``--metrics-port`` (host-tier replay only) the host tier of the row being replayed is
served on ``/metrics`` (``kvoffload.metrics``, ``--metrics-host`` 127.0.0.1 by default),
and after the table each row's tier counters are printed as that endpoint serves them.

With ``--hints`` or a flood (``--flood-every-s``, ``--flood-size``) the trace is replayed by
sessions (``kvoffload.sim.session_plan``, host tier only, behind ``--device-blocks``): a
flood of one-off requests is laid over it when asked, and every (policy, capacity) is
replayed without hints and, with ``--hints retain``, with retention hints (each turn but its
session's last retains its full blocks for ``--retain-ttl-s``, within a budget of
``--retention-fraction`` of the tier). The table gives the hit ratio over all of the
trace's requests and over its resumed turns (the flood's counted in neither), and the
blocks retained and trimmed; the CSV every field, no plot. Belady is left out there.

The options are declared and checked in ``kvoffload.cli.sim_options``; this module runs
the replays and prints and writes their results."""

from __future__ import annotations

import argparse
from contextlib import contextmanager

from tqdm import tqdm

from kvoffload import metrics
from kvoffload.cli.sim_options import add_arguments, validate, validate_sessions
from kvoffload.sim.disk_plan import DEFAULT_ADMISSION, plan_disk
from kvoffload.sim.fleet import format_fleet_table, plan_fleet, write_fleet_plot
from kvoffload.sim.object_tier import DEFAULT_OBJECT_WRITES
from kvoffload.sim.planning import BELADY, plan
from kvoffload.sim.report import format_disk_table, format_table, write_csv, write_disk_plot, write_plot
from kvoffload.sim.session_plan import format_session_table, plan_sessions, write_session_csv
from kvoffload.sim.trace import TraceFormatError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sim", help="replay a trace through the host tier: hit ratios, savings, plots")
    add_arguments(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:
        cost, policies, capacities, disk_capacities, trace, fleet = validate(args)
        sessions = validate_sessions(args, trace, policies)
    except (ValueError, TraceFormatError, OSError) as exc:
        raise SystemExit(f"kvoffload sim: {exc}") from None
    block_bytes = trace.block_size * cost.kv_bytes_per_token
    print(
        f"{trace.name}: {len(trace.requests)} requests, {trace.block_references()} block references, "
        f"{trace.unique_blocks()} unique blocks of {trace.block_size} tokens "
        f"({block_bytes / 2**20:,.1f} MiB each); device tier {args.device_blocks} blocks"
    )
    title = f"{trace.name}, device tier {args.device_blocks} blocks"
    link = (
        f"cost model: prefill {cost.prefill_tokens_per_s:,.0f} tokens/s, "
        f"link {cost.bandwidth_bytes_per_s / 1e9:,.1f} GB/s, "
    )
    if sessions is not None:
        _run_sessions(args, trace, cost, policies, capacities, sessions)
        return 0
    if fleet is not None:
        _run_fleet(args, trace, cost, policies, capacities, fleet, title, link)
    elif disk_capacities:
        online = [name for name in policies if name.lower() != BELADY]
        if len(online) < len(policies):
            print(
                "belady left out: it has no replay with a disk tier "
                "(without --disk-capacities it is the host-tier ceiling)"
            )
        admit = args.disk_admit or DEFAULT_ADMISSION
        with _progress(args, len(online) * len(capacities) * len(disk_capacities)) as progress:
            disk_rows = plan_disk(
                trace,
                online,
                capacities,
                disk_capacities,
                args.device_blocks,
                cost,
                admit=admit,
                disk_policy=args.disk_policy,
                progress=progress,
                object_capacity=args.object_capacity,
                object_writes=args.object_writes or DEFAULT_OBJECT_WRITES,
            )
        print(format_disk_table(disk_rows))
        objects = ""
        if args.object_capacity is not None:
            objects = (
                f"object tier {args.object_capacity}, reads "
                f"{cost.object_bandwidth_bytes_per_s / 1e9:,.1f} GB/s after "
                f"{cost.object_latency_s * 1e3:g} ms per request, writes "
                f"{args.object_writes or DEFAULT_OBJECT_WRITES}; "
            )
        print(
            f"{link}disk reads {cost.disk_bandwidth_bytes_per_s / 1e9:,.1f} GB/s, {objects}"
            f"{cost.kv_bytes_per_token:,} KV bytes/token; disk admission {admit}; "
            "stores and writes to lower tiers overlap compute and are not charged"
        )
        write_csv(disk_rows, args.csv)
        write_disk_plot(disk_rows, args.png, title=title)
    else:
        with _progress(args, len(policies) * len(capacities)) as progress, _metrics(args) as on_tier:
            rows = plan(
                trace, policies, capacities, args.device_blocks, cost, progress=progress, on_tier=on_tier
            )
        print(format_table(rows))
        for (name, spec), source in getattr(on_tier, "tiers", {}).items():
            print(f"counters of {name} @ {spec}, as /metrics serves them:")
            for line in metrics.exposition_lines([source]):
                print(f"  {line}")
        print(f"{link}{cost.kv_bytes_per_token:,} KV bytes/token; stores overlap compute and are not charged")
        write_csv(rows, args.csv)
        write_plot(rows, args.png, title=title)
    print(f"wrote {args.csv} and {args.png}")
    return 0


def _run_fleet(args, trace, cost, policies, capacities, fleet: dict, title: str, link: str) -> None:
    online = [name for name in policies if name.lower() != BELADY]
    if len(online) < len(policies):
        print("belady left out: it has no fleet replay (without --replicas it is the host-tier ceiling)")
    routings = fleet["routings"]
    with _progress(args, len(online) * len(capacities) * len(routings)) as progress:
        rows = plan_fleet(
            trace,
            online,
            capacities,
            routings,
            args.replicas,
            device_blocks=args.device_blocks,
            cost=cost,
            balance_threshold=fleet["balance_threshold"],
            load_window=fleet["load_window"],
            seed=args.seed,
            weights=fleet["weights"],
            progress=progress,
            shared_capacity=args.shared_capacity,
        )
    print(format_fleet_table(rows))
    print(
        f"{args.replicas} replicas, each with a device tier of {args.device_blocks} blocks; "
        f"load = prefill tokens computed over the last {fleet['load_window']} requests; "
        f"kv_aware guard at max/mean load > {fleet['balance_threshold']:g}"
    )
    if args.shared_capacity is not None:
        size = args.shared_capacity
        if args.shared_segment is not None:
            size = f"{args.replicas} segments of {args.shared_segment}"
        print(
            f"a shared tier of {size} ({rows[0].shared_blocks:,} blocks) under every "
            f"host tier, read at {cost.remote_bandwidth_bytes_per_s / 1e9:,.1f} GB/s"
        )
    print(f"{link}{cost.kv_bytes_per_token:,} KV bytes/token; stores overlap compute and are not charged")
    write_csv(rows, args.csv)
    write_fleet_plot(rows, args.png, title=f"{title} per replica, {args.replicas} replicas")


def _run_sessions(args, trace, cost, policies, capacities, sessions: dict) -> None:
    online = [name for name in policies if name.lower() != BELADY]
    if len(online) < len(policies):
        print("belady left out: it has no session replay")
    modes = 2 if sessions["hints"] == "retain" else 1
    with _progress(args, len(online) * len(capacities) * modes) as progress:
        rows = plan_sessions(
            trace,
            online,
            capacities,
            device_blocks=args.device_blocks,
            block_bytes=trace.block_size * cost.kv_bytes_per_token,
            progress=progress,
            **sessions,
        )
    print(format_session_table(rows))
    flood = sessions["flood"]
    if flood is not None:
        print(f"flood: {flood.blocks:,} one-off blocks every {flood.every_s:g} s (counted in no ratio)")
    if sessions["hints"] == "retain":
        print(
            f"hints: each turn but its session's last retains its full blocks for {sessions['ttl_s']:g} s, "
            f"every turn releases its session's retention on arrival; retention budget "
            f"{sessions['retention_fraction']:g} of the tier"
        )
    write_session_csv(rows, args.csv)
    print(f"wrote {args.csv}")


@contextmanager
def _metrics(args: argparse.Namespace):
    """With ``--metrics-port``: an ``on_tier`` for ``plan`` that serves the row being
    replayed (``kvoffload.metrics``) and keeps every row's tier in ``on_tier.tiers``."""
    if args.metrics_port is None:
        yield None
        return
    current: list[metrics.TierSource] = []

    class Current:
        def read_metrics(self, samples) -> None:
            if current:
                current[-1].read_metrics(samples)

    def on_tier(policy: str, capacity: str, tier) -> None:
        current.append(metrics.TierSource(tier))
        on_tier.tiers[(policy, capacity)] = current[-1]

    on_tier.tiers = {}
    source = Current()
    try:
        server = metrics.serve(args.metrics_port, args.metrics_host)
    except OSError as exc:
        raise SystemExit(f"kvoffload sim: --metrics-port {args.metrics_port}: {exc}") from None
    metrics.register(source)
    try:
        yield on_tier
    finally:
        metrics.unregister(source)
        server.shutdown()


@contextmanager
def _progress(args: argparse.Namespace, total: int):
    """A progress callback for ``plan``/``plan_disk`` drawing a bar of ``total`` replays."""
    bar = tqdm(total=total, disable=args.no_progress, unit="replay")
    try:
        yield lambda what: (bar.set_description(what), bar.update(0))
    finally:
        bar.close()
