"""The options of ``kvoffload sim``: declared, defaulted and checked.

* ``add_arguments(parser)`` declares every option of the subcommand on ``parser``.
* ``validate(args)`` checks every flag before any replay, fills in the defaults that
  depend on other flags (``--policies`` and ``--capacities`` differ with ``--replicas``)
  and loads the trace. It returns ``(cost, policies, capacities, disk_capacities, trace,
  fleet)``, ``fleet`` the checked fleet options (``None`` without ``--replicas``). A bad
  value raises ``ValueError`` naming the flag and the value (an empty list ``SystemExit``),
  a bad trace ``TraceFormatError`` or ``OSError``.
* ``validate_sessions(args, trace, policies)`` checks the session options (``--hints``,
  ``--flood-*``) against the loaded trace and fills in their defaults: ``None`` without
  them, else the keyword arguments of ``kvoffload.sim.session_plan.plan_sessions``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvoffload.index.tiers import TierWeights
from kvoffload.sim.disk_plan import ADMISSION, DEFAULT_ADMISSION
from kvoffload.sim.fleet import default_load_window
from kvoffload.sim.flood import Flood
from kvoffload.sim.object_tier import OBJECT_WRITES
from kvoffload.sim.planning import BELADY, CostModel, parse_bytes, parse_capacity, validate_policies
from kvoffload.sim.routing import DEFAULT_BALANCE_THRESHOLD, ROUTINGS, check_threshold, validate_routings
from kvoffload.sim.session_plan import HINTS
from kvoffload.sim.sessions import pause_quantile, session_turns
from kvoffload.sim.trace import MOONCAKE_BLOCK_SIZE, Trace, read_trace
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


def add_arguments(p: argparse.ArgumentParser) -> None:
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
        "--shared-segment",
        default=None,
        help="with --replicas, instead of --shared-capacity: a shared store built from memory every "
        "replica contributes (Mooncake Store: each engine's segment), this much per replica in the forms "
        "of --capacities; the shared tier holds replicas x this (default: none)",
    )
    p.add_argument(
        "--remote-bandwidth",
        default="3GB",
        help="shared-tier-to-host bytes per second, e.g. '3GB' (default 3GB; with --shared-capacity)",
    )
    p.add_argument(
        "--object-capacity",
        metavar="SIZE",
        help="with --disk-capacities: an object-storage tier (S3) below the disk tier, in the forms "
        "of --capacities, e.g. '100%%' or '10TiB' (default: none)",
    )
    p.add_argument(
        "--object-bandwidth",
        default="1GB",
        help="object-tier-to-host bytes per second, e.g. '1GB' (default 1GB; with --object-capacity)",
    )
    p.add_argument(
        "--object-latency",
        type=float,
        default=0.03,
        metavar="SECONDS",
        help="an object GET's time to first byte, charged once per request with object hits "
        "(default 0.03; with --object-capacity)",
    )
    p.add_argument(
        "--object-writes",
        choices=OBJECT_WRITES,
        default=None,
        help="when blocks reach the object tier: 'through' (written through from the host tier, "
        "kvoffload's way; the default) or 'on-eviction' (only what the disk tier evicts)",
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
    p.add_argument(
        "--hints",
        choices=HINTS,
        default=None,
        help="replay sessions (kvoffload.sim.sessions) and report hit ratios over all and over resumed "
        "turns; 'retain' adds a replay where each turn but a session's last retains its blocks",
    )
    p.add_argument(
        "--retain-ttl-s",
        type=float,
        default=None,
        help="with --hints retain: seconds a turn retains its blocks (default: the 90th percentile pause)",
    )
    p.add_argument(
        "--retention-fraction",
        type=float,
        default=None,
        help="with --hints retain: the share of the host tier sessions may retain (default 0.5)",
    )
    p.add_argument(
        "--flood-every-s",
        type=float,
        default=None,
        help="a burst of one-off requests this often (default with --flood-size: the median pause)",
    )
    p.add_argument(
        "--flood-size",
        default=None,
        help="blocks per burst, in the forms of --capacities (default with --flood-every-s: 10%%)",
    )


def _split(text: str, flag: str) -> list[str]:
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise SystemExit(f"kvoffload sim: {flag} is empty: {text!r}")
    return items


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


def validate(args: argparse.Namespace):
    """Every flag checked (errors name the flag and the value) and the trace loaded."""
    cost = CostModel(
        args.prefill_tps,
        float(_flag_bytes(args.bandwidth, "--bandwidth")),
        _kv_bytes(args),
        float(_flag_bytes(args.disk_bandwidth, "--disk-bandwidth")),
        float(_flag_bytes(args.remote_bandwidth, "--remote-bandwidth")),
        float(_flag_bytes(args.object_bandwidth, "--object-bandwidth")),
        _latency(args.object_latency),
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
    for flag, value in (("--disk-policy", args.disk_policy), ("--disk-admit", args.disk_admit),
                        ("--object-capacity", args.object_capacity),
                        ("--object-writes", args.object_writes)):  # fmt: skip
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
    segment = [args.shared_segment] if args.shared_segment is not None else []
    if shared and segment:
        raise ValueError(
            f"--shared-segment {args.shared_segment!r} and --shared-capacity {args.shared_capacity!r}: "
            "give one (a segment per replica, or the store's total)"
        )
    for flag, given in (("--shared-capacity", shared), ("--shared-segment", segment)):
        if given and not in_fleet:
            raise ValueError(f"{flag} {given[0]!r} needs --replicas")
    objects = [args.object_capacity] if args.object_capacity is not None else []
    for flag, specs in (("--capacities", capacities), ("--disk-capacities", disk_capacities),
                        ("--shared-capacity", shared), ("--shared-segment", segment),
                        ("--object-capacity", objects)):  # fmt: skip
        for spec in specs:  # fail on a bad capacity before any replay
            try:
                blocks = parse_capacity(spec, trace.unique_blocks(), block_bytes)
            except ValueError as exc:
                raise ValueError(f"{flag}: {exc}") from None
            if flag in ("--shared-capacity", "--shared-segment", "--object-capacity") and blocks == 0:
                raise ValueError(f"{flag} {spec!r} holds no block (leave it out: no shared tier)")
            if flag == "--shared-segment":  # the store is every replica's segment together
                args.shared_capacity = str(blocks * args.replicas)
    return cost, policies, capacities, disk_capacities, trace, fleet


def _latency(value: float) -> float:
    if not value >= 0:
        raise ValueError(f"--object-latency must be seconds >= 0, got {value}")
    return value


def _flag_bytes(text: str, flag: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise ValueError(f"{flag}: {exc}") from None


def _load(source: str, block_size: int, seed: int):
    path = Path(source)
    if path.is_file():
        return read_trace(path, block_size)
    if source in WORKLOADS:
        return builtin_workload(source, seed)
    raise ValueError(
        f"no such trace file or built-in workload: {source!r} (built-in: {', '.join(WORKLOADS)})"
    )


def validate_sessions(args: argparse.Namespace, trace: Trace, policies: list[str]) -> dict | None:
    """The session options checked and defaulted (module docstring)."""
    flood_given = args.flood_every_s is not None or args.flood_size is not None
    for flag, value in (
        ("--retain-ttl-s", args.retain_ttl_s),
        ("--retention-fraction", args.retention_fraction),
    ):
        if value is not None and args.hints != "retain":
            raise ValueError(f"{flag} {value!r} needs --hints retain")
    if args.hints is None and not flood_given:
        return None
    for flag, value in (("--replicas", args.replicas), ("--disk-capacities", args.disk_capacities),
                        ("--metrics-port", args.metrics_port)):  # fmt: skip
        if value is not None:
            raise ValueError(f"{flag} {value!r}: the session replay (--hints, --flood-*) is host-tier only")
    if all(name.lower() == BELADY for name in policies):
        raise ValueError(f"--policies {args.policies!r}: belady has no session replay")
    turns = session_turns(trace)
    options: dict = {"hints": args.hints or "none", "flood": None}
    if args.hints == "retain":
        ttl = _positive(args.retain_ttl_s, pause_quantile(turns, 0.9), "--retain-ttl-s", trace)
        fraction = 0.5 if args.retention_fraction is None else args.retention_fraction
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"--retention-fraction must be in [0, 1], got {fraction}")
        options.update(ttl_s=ttl, retention_fraction=fraction)
    if flood_given:
        every = _positive(args.flood_every_s, pause_quantile(turns, 0.5), "--flood-every-s", trace)
        spec = args.flood_size or "10%"
        try:
            blocks = parse_capacity(spec, trace.unique_blocks(), trace.block_size * _kv_bytes(args))
        except ValueError as exc:
            raise ValueError(f"--flood-size: {exc}") from None
        options["flood"] = Flood(every_s=every, blocks=blocks)
    return options


def _positive(given: float | None, default: float | None, flag: str, trace: Trace) -> float:
    if given is None and default is None:
        raise ValueError(f"{trace.name} has no resumed turns: give {flag}")
    value = default if given is None else given
    if not value > 0:
        raise ValueError(f"{flag} must be positive seconds, got {value}")
    return value


def _kv_bytes(args: argparse.Namespace) -> int:
    return args.kv_bytes_per_token if args.kv_bytes_per_token is not None else MODELS[args.model]
