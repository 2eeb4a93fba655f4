"""Cost of the offloading scheduler on the engine's scheduling thread.

A synthetic engine: ``--requests`` concurrent requests of ``--prompt`` tokens (32 of them
shared by every request, the rest unique), 16-token blocks hashed like vLLM's, one
KV-cache group, a CPU tier large enough for everything. Each request is matched and
allocated, prefilled in one step, then decoded for ``--decode`` steps; every job is
completed as soon as it is planned. Reported: microseconds per request for ``match`` +
``on_allocated`` (half the requests find their prompt offloaded), and per scheduled
request per step for ``build_step`` + ``complete_jobs`` during prefill and decode, and per
request for ``request_finished`` (with the manager's ``on_request_finished``).

    .venv/bin/python bench/bench_scheduler.py [--requests N] [--prompt TOKENS] [--decode STEPS]
"""

from __future__ import annotations

import argparse
import sys
import time

from kvoffload.cpu import CPUOffloadingManager
from kvoffload.keys import BlockHasher
from kvoffload.scheduler import KVGroup, OffloadingScheduler, StepRequest

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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--decode", type=int, default=64)
    args = parser.parse_args()
    if min(args.requests, args.prompt, args.decode) <= 0:
        parser.error("--requests, --prompt and --decode must be positive")
    hasher = BlockHasher()
    manager = CPUOffloadingManager(
        args.requests * (args.prompt + args.decode) // BLOCK * 2, "lru", enable_events=True
    )
    sched = OffloadingScheduler(manager, [KVGroup(BLOCK)], hash_block_size=BLOCK, kv_events="self_describing")

    def batch(seed: int) -> list[Request]:
        return [
            Request(
                f"{seed}-{i}",
                list(range(32)) + [seed * 1_000_000 + i * 10_000 + t for t in range(args.prompt - 32)],
                hasher,
            )
            for i in range(args.requests)
        ]

    cold = run(sched, batch(1), args.decode)
    events = len(sched.take_events())
    warm = run(sched, batch(1)[: args.requests // 2] + batch(2)[: args.requests // 2], args.decode)
    print(
        f"{args.requests} requests x {args.prompt} prompt tokens, {args.decode} decode steps, "
        "16-token blocks; "
        f"{events} wire events from the first batch"
    )
    print()
    print("| phase | first batch (all miss) | second batch (half hit) |")
    print("|---|---:|---:|")
    for key in cold:
        print(f"| {key} | {cold[key]:.1f} | {warm[key]:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
