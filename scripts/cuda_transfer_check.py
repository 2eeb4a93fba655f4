"""Correctness and bandwidth of kvoffload.transfer on a CUDA device.

Run: .venv/bin/python scripts/cuda_transfer_check.py   (exits 0 with a message without CUDA)

1. Correctness: per-layer, cross-layer and K/V-split layouts on the GPU; three groups with
   different page sizes plus an empty one; F = 1 and 4; aligned and unaligned first
   blocks; store and load. Every byte of every device and host tensor is compared with
   a sub-block-by-sub-block reference computed on the CPU: mapped rows equal their
   source, everything else is untouched.
2. Bandwidth: 32 layers x 64 blocks per job, pages of 128, 64 and 16 KiB, F = 1 and 4,
   scattered and consecutive host ids, against one large pinned ``copy_`` of the same
   bytes in the same direction (the target is 85%). Also checks that a store overlaps
   a matmul running on the default stream.
"""

from __future__ import annotations

import sys
import time

import numpy as np
import torch

from kvoffload.specs import CPULoadStoreSpec, DeviceLoadStoreSpec
from kvoffload.transfer import HostBlockPool, KVLayout, TransferEngine

NUM_DEVICE, NUM_HOST = 48, 24


def build(kind: str, f: int, gen: torch.Generator) -> tuple[KVLayout, HostBlockPool]:
    dev = torch.device("cuda")
    specs = [(4, 256), (2, 512), (3, 40), (1, 64)]  # (layers, page bytes) per group
    if kind == "per_layer":
        caches, groups = {}, []
        for g, (layers, page) in enumerate(specs):
            names = [f"g{g}.l{i}" for i in range(layers)]
            for n in names:
                caches[n] = torch.randint(0, 256, (NUM_DEVICE, page), dtype=torch.uint8, generator=gen).to(
                    dev
                )
            groups.append(names)
        layout = KVLayout.from_layer_tensors(caches, groups)
    elif kind == "cross_layer":
        tensors = [
            KVLayout.cross_layer(
                torch.randint(0, 256, (NUM_DEVICE, layers, page), dtype=torch.uint8, generator=gen).to(dev)
            ).tensors[0]
            for layers, page in specs
        ]
        layout = KVLayout(tensors, [[0], [1], [2], [3]])
    else:  # (2, num_blocks, ...) K/V caches
        caches = {
            f"l{g}": torch.randint(0, 256, (2, NUM_DEVICE, page), dtype=torch.uint8, generator=gen).to(dev)
            for g, (_, page) in enumerate(specs)
        }
        layout = KVLayout.from_layer_tensors(caches, [[n] for n in caches], block_dim=1)
    pool = HostBlockPool(layout, NUM_HOST, blocks_per_offload_block=f)
    for t in pool.tensors:
        t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=gen))
    return layout, pool


