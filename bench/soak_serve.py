"""Soak through vLLM's own load generator (issue 42, item 4).

vLLM's OpenAI server on 127.0.0.1 with a tiny random Llama built offline, driven by
``vllm bench serve`` with many concurrent clients: the shared Mooncake conversation trace
(``timed_trace``, read from ``../shared/traces/``, its 512-token blocks scaled to the
model's 32-token ones) and ``prefix_repetition``. Four servers, one after the other
(``_soak_run``): without a connector (the baseline and the reference outputs), with
kvoffload (CPU + disk on a small tmpfs + Redis, a share of loads and stores failing on
purpose, Redis killed with SIGKILL and restarted and the disk filled to ENOSPC while the
load runs), with kvoffload's CPU tier alone and no faults, and with vLLM's own
``OffloadingConnector`` (CPU, same budget) under the same load without faults.

Reported (printed, and as JSON with ``--json``): requests served and failed per phase,
outputs compared request by request with the baseline's, the engine process's RSS,
threads, open files and kvoffload's open files (disk-tier files, Redis connections) after
warm-up and at the end (and sampled every 2 s), hits from the engine's cache and from the
connector per phase (``/metrics``), time to first token per phase (the generator's
result JSON) as ratios to the baseline's and to vLLM's connector.

Run (the long form, about 4 x (duration + 1 min)):

    .venv/bin/python bench/soak_serve.py [--duration-s 600] [--short] [--json PATH]
        [--servers baseline,kvoffload,kvoffload-cpu,offloading] [--trace-rate R] [--prefix-rate R]
        [--concurrency N] [--fault-cycles N] [--work-dir DIR] [--trace-sample head|conversations]
        [--prefix-tokens N] [--prefixes N]

``--short``: the form ``tests/integrations/vllm/test_soak_serve.py`` runs (30 s of load,
the baseline without the trace's timing). Mounting the tmpfs needs root; elsewhere the
disk tier lives in the work folder and the disk-full faults are skipped (reported).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests")]  # the suite's redis-server helper

for _name, _value in (
    ("HF_HUB_OFFLINE", "1"),
    ("TRANSFORMERS_OFFLINE", "1"),
    ("VLLM_LOGGING_LEVEL", "WARNING"),
):
    os.environ.setdefault(_name, _value)

from _soak_run import SERVERS, BenchClient, ServerRun, SoakConfig, compare_outputs  # noqa: E402
from _soak_servers import soak_model  # noqa: E402


def short_config(work_dir: Path) -> SoakConfig:
    return SoakConfig(duration_s=30, trace_rate=2.0, trace_sample="conversations", prefix_rate=2.0,
                      prefix_tokens=512, prefixes=20, concurrency=16, fault_cycles=1,
                      baseline_same_timing=False,
                      servers=("kvoffload", "baseline"), work_dir=work_dir)  # fmt: skip


RESOURCES = ("rss_kib", "threads", "fds", "kvoffload_files", "redis_sockets")


def resources(report: dict) -> dict:
    """After warm-up, after the trace phase (its faults included), at the end, and the
    largest seen over the run."""
    samples = report.get("samples") or []
    out = {}
    for k in RESOURCES:
        out[k] = {p: report[f"{p}_sample"][k] for p in ("warmup", "trace", "last") if f"{p}_sample" in report}
        out[k]["max"] = max((s[k] for s in samples), default=None)
    return out


def summarize(reports: dict[str, dict]) -> dict:
    summary: dict = {"servers": {}}
    base = reports.get("baseline")
    for kind, report in reports.items():
        phases = {}
        for phase, data in report["phases"].items():
            r, m = data["result"], data["metrics"]
            phases[phase] = {
                "served": r["completed"], "failed": r["failed"], "wall_s": round(r["wall_s"], 1),
                "mean_ttft_ms": round(r["mean_ttft_ms"], 2), "median_ttft_ms": round(r["median_ttft_ms"], 2),
                "p99_ttft_ms": round(r["p99_ttft_ms"], 2),
                "connector_hit_ratio": round(m["connector_hit_ratio"], 4),
                "device_hit_ratio": round(m["device_hit_ratio"], 4),
                "prompt_tokens": m["prompt_tokens"], "failed_loads": m["failed_loads"],
                "failed_stores": m["failed_stores"], "tier_counters": m["tier_counters"],
                "kvoffload_hit_tokens_by_tier": m["kvoffload_hit_tokens_by_tier"],
            }  # fmt: skip
        entry = {
            "served": sum(p["served"] for p in phases.values()),
            "errors": sum(p["failed"] for p in phases.values()),
            "start_s": round(report.get("start_s", 0.0), 1),
            "phases": phases,
            "resources": resources(report),
        }
        if base is not None and kind != "baseline":
            entry["outputs_vs_baseline"] = compare_outputs(base, report)
        if report.get("faults"):
            entry["faults"] = report["faults"]
            entry["redis_keys_at_end"] = report.get("redis_keys_at_end")
            entry["tmpfs_mounted"] = report.get("tmpfs_mounted")
        summary["servers"][kind] = entry
    for phase in ("trace", "prefix"):
        ratios = {}
        pairs = (("kvoffload", "baseline"), ("kvoffload-cpu", "baseline"), ("offloading", "baseline"),
                 ("kvoffload", "offloading"), ("kvoffload-cpu", "offloading"))  # fmt: skip
        for a, b in pairs:
            if a in summary["servers"] and b in summary["servers"]:
                ta = summary["servers"][a]["phases"][phase]["mean_ttft_ms"]
                tb = summary["servers"][b]["phases"][phase]["mean_ttft_ms"]
                ratios[f"{a}/{b}"] = round(ta / tb, 3) if tb else None
        summary.setdefault("mean_ttft_ratios", {})[phase] = ratios
    return summary


def print_summary(summary: dict) -> None:
    for kind, s in summary["servers"].items():
        print(
            f"\n== {kind}: {s['served']} requests served, {s['errors']} errors "
            f"(server start {s['start_s']} s)"
        )
        for phase, p in s["phases"].items():
            print(f"  {phase:7s} served {p['served']:5d} failed {p['failed']:3d}"
                  f"  TTFT mean {p['mean_ttft_ms']:8.1f} ms"
                  f" p50 {p['median_ttft_ms']:8.1f} p99 {p['p99_ttft_ms']:8.1f}  connector hits "
                  f"{p['connector_hit_ratio']:.3f} device hits {p['device_hit_ratio']:.3f}"
                  f"  {p['wall_s']} s")  # fmt: skip
        for k, v in s["resources"].items():
            print(
                f"  {k:16s} after warm-up {v.get('warmup')!s:>9}  after trace {v.get('trace')!s:>9}"
                f"  last {v.get('last')!s:>9}  max {v.get('max')!s:>9}"
            )
        for phase, p in s["phases"].items():
            if p["tier_counters"]:
                print(f"  {phase} tier counters: {json.dumps(p['tier_counters'])}")
        if "outputs_vs_baseline" in s:
            print("  outputs vs baseline:", json.dumps(s["outputs_vs_baseline"]))
        for f in s.get("faults", []):
            print(f"  fault {f['phase']:6s} {f['action']:11s} at {f['requests_finished']:.0f} requests"
                  f" during_load={f['during_load']}"
                  + (f" ERROR {f['error']}" if "error" in f else ""))  # fmt: skip
    print("\nmean TTFT ratios:", json.dumps(summary.get("mean_ttft_ratios")))


def run(cfg: SoakConfig, model_dir: Path, parallel_start: bool = False, log=print) -> dict:
    """Every server of ``cfg``, one at a time; ``parallel_start``: all started at once first
    (the short form: start-up is most of its time), their loads still one at a time."""
    from redis_server import RedisServer

    model = soak_model(model_dir)
    cfg.work_dir.mkdir(parents=True, exist_ok=True)
    client = BenchClient(cfg.work_dir / "bench-client.log")
    runs = [ServerRun(kind, model, cfg, RedisServer, log=log) for kind in cfg.servers]
    try:
        if parallel_start:
            with ThreadPoolExecutor(len(runs)) as pool:
                for started in [pool.submit(r.start) for r in runs]:
                    started.result()
        for r in runs:
            if not parallel_start:
                r.start()
            try:
                r.run(client)
            finally:
                if not parallel_start:
                    r.close()
    finally:
        for r in runs:
            r.close()
        client.close()
    reports = {r.kind: r.report for r in runs}
    return {
        "config": {k: str(v) for k, v in vars(cfg).items()},
        "summary": summarize(reports),
        "reports": reports,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--duration-s", type=float, default=600.0, help="load per server (trace + prefix phases)"
    )
    parser.add_argument("--short", action="store_true", help="the test's short form")
    parser.add_argument("--servers", default=",".join(SERVERS))
    parser.add_argument("--trace-rate", type=float, default=3.0)
    parser.add_argument("--prefix-rate", type=float, default=3.0)
    parser.add_argument("--trace-sample", choices=("head", "conversations"), default="head")
    parser.add_argument("--prefix-tokens", type=int, default=1024)
    parser.add_argument("--prefixes", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument(
        "--fault-cycles", type=int, default=0, help="per faulted phase (default: one per 2 min)"
    )
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/kvoffload-soak"))
    parser.add_argument("--model-dir", type=Path, default=HERE.parent / ".cache" / "soak-llama")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = parser.parse_args()
    if args.short:
        cfg = short_config(args.work_dir)
    else:
        cycles = args.fault_cycles or max(1, round(args.duration_s / 2 / 120))
        cfg = SoakConfig(duration_s=args.duration_s, trace_rate=args.trace_rate, prefix_rate=args.prefix_rate,
                         trace_sample=args.trace_sample, prefix_tokens=args.prefix_tokens,
                         prefixes=args.prefixes,
                         concurrency=args.concurrency, fault_cycles=cycles, work_dir=args.work_dir,
                         servers=tuple(args.servers.split(",")))  # fmt: skip
    started = time.monotonic()
    out = run(cfg, args.model_dir, parallel_start=args.short)
    out["wall_s"] = time.monotonic() - started
    print_summary(out["summary"])
    print(f"\nwall {out['wall_s']:.0f} s")
    if args.json:
        slim = {k: v for k, v in out.items() if k != "reports"}
        slim["samples"] = {k: r.get("samples") for k, r in out["reports"].items()}
        args.json.write_text(json.dumps(slim, indent=1, default=str))


if __name__ == "__main__":
    main()
