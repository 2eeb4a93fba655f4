"""Cost of the offloading scheduler on the engine's scheduling thread.

A synthetic engine: ``--requests`` concurrent requests of ``--prompt`` tokens (32 of them
shared by every request, the rest unique), 16-token blocks hashed like vLLM's, one
KV-cache group, a CPU tier large enough for everything. Each request is matched and
allocated, prefilled in one step, then decoded for ``--decode`` steps; every job is
completed as soon as it is planned. Reported: microseconds per request for ``match`` +
``on_allocated`` (half the requests find their prompt offloaded), and per scheduled
request per step for ``build_step`` + ``complete_jobs`` during prefill and decode, and per
request for ``request_finished`` (with the manager's ``on_request_finished``).

Each repetition runs it over the CPU tier alone and over the CPU tier with a disk tier
below it (``FSOffloadingManager``; the write-throughs the steps plan are never run, so
the disk tier holds their blocks in flight), then times ``lookup`` of keys stored in the
CPU tier and of keys no tier holds on both managers in turns. ``--disk-fill N`` first
puts N blocks of other keys on the disk tier (a full disk index of N blocks).

    .venv/bin/python bench/bench_scheduler.py [--requests N] [--prompt TOKENS] [--decode STEPS]
        [--reps N] [--disk-fill BLOCKS]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time

from kvoffload.cpu import CPUOffloadingManager
from kvoffload.keys import BlockHasher, make_offload_key
from kvoffload.scheduler import KVGroup, OffloadingScheduler, StepRequest
from kvoffload.tiers.fs.format import Geometry
from kvoffload.tiers.fs.manager import FSOffloadingManager
from kvoffload.tiers.tiered import TieredOffloadingManager

BLOCK = 16


class Request:
    def __init__(self, req_id: str, tokens: list[int], hasher: BlockHasher):
        self.request_id = req_id
        self.all_token_ids = tokens
        self.num_prompt_tokens = len(tokens)
        self.block_hashes = hasher.hash_request(tokens, BLOCK)
        self._hasher = hasher

    def append(self, token: int) -> None:
        self.all_token_ids.append(token)
        if len(self.all_token_ids) % BLOCK == 0:
            parent = self.block_hashes[-1] if self.block_hashes else None
            self.block_hashes.append(self._hasher.hash_block(parent, self.all_token_ids[-BLOCK:]))


def run(sched: OffloadingScheduler, requests: list[Request], decode: int) -> dict[str, float]:
    t0 = time.perf_counter()
    next_block = 0
    for req in requests:
        n = sched.match(req, 0)
        blocks = -(-(req.num_prompt_tokens + decode) // BLOCK)
        sched.on_allocated(req.request_id, [list(range(next_block, next_block + blocks))], n or 0)
        next_block += blocks
    t1 = time.perf_counter()
    plan = sched.build_step(StepRequest(r.request_id, None, r.num_prompt_tokens) for r in requests)
    sched.complete_jobs((job.job_id, True) for job in plan.loads + plan.stores)
    t2 = time.perf_counter()
    decode_s = 0.0
    for _ in range(decode):
        for r in requests:
            r.append(7)
        start = time.perf_counter()
        plan = sched.build_step(StepRequest(r.request_id, None, len(r.all_token_ids) - 1) for r in requests)
        sched.complete_jobs((job.job_id, True) for job in plan.stores)
        decode_s += time.perf_counter() - start
    t3 = time.perf_counter()
    for r in requests:
        sched.request_finished(r.request_id)
    t4 = time.perf_counter()
    n = len(requests)
    return {
        "match + allocate, us/request": (t1 - t0) / n * 1e6,
        "prefill step, us/request": (t2 - t1) / n * 1e6,
        "decode step, us/request": decode_s / max(decode, 1) / n * 1e6,
        "request_finished, us/request": (t4 - t3) / n * 1e6,
    }


def sched_keys(request: Request) -> list:
    return [make_offload_key(h, 0) for h in request.block_hashes]


def lookup_ns(managers: dict[str, object], keys: list, passes: int = 9) -> dict[str, float]:
    """Nanoseconds per ``lookup`` over ``keys`` for each manager (their hashes cached, as
    the scheduler's are): ``passes`` passes over the keys per manager, the managers taken
    in turns pass by pass so that they share the machine's noisy moments; the median pass.
    Use many keys: a few hundred would sit in the CPU's caches after the first pass, which
    the scheduler's lookups do not."""
    for key in keys:
        hash(key)
    times: dict[str, list[float]] = {name: [] for name in managers}
    for _ in range(passes):
        for name, manager in managers.items():
            lookup = manager.lookup
            start = time.perf_counter()
            for key in keys:
                lookup(key)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) / len(keys) * 1e9 for name, t in times.items()}