def reference(layout, pool, dev_before, host_before, store, ids, sizes, indices, host_ids):
    dev, host = [t.clone() for t in dev_before], [t.clone() for t in host_before]
    f, d_off, h_off = pool.blocks_per_offload_block, 0, 0
    for g, n in enumerate(sizes):
        skip = indices[g] % f
        for i in range(n):
            h, k = host_ids[h_off + (skip + i) // f], (skip + i) % f
            for t in layout.groups[g]:
                p = layout.page_bytes(t)
                if store:
                    host[t][h, k * p : (k + 1) * p] = dev[t][ids[d_off + i]]
                else:
                    dev[t][ids[d_off + i]] = host[t][h, k * p : (k + 1) * p]
        d_off += n
        h_off += -(-(skip + n) // f) if n else 0
    return dev, host


def check_correctness() -> int:
    gen = torch.Generator().manual_seed(0)
    rng = np.random.default_rng(0)
    failures = cases = 0
    for kind in ("per_layer", "cross_layer", "kv_split"):
        for f in (1, 4):
            for aligned in (True, False):
                for store in (True, False):
                    layout, pool = build(kind, f, gen)
                    sizes = [6, 3, 5, 0]
                    indices = [0, 4, 8, 0] if aligned else [1, 6, 3, 2]
                    spans = [-(-(i % f + n) // f) if n else 0 for n, i in zip(sizes, indices)]
                    ids = rng.choice(NUM_DEVICE, sum(sizes), replace=False).tolist()
                    host_ids = rng.choice(NUM_HOST, sum(spans), replace=False).tolist()
                    dev_before = [t.cpu() for t in layout.tensors]
                    host_before = [t.clone() for t in pool.tensors]
                    want = reference(
                        layout, pool, dev_before, host_before, store, ids, sizes, indices, host_ids
                    )
                    d, h = DeviceLoadStoreSpec(ids, sizes, indices), CPULoadStoreSpec(host_ids)
                    with TransferEngine(layout, pool) as engine:
                        engine.submit(1, *((d, h) if store else (h, d)))
                        engine.wait([1])
                        (result,) = engine.poll()
                    ok = (
                        result.success
                        and all(torch.equal(a.cpu(), b) for a, b in zip(layout.tensors, want[0]))
                        and all(torch.equal(a, b) for a, b in zip(pool.tensors, want[1]))
                    )
                    cases += 1
                    if not ok:
                        failures += 1
                        print(f"FAIL {kind} F={f} aligned={aligned} store={store}: {result}")
    print(f"correctness: {cases - failures}/{cases} cases passed")
    return failures


def timed(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def flat_copy_seconds(nbytes: int) -> tuple[float, float]:
    """Best of 5 seconds of one flat pinned copy of ``nbytes`` each way (the baseline)."""
    dev_flat = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host_flat = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    d2h = min(timed(lambda: host_flat.copy_(dev_flat, non_blocking=True)) for _ in range(5))
    h2d = min(timed(lambda: dev_flat.copy_(host_flat, non_blocking=True)) for _ in range(5))
    return d2h, h2d


def bandwidth() -> None:
    layers, job, num_blocks = 32, 64, 512
    rng = np.random.default_rng(1)
    print("\n| direction | page | F | host ids | job GB/s | pinned copy_ GB/s | ratio |")
    print("|---|---|---|---|---|---|---|")
    for page in (128 << 10, 64 << 10, 16 << 10):
        nbytes = layers * job * page
        d2h, h2d = flat_copy_seconds(nbytes)
        kv = {
            f"l{i}": torch.empty((num_blocks, page), dtype=torch.uint8, device="cuda") for i in range(layers)
        }
        layout = KVLayout.from_layer_tensors(kv)
        for f in (1, 4):
            pool = HostBlockPool(layout, num_blocks // f, blocks_per_offload_block=f)
            with TransferEngine(layout, pool) as engine:
                for pattern in ("scattered", "consecutive"):
                    for store in (True, False):
                        best = float("inf")
                        for job_id in range(1, 7):
                            ids = rng.choice(num_blocks, job, replace=False)
                            if pattern == "scattered":
                                host = rng.choice(num_blocks // f, job // f, replace=False)
                            else:
                                host = np.arange(job // f) + rng.integers(0, num_blocks // f - job // f)
                            d, h = DeviceLoadStoreSpec(ids, [job], [0]), CPULoadStoreSpec(host)
                            t0 = time.perf_counter()
                            engine.submit(job_id, *((d, h) if store else (h, d)))
                            engine.wait([job_id])
                            best = min(best, time.perf_counter() - t0)
                            assert all(r.success for r in engine.poll())
                        base = d2h if store else h2d
                        print(
                            f"| {'store' if store else 'load'} | {page >> 10} KiB | {f} | {pattern} "
                            f"| {nbytes / best / 1e9:.1f} | {nbytes / base / 1e9:.1f} | {base / best:.2f} |"
                        )
            del pool
        del kv, layout
        torch.cuda.empty_cache()


def overlap() -> None:
    """A store on the side stream should barely slow a matmul on the default stream."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    compute = min(timed(lambda: [a @ a for _ in range(20)]) for _ in range(3))
    kv = {f"l{i}": torch.empty((512, 128 << 10), dtype=torch.uint8, device="cuda") for i in range(32)}
    layout = KVLayout.from_layer_tensors(kv)
    pool = HostBlockPool(layout, 256)
    with TransferEngine(layout, pool) as engine:

        def both():
            engine.submit(
                1, DeviceLoadStoreSpec(np.arange(256), [256], [0]), CPULoadStoreSpec(np.arange(256))
            )
            for _ in range(20):
                a @ a
            engine.wait([1])

        together = timed(both)
        (r,) = engine.poll()
    print(
        f"\noverlap: 20 matmuls {compute * 1e3:.1f} ms alone, {together * 1e3:.1f} ms with a "
        f"{r.bytes / 2**30:.1f} GiB store in flight (store copy time {r.seconds * 1e3:.1f} ms)"
    )


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: skipping the CUDA transfer check")
        return 0
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    failures = check_correctness()
    bandwidth()
    overlap()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
