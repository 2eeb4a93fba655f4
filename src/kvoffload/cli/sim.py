"""``kvoffload sim``: replay a trace (a Mooncake JSONL path, or a built-in synthetic
workload) for a list of eviction policies and host-tier capacities, print hit ratios per
tier, tokens saved, bytes moved and an estimate of prefill time saved, and write a CSV and
a PNG of hit ratio against capacity.

With ``--disk-capacities`` a disk tier sits below the host (CPU) tier
(``kvoffload.sim.disk``): every (policy, CPU capacity, disk capacity) is replayed, the
table gives hit ratios of the device, CPU and disk tiers and GB read/written per tier, the
cost model adds the disk read bandwidth (``--disk-bandwidth``), and the plot draws the hit
ratio against the disk capacity. Belady has no two-tier replay and is left out there.

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
and after the table each row's tier counters are printed as that endpoint serves them."""

from __future__ import annotations

import argparse
from contextlib import contextmanager
from pathlib import Path

from tqdm import tqdm

from kvoffload import metrics
from kvoffload.index.tiers import TierWeights
from kvoffload.sim.disk_plan import ADMISSION, DEFAULT_ADMISSION, plan_disk
from kvoffload.sim.fleet import default_load_window, format_fleet_table, plan_fleet, write_fleet_plot
from kvoffload.sim.planning import BELADY, CostModel, parse_bytes, parse_capacity, plan, validate_policies
from kvoffload.sim.report import format_disk_table, format_table, write_csv, write_disk_plot, write_plot
from kvoffload.sim.routing import DEFAULT_BALANCE_THRESHOLD, ROUTINGS, check_threshold, validate_routings
from kvoffload.sim.trace import MOONCAKE_BLOCK_SIZE, TraceFormatError, read_trace
from kvoffload.sim.workloads import WORKLOADS, builtin_workload

# KV bytes per token in bf16: 2 (K and V) x layers x KV heads x head dim x 2 bytes.
MODELS = {
    "llama3-8b": 2 * 32 * 8 * 128 * 2,
    "llama3-70b": 2 * 80 * 8 * 128 * 2,
    "qwen2.5-7b": 2 * 28 * 4 * 128 * 2,
    "mistral-7b": 2 * 32 * 8 * 128 * 2,
}
DEFAULT_POLICIES = "lru,arc,s3fifo,wtinylfu,belady"
DEFAULT_CAPACITIES = "1%,5%,10%,25%"
FLEET_POLICIES = "lru"
FLEET_CAPACITIES = "1%,5%"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sim", help="replay a trace through the host tier: hit ratios, savings, plots")
    p.add_argument(
        "source", help=f"a Mooncake-format JSONL trace, or a built-in workload: {', '.join(WORKLOADS)}"
    )
    p.add_argument(
        "--policies",
        default=None,
        help=f"comma-separated (default {DEFAULT_POLICIES}; with --replicas {FLEET_POLICIES})",
    )
    p.add_argument(
        "--capacities",
        default=None,
        help="comma-separated host sizes: '5%%' or '0.05' of the unique blocks, '2000' blocks, "
        "or bytes like '8GiB' (default " + DEFAULT_CAPACITIES.replace("%", "%%") + "; with --replicas "
        "per replica, default " + FLEET_CAPACITIES.replace("%", "%%") + ")",
    )
    p.add_argument(
        "--disk-capacities",
        default=None,
        help="comma-separated disk-tier sizes below the host tier, in the same forms as "
        "--capacities, e.g. '10%%,64GiB' (default: no disk tier)",
    )
    p.add_argument(
        "--disk-bandwidth",
        default="5GB",
        help="disk-to-host read bytes per second, e.g. '5GB' (default 5GB; with --disk-capacities)",
    )
    p.add_argument(
        "--shared-capacity",
        default=None,
        help="with --replicas: a shared tier (e.g. one Redis server) under every replica's host tier, "
        "sized for the whole fleet in the forms of --capacities (default: none)",
    )
    p.add_argument(
        "--remote-bandwidth",
        default="3GB",
        help="shared-tier-to-host bytes per second, e.g. '3GB' (default 3GB; with --shared-capacity)",
    )
    p.add_argument(
        "--disk-policy",
        default=None,
        help="eviction policy of the disk tier (default: the row's policy)",
    )
    p.add_argument(
        "--disk-admit",
        choices=ADMISSION,
        default=None,
        help="which blocks go to disk: 'all' written through, or 'seen-twice' (Dynamo KVBM's rule: "
        f"a block stored to the host tier a second time) (default {DEFAULT_ADMISSION})",
    )
    p.add_argument(
        "--device-blocks",
        type=int,
        default=0,
        help="engine prefix cache in front, in blocks (default 0: none)",
    )
    p.add_argument(
        "--block-size",
        type=int,
        default=MOONCAKE_BLOCK_SIZE,
        help="tokens per block of a trace file (default 512)",
    )
    p.add_argument(
        "--replicas",
        type=int,
        default=None,
        help="simulate a fleet of this many engines, each with its own device and host tier "
        "(default: one engine, no routing)",
    )
    p.add_argument(
        "--routing",
        default=None,
        help=f"comma-separated routing policies with --replicas: {', '.join(ROUTINGS)} (default: all)",
    )
    p.add_argument(
        "--balance-threshold",
        type=float,
        default=None,
        help="kv_aware routes to the least loaded replica while the load imbalance (max/mean) "
        f"exceeds this; 'inf' turns the guard off (default {DEFAULT_BALANCE_THRESHOLD})",
    )
    p.add_argument(
        "--load-window",
        type=int,
        default=None,
        help="requests over which a replica's load (prefill tokens it computed) is counted "
        "(default 16 per replica)",
    )
    p.add_argument(
        "--tier-weights",
        default=None,
        help="kv_aware's index tier weights, e.g. 'host=0.5' (default device=1,host=0.75)",
    )
    p.add_argument(
        "--seed", type=int, default=0, help="seed of a built-in workload and of random routing (default 0)"
    )
    p.add_argument(
        "--model",
        choices=sorted(MODELS),
        default="llama3-8b",
        help="sets --kv-bytes-per-token (default llama3-8b)",
    )
    p.add_argument(
        "--kv-bytes-per-token",
        type=int,
        default=None,
        help="KV bytes per token (default: from --model, 131072)",
    )
    p.add_argument(
        "--prefill-tps", type=float, default=8000.0, help="prefill tokens per second (default 8000)"
    )
    p.add_argument(
        "--bandwidth", default="25GB", help="host-to-device bytes per second, e.g. '25GB' (default 25GB)"
    )
    p.add_argument("--csv", type=Path, default=Path("sim.csv"), help="CSV output (default sim.csv)")
    p.add_argument("--png", type=Path, default=Path("sim.png"), help="plot output (default sim.png)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--metrics-port",
        type=int,
        metavar="PORT",
        help="serve the host tier's counters on /metrics while each row replays, and print them per row "
        "(host-tier replay only)",
    )
    p.add_argument(
        "--metrics-host", default="127.0.0.1", help="address for --metrics-port (default 127.0.0.1)"
    )
    p.set_defaults(run=run)


