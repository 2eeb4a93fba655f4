"""Bandwidth of store and load jobs against a plain contiguous copy of the same bytes.

Run: .venv/bin/python bench/bench_transfer.py [--reps N] [--quick]

Each case is a per-layer layout of 32 layers (one KV-cache group) whose pages are
``page`` bytes, jobs of 64 device blocks with scattered device and host ids, and F device
blocks per host block. A job's time is wall clock from ``submit`` to ``wait`` returning
(planning, queueing and copying). The baseline is ``dst.copy_(src)`` of one contiguous
tensor of the job's byte count, timed alternately with the jobs so both see the same
machine load; the ratio is the median of per-repetition ratios. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import torch

from kvoffload.cpu import CPULoadStoreSpec
from kvoffload.transfer import DeviceLoadStoreSpec, HostBlockPool, KVLayout, TransferEngine

LAYERS = 32
JOB_BLOCKS = 64
DEVICE_BLOCKS = 128


def bench_case(page: int, f: int, reps: int, rng: np.random.Generator) -> list[dict]:
    kv = {f"layer{i}": torch.full((DEVICE_BLOCKS, page), i, dtype=torch.uint8) for i in range(LAYERS)}
    layout = KVLayout.from_layer_tensors(kv)
    pool = HostBlockPool(layout, DEVICE_BLOCKS // f, blocks_per_host_block=f)
    for t in pool.tensors:
        t.fill_(255)  # touch the pages so first-use faults stay out of the timings
    nbytes = LAYERS * JOB_BLOCKS * page
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    rows = {"store": [], "load": []}
    with TransferEngine(layout, pool) as engine:
        job_id = 0
        for _ in range(reps + 1):  # the first repetition warms up and is dropped
            for direction in ("store", "load"):
                device = DeviceLoadStoreSpec(
                    rng.choice(DEVICE_BLOCKS, JOB_BLOCKS, replace=False), [JOB_BLOCKS], [0]
                )
                host = CPULoadStoreSpec(rng.choice(DEVICE_BLOCKS // f, JOB_BLOCKS // f, replace=False))
                t0 = time.perf_counter()
                dst.copy_(src)
                base = time.perf_counter() - t0
                t0 = time.perf_counter()
                engine.submit(job_id, *((device, host) if direction == "store" else (host, device)))
                engine.wait([job_id])
                job = time.perf_counter() - t0
                (result,) = engine.poll()
                assert result.success and result.bytes == nbytes, result
                job_id += 1
                rows[direction].append((base, job))
    out = []
    for direction, samples in rows.items():
        samples = samples[1:]
        out.append(
            {
                "direction": direction,
                "page": page,
                "f": f,
                "mb": nbytes / 2**20,
                "copy_gbs": nbytes / statistics.median(b for b, _ in samples) / 1e9,
                "job_gbs": nbytes / statistics.median(j for _, j in samples) / 1e9,
                "ratio": statistics.median(b / j for b, j in samples),
            }
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="fewer shapes, 3 repetitions")
    args = parser.parse_args()
    reps = 3 if args.quick else args.reps
    pages = [128 << 10, 64 << 10, 16 << 10, 4 << 10]
    if args.quick:
        pages = [128 << 10, 16 << 10]
    rng = np.random.default_rng(0)
    load = os.getloadavg()[0]
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} torch threads, "
        f"{os.cpu_count()} CPUs, load average {load:.2f} at start; "
        f"{LAYERS} layers x {JOB_BLOCKS} blocks per job, scattered ids, median of {reps}\n"
    )
    print("| direction | page | F | job MiB | contiguous copy GB/s | job GB/s | job / copy |")
    print("|---|---|---|---|---|---|---|")
    for page in pages:
        for f in (1, 4):
            for row in bench_case(page, f, reps, rng):
                print(
                    f"| {row['direction']} | {row['page'] >> 10} KiB | {row['f']} | {row['mb']:.0f} "
                    f"| {row['copy_gbs']:.1f} | {row['job_gbs']:.1f} | {row['ratio']:.2f} |",
                    flush=True,
                )
    print(f"\nload average {os.getloadavg()[0]:.2f} at end")


if __name__ == "__main__":
    main()