def make_manager(kind: str, blocks: int, folder: str, disk_fill: int = 0):
    """A CPU tier of ``blocks`` blocks, alone (``cpu``) or over a disk tier (``cpu+fs``) of
    ``4 * blocks`` blocks, or of ``disk_fill`` blocks holding as many blocks of their own
    (keys no request names) when ``disk_fill`` is larger."""
    cpu = CPUOffloadingManager(blocks, "lru", enable_events=True)
    if kind == "cpu":
        return cpu
    slots = max(4 * blocks, disk_fill)
    disk = FSOffloadingManager(folder, "bench", 4096, slots * Geometry(4096).stored_block_bytes)
    for start in range(0, disk_fill, 4096):
        batch = [
            make_offload_key(i.to_bytes(32, "big"), 7) for i in range(start, min(start + 4096, disk_fill))
        ]
        disk.complete_store(disk.prepare_store(batch).keys_to_store)
    return TieredOffloadingManager(cpu, [disk])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--decode", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3, help="runs per manager, taken in turns")
    parser.add_argument(
        "--disk-fill", type=int, default=0, help="blocks of other keys on the disk tier (default: none)"
    )
    args = parser.parse_args()
    if min(args.requests, args.prompt, args.decode, args.reps) <= 0:
        parser.error("--requests, --prompt, --decode and --reps must be positive")
    hasher = BlockHasher()
    blocks = args.requests * (args.prompt + args.decode) // BLOCK * 2

    def batch(seed: int) -> list[Request]:
        return [
            Request(
                f"{seed}-{i}",
                list(range(32)) + [seed * 1_000_000 + i * 10_000 + t for t in range(args.prompt - 32)],
                hasher,
            )
            for i in range(args.requests)
        ]

    kinds = ("cpu", "cpu+fs")
    results: dict[str, list[tuple[dict, dict]]] = {k: [] for k in kinds}
    events = 0
    with tempfile.TemporaryDirectory() as folder:
        for rep in range(args.reps):
            managers = {}
            for kind in kinds:
                manager = managers[kind] = make_manager(
                    kind, blocks, os.path.join(folder, f"{kind}-{rep}"), args.disk_fill
                )
                sched = OffloadingScheduler(
                    manager, [KVGroup(BLOCK)], hash_block_size=BLOCK, kv_events="self_describing"
                )
                cold = run(sched, batch(1), args.decode)
                events = len(sched.take_events())
                warm = run(
                    sched, batch(1)[: args.requests // 2] + batch(2)[: args.requests // 2], args.decode
                )
                results[kind].append((cold, warm))
            stored = [k for r in batch(1)[:96] for k in sched_keys(r)[2:]]
            absent = [k for r in batch(3)[:96] for k in sched_keys(r)[2:]]  # 2 are shared
            for name, keys in (
                ("lookup of a stored key, ns", stored),
                ("lookup that misses every tier, ns", absent),
            ):
                for kind, ns in lookup_ns(managers, keys).items():
                    results[kind][-1][0][name] = ns
            for manager in managers.values():
                manager.close()
    print(
        f"{args.requests} requests x {args.prompt} prompt tokens, {args.decode} decode steps, "
        f"16-token blocks; {events} wire events from the first batch; median of {args.reps} runs "
        f"per manager, taken in turns; disk tier filled with {args.disk_fill} blocks; "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    print()
    print(
        "| phase | CPU tier: first batch (all miss) | second batch (half hit) "
        "| CPU + disk tier: first batch | second batch | CPU + disk / CPU, first batch |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for key in results["cpu"][0][0]:
        cells = []
        for kind in kinds:
            for i in (0, 1):
                values = [r[i].get(key, math.nan) for r in results[kind]]
                cells.append(statistics.median(values))
        ratio = cells[2] / cells[0]
        cells = [f"{c:.1f}" if not math.isnan(c) else "" for c in cells] + [f"{ratio:.2f}"]
        print(f"| {key} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
