"""Bandwidth of store and load jobs against a plain contiguous copy of the same bytes.

Run: .venv/bin/python bench/bench_transfer.py [--reps N] [--quick] [--pages 128,64]

Each case is a per-layer layout of 32 layers (one KV-cache group) whose pages are
``page`` bytes, jobs of 64 device blocks, and F device blocks per host block. Three id
patterns:

* ``consecutive``: consecutive device and host ids (vLLM hands out device blocks mostly
  in order; a fresh host pool); the best case;
* ``fresh host``: consecutive host ids (what the CPU tier hands out for never-used
  slots), scattered device ids;
* ``scattered``: scattered device and host ids (a worn pool; the worst case).

A job's time is wall clock from ``submit`` to ``wait`` returning (planning, queueing and
copying). The baseline is a contiguous copy of the job's byte count, taken two ways
and timed alternately with the jobs so all see the same machine load: torch's
``dst.copy_(src)`` on its intra-op threads, and the same copy cut into 1 MiB int64
slices run on a ``CopyPool`` with the engine's thread count (what the executor itself
uses). The ratio is the median over repetitions of (faster baseline) / job, so a
baseline that stumbles on a busy machine cannot flatter the jobs. Both baselines use plain
stores; the native copier streams, so a third contiguous copy, through the native copier
in 1 MiB ranges, is printed beside them (not in the ratio): it tells how much of a job's
speed is the stores and how much its pattern costs. ``--copier both`` (the default when
the native copier is built) times jobs through it and through numpy side by side, with a
ratio each. Before every timed copy a scratch buffer twice the size of a large L3 is
written, so jobs of a few MiB and their baseline all start from cold caches. Prints a
markdown table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import torch

from kvoffload.specs import CPULoadStoreSpec, DeviceLoadStoreSpec
from kvoffload.transfer import HostBlockPool, KVLayout, TransferEngine, native
from kvoffload.transfer.copy_pool import CopyPool
from kvoffload.transfer.cpu_executor import CPUExecutor

LAYERS = 32
JOB_BLOCKS = 64
DEVICE_BLOCKS = 128
PATTERNS = ("consecutive", "fresh host", "scattered")
_SCRATCH = np.zeros(64 << 20 >> 3, dtype=np.int64)


def evict_caches() -> None:
    np.add(_SCRATCH, 1, out=_SCRATCH)


def _slice_copy(dst: np.ndarray, src: np.ndarray) -> None:
    dst[:] = src


def job_ids(pattern: str, f: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    device = rng.choice(DEVICE_BLOCKS, JOB_BLOCKS, replace=False)
    if pattern == "consecutive":
        first = int(rng.integers(0, DEVICE_BLOCKS - JOB_BLOCKS + 1))
        device = np.arange(first, first + JOB_BLOCKS)
    host_blocks, used = DEVICE_BLOCKS // f, JOB_BLOCKS // f
    if pattern != "scattered":
        first = int(rng.integers(0, host_blocks - used + 1))
        host = np.arange(first, first + used)
    else:
        host = rng.choice(host_blocks, used, replace=False)
    return device, host


def bench_case(
    page: int,
    f: int,
    pattern: str,
    reps: int,
    rng: np.random.Generator,
    copies: CopyPool,
    copiers: list[bool],
) -> list[dict]:
    kv = {f"layer{i}": torch.full((DEVICE_BLOCKS, page), i, dtype=torch.uint8) for i in range(LAYERS)}
    layout = KVLayout.from_layer_tensors(kv)
    pool = HostBlockPool(layout, DEVICE_BLOCKS // f, blocks_per_offload_block=f)
    pools = [(pool, native) for native in copiers]
    if f == 1:  # the block-interleaved pool (what a disk tier prefers), same copier as the first
        pools.append((HostBlockPool(layout, DEVICE_BLOCKS, interleave=True), copiers[0]))
    for p in {id(p): p for p, _ in pools}.values():
        for t in p.tensors:
            t.fill_(255)  # touch the pages so first-use faults stay out of the timings
    nbytes = LAYERS * JOB_BLOCKS * page
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    step = 1 << 20  # the executor's default unit of work
    src64, dst64 = src.view(torch.int64).numpy(), dst.view(torch.int64).numpy()
    slices = [(dst64[i : i + step // 8], src64[i : i + step // 8]) for i in range(0, nbytes // 8, step // 8)]
    # The same contiguous copy through the native copier (streaming stores): what a job's
    # scattered ranges cost against contiguous ones with the same stores.
    ranges = [
        (dst.data_ptr(), src.data_ptr(), native.ByteRuns([i], [i], [min(step, nbytes - i)]))
        for i in range(0, nbytes, step)
    ]
    rows = {"store": [], "load": []}
    engines = [
        TransferEngine(
            layout,
            p,
            executor=CPUExecutor(layout, p, copy_threads=copies.threads, native_copies=native),
        )
        for p, native in pools
    ]
    try:
        job_id = 0
        for _ in range(reps + 1):  # the first repetition warms up and is dropped
            for direction in ("store", "load"):
                device_ids, host_ids = job_ids(pattern, f, rng)
                device = DeviceLoadStoreSpec(device_ids, [JOB_BLOCKS], [0])
                host = CPULoadStoreSpec(host_ids)
                evict_caches()
                t0 = time.perf_counter()
                dst.copy_(src)
                torch_copy = time.perf_counter() - t0
                evict_caches()
                t0 = time.perf_counter()
                copies.run(slices, _slice_copy)
                pool_copy = time.perf_counter() - t0
                native_copy = float("nan")
                if native.AVAILABLE:
                    evict_caches()
                    t0 = time.perf_counter()
                    copies.run(ranges, native.copy)
                    native_copy = time.perf_counter() - t0
                jobs = []
                for engine in engines:
                    evict_caches()
                    t0 = time.perf_counter()
                    engine.submit(job_id, *((device, host) if direction == "store" else (host, device)))
                    engine.wait([job_id])
                    jobs.append(time.perf_counter() - t0)
                    (result,) = engine.poll()
                    assert result.success and result.bytes == nbytes, result
                    job_id += 1
                rows[direction].append((torch_copy, pool_copy, jobs, native_copy))
    finally:
        for engine in engines:
            engine.close()
    out = []
    for direction, samples in rows.items():
        samples = samples[1:]
        out.append(
            {
                "direction": direction,
                "pattern": pattern,
                "page": page,
                "f": f,
                "mb": nbytes / 2**20,
                "torch_gbs": nbytes / statistics.median(s[0] for s in samples) / 1e9,
                "pool_gbs": nbytes / statistics.median(s[1] for s in samples) / 1e9,
                "native_gbs": nbytes / statistics.median(s[3] for s in samples) / 1e9,
                "jobs": [
                    (
                        nbytes / statistics.median(s[2][i] for s in samples) / 1e9,
                        statistics.median(min(s[0], s[1]) / s[2][i] for s in samples),
                    )
                    for i in range(len(engines))
                ],
            }
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="fewer shapes, 3 repetitions")
    parser.add_argument("--pages", help="page sizes in KiB, comma separated (default 128,64,16,4)")
    parser.add_argument(
        "--copier",
        choices=("native", "numpy", "both"),
        default="both" if native.AVAILABLE else "numpy",
        help="the CPU executor's copier: kvoffload.transfer.native, numpy, or both side by side",
    )
    args = parser.parse_args()
    copiers = {"native": [True], "numpy": [False], "both": [True, False]}[args.copier]
    names = ["native" if c else "numpy" for c in copiers]
    reps = 3 if args.quick else args.reps
    pages = [128 << 10, 64 << 10, 16 << 10, 4 << 10]
    if args.quick:
        pages = [128 << 10, 16 << 10]
    if args.pages:
        try:
            pages = [int(p) << 10 for p in args.pages.split(",")]
        except ValueError:
            parser.error(f"--pages takes page sizes in KiB separated by commas, got {args.pages!r}")
        if min(pages) <= 0:
            parser.error(f"--pages sizes must be positive, got {args.pages!r}")
    rng = np.random.default_rng(0)
    threads = min(8, os.cpu_count() or 1)  # the engine's default
    cpu0, wall0 = time.process_time(), time.perf_counter()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} torch threads, {threads} copy threads, "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at start; "
        f"{LAYERS} layers x {JOB_BLOCKS} blocks per job, median of {reps}\n"
    )
    names.append(f"interleaved pool, {names[0]}")
    job_heads = "".join(f" {n} job GB/s | {n} job / faster copy |" for n in names)
    print(
        f"| direction | ids | page | F | job MiB | torch copy GB/s | pool copy GB/s |{job_heads}"
        " streaming copy GB/s |"
    )
    print("|---" * (8 + 2 * len(names)) + "|")
    copies = CopyPool(threads, "bench-copy")
    try:
        for page in pages:
            for f in (1, 4):
                for pattern in PATTERNS:
                    for row in bench_case(page, f, pattern, reps, rng, copies, copiers):
                        cells = row["jobs"] + [(None, None)] * (len(names) - len(row["jobs"]))
                        jobs = "".join(
                            " - | - |" if gbs is None else f" {gbs:.1f} | {ratio:.2f} |"
                            for gbs, ratio in cells
                        )
                        print(
                            f"| {row['direction']} | {row['pattern']} | {row['page'] >> 10} KiB | {row['f']} "
                            f"| {row['mb']:.0f} | {row['torch_gbs']:.1f} | {row['pool_gbs']:.1f} |{jobs}"
                            f" {row['native_gbs']:.1f} |",
                            flush=True,
                        )
    finally:
        copies.close()
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    print(
        f"\nload average {os.getloadavg()[0]:.2f} at end; this process used {cpu:.1f} s of CPU "
        f"in {wall:.1f} s of wall time"
    )


if __name__ == "__main__":
    main()