def _split(text: str, flag: str) -> list[str]:
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise SystemExit(f"kvoffload sim: {flag} is empty: {text!r}")
    return items


def run(args: argparse.Namespace) -> int:
    try:
        cost, policies, capacities, disk_capacities, trace, fleet = _validate(args)
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
            )
        print(format_disk_table(disk_rows))
        print(
            f"{link}disk reads {cost.disk_bandwidth_bytes_per_s / 1e9:,.1f} GB/s, "
            f"{cost.kv_bytes_per_token:,} KV bytes/token; disk admission {admit}; "
            "stores and writes to disk overlap compute and are not charged"
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
        print(
            f"a shared tier of {args.shared_capacity} ({rows[0].shared_blocks:,} blocks) under every "
            f"host tier, read at {cost.remote_bandwidth_bytes_per_s / 1e9:,.1f} GB/s"
        )
    print(f"{link}{cost.kv_bytes_per_token:,} KV bytes/token; stores overlap compute and are not charged")
    write_csv(rows, args.csv)
    write_fleet_plot(rows, args.png, title=f"{title} per replica, {args.replicas} replicas")


def _validate_fleet(args: argparse.Namespace, policies: list[str], disk_capacities: list[str]) -> dict | None:
    """The fleet options checked (``None`` without ``--replicas``, where none may be given)."""
    options = {
        "--routing": args.routing,
        "--balance-threshold": args.balance_threshold,
        "--load-window": args.load_window,
        "--tier-weights": args.tier_weights,
    }
    if args.replicas is None:
        for flag, value in options.items():
            if value is not None:
                raise ValueError(f"{flag} {value!r} needs --replicas")
        return None
    if args.replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {args.replicas}")
    if disk_capacities:
        raise ValueError(f"--disk-capacities {args.disk_capacities!r}: no disk tier in a fleet (--replicas)")
    if all(name.lower() == BELADY for name in policies):
        raise ValueError(f"--policies {args.policies!r}: belady has no fleet replay")
    try:
        routings = validate_routings(_split(args.routing or ",".join(ROUTINGS), "--routing"))
    except ValueError as exc:
        raise ValueError(f"--routing: {exc}") from None
    threshold = DEFAULT_BALANCE_THRESHOLD if args.balance_threshold is None else args.balance_threshold
    try:
        check_threshold(threshold)
    except ValueError:
        raise ValueError(f"--balance-threshold must be >= 1 (max/mean load), got {threshold!r}") from None
    window = default_load_window(args.replicas) if args.load_window is None else args.load_window
    if window < 1:
        raise ValueError(f"--load-window must be >= 1, got {window}")
    try:
        weights = TierWeights() if args.tier_weights is None else TierWeights.parse(args.tier_weights)
    except ValueError as exc:
        raise ValueError(f"--tier-weights: {exc}") from None
    return {"routings": routings, "balance_threshold": threshold, "load_window": window, "weights": weights}


def _validate(args: argparse.Namespace):
    """Every flag checked (errors name the flag and the value) and the trace loaded."""
    kv_bytes = args.kv_bytes_per_token if args.kv_bytes_per_token is not None else MODELS[args.model]
    cost = CostModel(
        args.prefill_tps,
        float(_flag_bytes(args.bandwidth, "--bandwidth")),
        kv_bytes,
        float(_flag_bytes(args.disk_bandwidth, "--disk-bandwidth")),
        float(_flag_bytes(args.remote_bandwidth, "--remote-bandwidth")),
    )
    in_fleet = args.replicas is not None
    if args.metrics_port is not None and not 0 <= args.metrics_port <= 65535:
        raise ValueError(f"--metrics-port must be a port in 0..65535, got {args.metrics_port}")
    if args.metrics_port is not None and (in_fleet or args.disk_capacities):
        raise ValueError(
            "--metrics-port serves the host-tier replay only, not --replicas or --disk-capacities"
        )
    if args.policies is None:
        args.policies = FLEET_POLICIES if in_fleet else DEFAULT_POLICIES
    if args.capacities is None:
        args.capacities = FLEET_CAPACITIES if in_fleet else DEFAULT_CAPACITIES
    policies = validate_policies(_split(args.policies, "--policies"))
    capacities = _split(args.capacities, "--capacities")
    disk_capacities = (
        [] if args.disk_capacities is None else _split(args.disk_capacities, "--disk-capacities")
    )
    for flag, value in (("--disk-policy", args.disk_policy), ("--disk-admit", args.disk_admit)):
        if value is not None and not disk_capacities:
            raise ValueError(f"{flag} {value!r} needs --disk-capacities")
    if args.disk_policy is not None:
        validate_policies([args.disk_policy])
    fleet = _validate_fleet(args, policies, disk_capacities)
    if disk_capacities and all(name.lower() == BELADY for name in policies):
        raise ValueError(f"--policies {args.policies!r}: belady has no replay with a disk tier")
    if args.device_blocks < 0:
        raise ValueError(f"--device-blocks must be >= 0, got {args.device_blocks}")
    if args.block_size <= 0:
        raise ValueError(f"--block-size must be positive, got {args.block_size}")
    trace = _load(args.source, args.block_size, args.seed)
    block_bytes = trace.block_size * cost.kv_bytes_per_token
    shared = [args.shared_capacity] if args.shared_capacity is not None else []
    if shared and not in_fleet:
        raise ValueError(f"--shared-capacity {args.shared_capacity!r} needs --replicas")
    for flag, specs in (("--capacities", capacities), ("--disk-capacities", disk_capacities),
                        ("--shared-capacity", shared)):  # fmt: skip
        for spec in specs:  # fail on a bad capacity before any replay
            try:
                blocks = parse_capacity(spec, trace.unique_blocks(), block_bytes)
            except ValueError as exc:
                raise ValueError(f"{flag}: {exc}") from None
            if flag == "--shared-capacity" and blocks == 0:
                raise ValueError(f"--shared-capacity {spec!r} holds no block (leave it out: no shared tier)")
    return cost, policies, capacities, disk_capacities, trace, fleet


def _flag_bytes(text: str, flag: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise ValueError(f"{flag}: {exc}") from None


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


def _load(source: str, block_size: int, seed: int):
    path = Path(source)
    if path.is_file():
        return read_trace(path, block_size)
    if source in WORKLOADS:
        return builtin_workload(source, seed)
    raise ValueError(
        f"no such trace file or built-in workload: {source!r} (built-in: {', '.join(WORKLOADS)})"
    )
