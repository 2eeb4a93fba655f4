"""``kvoffload sim``: replay a trace (a Mooncake JSONL path, or a built-in synthetic
workload) for a list of eviction policies and host-tier capacities, print hit ratios per
tier, tokens saved, bytes moved and an estimate of prefill time saved, and write a CSV and
a PNG of hit ratio against capacity."""

from __future__ import annotations

import argparse
from pathlib import Path

from tqdm import tqdm

from kvoffload.sim.planning import CostModel, parse_capacity, plan, validate_policies
from kvoffload.sim.report import format_table, write_csv, write_plot
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


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sim", help="replay a trace through the host tier: hit ratios, savings, plots")
    p.add_argument(
        "source", help=f"a Mooncake-format JSONL trace, or a built-in workload: {', '.join(WORKLOADS)}"
    )
    p.add_argument(
        "--policies", default=DEFAULT_POLICIES, help=f"comma-separated (default {DEFAULT_POLICIES})"
    )
    p.add_argument(
        "--capacities",
        default=DEFAULT_CAPACITIES,
        help="comma-separated host sizes: '5%%' or '0.05' of the unique blocks, '2000' blocks, "
        "or bytes like '8GiB' (default " + DEFAULT_CAPACITIES.replace("%", "%%") + ")",
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
    p.add_argument("--seed", type=int, default=0, help="seed of a built-in workload (default 0)")
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
    p.set_defaults(run=run)


def _split(text: str, flag: str) -> list[str]:
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise SystemExit(f"kvoffload sim: {flag} is empty: {text!r}")
    return items


def run(args: argparse.Namespace) -> int:
    from kvoffload.sim.planning import parse_bytes

    try:
        kv_bytes = args.kv_bytes_per_token if args.kv_bytes_per_token is not None else MODELS[args.model]
        cost = CostModel(args.prefill_tps, float(parse_bytes(args.bandwidth)), kv_bytes)
        policies = validate_policies(_split(args.policies, "--policies"))
        capacities = _split(args.capacities, "--capacities")
        if args.device_blocks < 0:
            raise ValueError(f"--device-blocks must be >= 0, got {args.device_blocks}")
        if args.block_size <= 0:
            raise ValueError(f"--block-size must be positive, got {args.block_size}")
        trace = _load(args.source, args.block_size, args.seed)
        for spec in capacities:  # fail on a bad capacity before any replay
            parse_capacity(spec, trace.unique_blocks(), trace.block_size * cost.kv_bytes_per_token)
    except (ValueError, TraceFormatError, OSError) as exc:
        raise SystemExit(f"kvoffload sim: {exc}") from None
    print(
        f"{trace.name}: {len(trace.requests)} requests, {trace.block_references()} block references, "
        f"{trace.unique_blocks()} unique blocks of {trace.block_size} tokens; "
        f"device tier {args.device_blocks} blocks"
    )
    bar = tqdm(total=len(policies) * len(capacities), disable=args.no_progress, unit="replay")
    try:
        rows = plan(
            trace,
            policies,
            capacities,
            args.device_blocks,
            cost,
            progress=lambda what: (bar.set_description(what), bar.update(0)),
        )
    finally:
        bar.close()
    print(format_table(rows))
    print(
        f"cost model: prefill {cost.prefill_tokens_per_s:,.0f} tokens/s, "
        f"link {cost.bandwidth_bytes_per_s / 1e9:,.1f} GB/s, "
        f"{cost.kv_bytes_per_token:,} KV bytes/token; stores overlap compute and are not charged"
    )
    write_csv(rows, args.csv)
    write_plot(rows, args.png, title=f"{trace.name}, device tier {args.device_blocks} blocks")
    print(f"wrote {args.csv} and {args.png}")
    return 0


def _load(source: str, block_size: int, seed: int):
    path = Path(source)
    if path.is_file():
        return read_trace(path, block_size)
    if source in WORKLOADS:
        return builtin_workload(source, seed)
    raise ValueError(
        f"no such trace file or built-in workload: {source!r} (built-in: {', '.join(WORKLOADS)})"
    )
