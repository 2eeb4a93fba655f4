"""One-shot validation of kvoffload's CUDA transfer path on one NVIDIA GPU.

Run from the repository root, with the CUDA build of torch and nothing else installed:

    PYTHONPATH=src python3 scripts/cuda_transfer_check.py

It imports only torch, numpy, the standard library and kvoffload; it needs no network.
Progress goes to stderr; the last line on stdout is one JSON summary with the targets
and whether each was met. Exit status 1 when a target is missed, 0 otherwise (also 0,
with ``"skipped"``, without CUDA). Every wait has a timeout (a hang is counted, never
waited out); sections still to run after ``BUDGET_S`` are skipped. Expect 2-4 minutes.

1. ``round_trips``: >= 200 mixed store and load jobs (per-layer, cross-layer and K/V-split
   layouts; four groups with different page sizes, one often empty; F = 1 on the
   interleaved pool and F = 4 on the tensor-major one; aligned and unaligned first blocks;
   a tiny staging cap that forces many batches) while the submitting compute stream runs
   matmuls; every byte of every device and host tensor compared with a CPU reference.
2. ``ordering``: each rule checked, and the same check run on a deliberately broken
   executor, which must fail it (otherwise the check proves nothing): a store sees the
   KV written before it was submitted; a load lands after the block zeroing queued
   before it; a job is reported only once its copies finished; a staging buffer is
   refilled only after its previous batch crossed the bus (under a slowed link).
3. ``failure_fence``: a job fails after its copies were queued (the end event's record
   raises); how long its copies kept running after the failure was reported (~0), and
   the same without the fence.
4. ``far_apart``: the one-kernel gather and scatter over two tensors 20 GiB apart (span
   offsets past 2**31 elements), byte-exact both ways.
5. ``bandwidth``: 32 layers, 128-block jobs, pages of 4-128 KiB, consecutive and
   scattered host ids, store and load; the batched path (one gather kernel per batch),
   the same with one kernel per tensor, and the per-row path, against one large pinned
   ``copy_`` of the same bytes; CPU time per job. Each job is timed alone (submit to
   finished: its planning and the hand-offs between threads count), and the batched path
   also with four jobs queued back to back (throughput).
6. ``cpu_while_waiting``: process CPU time over wall time while one long job is waited
   for (blocking events), and with spinning events (the broken variant).
7. ``matmul_slowdown``: a matmul loop alone and with stores and loads in flight.
8. ``pinned_region``: allocation time and size of the pool's region (pinned in parallel
   chunks) against one ``cudaHostRegister`` call and ``torch.empty(pin_memory=True)``.
9. ``staging``: the executors' staging cap (per worker thread) and peak staging bytes; ``bandwidth`` also
   reports the device memory the transfers took beyond the KV cache, per page size.
"""

from __future__ import annotations

import json
import sys
import time
import traceback

import numpy as np
import torch

from kvoffload.specs import CPULoadStoreSpec, DeviceLoadStoreSpec
from kvoffload.transfer import HostBlockPool, KVLayout, TransferEngine
from kvoffload.transfer.cuda_executor import DEFAULT_STAGING_BYTES, CUDAExecutor
from kvoffload.transfer.staging_plan import plan_batches

BUDGET_S = 420.0  # stop starting sections after 7 minutes
WAIT_S = 60.0  # any single wait longer than this is a hang
START = time.monotonic()
HANGS = 0
# The default cap holds per worker thread (one for stores, one for loads).
PEAK_STAGING = {"cap_bytes_per_thread": DEFAULT_STAGING_BYTES, "threads": 2, "peak_bytes": 0}


def log(message: str) -> None:
    print(f"[{time.monotonic() - START:6.1f}s] {message}", file=sys.stderr, flush=True)


def wait(engine: TransferEngine, ids: list[int]) -> bool:
    global HANGS
    try:
        engine.wait(ids, WAIT_S)
        return True
    except TimeoutError:
        HANGS += 1
        return False


def note_staging(executor: CUDAExecutor) -> None:
    PEAK_STAGING["peak_bytes"] = max(PEAK_STAGING["peak_bytes"], executor.peak_staging_bytes)


def gpu_sleep(ms: float) -> None:
    """Keep the current stream busy for about ``ms`` milliseconds."""
    torch.cuda._sleep(int(ms * CYCLES_PER_MS))


def calibrate() -> float:
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(100_000_000)
    end.record()
    end.synchronize()
    return 100_000_000 / start.elapsed_time(end)


# -- broken variants ------------------------------------------------------------------


class NoReady(CUDAExecutor):
    def ready_event(self):
        return None  # copies start at once, not after the submitter's queued work


class NoFence(CUDAExecutor):
    def _fence(self, state) -> None:
        pass  # a failed job is reported while its copies run


class SlowLink(CUDAExecutor):
    """Each batch's bus copies queue behind ~5 ms of device work: a slow link, under
    which reusing a staging buffer too early shows."""

    def _copy(self, store, batch, staging) -> None:
        gpu_sleep(5.0)
        super()._copy(store, batch, staging)


class ReuseAtOnce(SlowLink):
    def _reuse_after(self, stream, freed) -> None:
        pass  # a staging buffer is refilled while its previous batch still crosses the bus


class _Cuda:
    """torch.cuda with some Event behaviour changed."""

    def __init__(self, blocking: bool | None = None, sync: bool = True, fail_end: bool = False) -> None:
        self.blocking, self.sync, self.fail_end = blocking, sync, fail_end

    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    def Event(self, enable_timing: bool = False, blocking: bool = False):  # noqa: N802
        if self.blocking is not None:
            blocking = self.blocking
        return _Event(torch.cuda.Event(enable_timing=enable_timing, blocking=blocking), self, enable_timing)


class _Event:
    def __init__(self, event, cuda: _Cuda, timing: bool) -> None:
        self.event, self.cuda, self.timing = event, cuda, timing
        self.is_end = False

    def record(self, stream=None) -> None:
        if self.cuda.fail_end and self.timing and getattr(self.cuda, "_started", False):
            self.cuda._started = False
            raise RuntimeError("injected failure recording the end event")
        if self.timing:
            self.cuda._started = True
        self.event.record(stream)

    def synchronize(self) -> None:
        if self.cuda.sync:
            self.event.synchronize()

    def elapsed_time(self, other) -> float:
        return self.event.elapsed_time(other.event) if self.cuda.sync else 0.0

    def __getattr__(self, name):
        return getattr(self.event, name)


# -- 1. round trips -------------------------------------------------------------------

GROUPS = [(4, 256), (2, 512), (3, 36), (1, 64)]  # (layers, page bytes) per group
NUM_DEVICE, NUM_HOST = 64, 48


def build(kind: str, f: int, gen: torch.Generator, device: str) -> tuple[KVLayout, HostBlockPool]:
    def rand(*shape):
        return torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen).to(device)

    if kind == "per_layer":
        caches, groups = {}, []
        for g, (layers, page) in enumerate(GROUPS):
            names = [f"g{g}.l{i}" for i in range(layers)]
            caches.update({n: rand(NUM_DEVICE, page) for n in names})
            groups.append(names)
        layout = KVLayout.from_layer_tensors(caches, groups)
    elif kind == "cross_layer":
        views = [KVLayout.cross_layer(rand(NUM_DEVICE, layers, page)).tensors[0] for layers, page in GROUPS]
        layout = KVLayout(views, [[0], [1], [2], [3]])
    else:  # (2, num_blocks, ...) K/V caches
        caches = {f"l{g}": rand(2, NUM_DEVICE, page) for g, (_, page) in enumerate(GROUPS)}
        layout = KVLayout.from_layer_tensors(caches, [[n] for n in caches], block_dim=1)
    pool = HostBlockPool(layout, NUM_HOST, blocks_per_offload_block=f)
    pool.region.copy_(torch.randint(0, 256, pool.region.shape, dtype=torch.uint8, generator=gen))
    return layout, pool


def random_batch(layout: KVLayout, f: int, rng: np.random.Generator, njobs: int) -> list[tuple]:
    """Jobs with pairwise disjoint device and host blocks: their outcome is independent of
    the order the store and load workers run them in."""
    device_free, host_free = list(rng.permutation(NUM_DEVICE)), list(rng.permutation(NUM_HOST))
    jobs = []
    for _ in range(njobs):
        sizes = [int(rng.integers(0, 5)) if rng.random() < 0.8 else 0 for _ in range(layout.num_groups)]
        indices = [int(rng.integers(0, 9)) for _ in sizes]
        spans = [-(-(i % f + n) // f) if n else 0 for n, i in zip(sizes, indices)]
        if sum(sizes) > len(device_free) or sum(spans) > len(host_free):
            break
        ids = [int(device_free.pop()) for _ in range(sum(sizes))]
        hosts = [int(host_free.pop()) for _ in range(sum(spans))]
        jobs.append((bool(rng.random() < 0.5), ids, sizes, indices, hosts))
    return jobs


def reference(layout: KVLayout, f: int, dev: list, host: list, jobs: list[tuple]) -> None:
    """Apply ``jobs`` to CPU copies, one sub-block at a time."""
    for store, ids, sizes, indices, hosts in jobs:
        d_off = h_off = 0
        for g, n in enumerate(sizes):
            skip = indices[g] % f
            for i in range(n):
                h, k = hosts[h_off + (skip + i) // f], (skip + i) % f
                for t in layout.groups[g]:
                    p = layout.page_bytes(t)
                    if store:
                        host[t][h, k * p : (k + 1) * p] = dev[t][ids[d_off + i]]
                    else:
                        dev[t][ids[d_off + i]] = host[t][h, k * p : (k + 1) * p]
            d_off += n
            h_off += -(-(skip + n) // f) if n else 0


def round_trips(device: str = "cuda", busy: bool = True, matmul: int = 4096) -> dict:
    gen, rng = torch.Generator().manual_seed(0), np.random.default_rng(0)
    compute = torch.cuda.Stream() if busy else None
    a = torch.randn(matmul, matmul, device=device, dtype=torch.bfloat16) if busy else None
    jobs_run = wrong = failed = 0
    configs = []
    for kind in ("per_layer", "cross_layer", "kv_split"):
        for f in (1, 4):
            for cap in (64 << 20, 1 << 10):
                layout, pool = build(kind, f, gen, device)
                executor = CUDAExecutor(layout, pool, staging_bytes=cap) if busy else None
                job_id = 0
                with TransferEngine(layout, pool, executor=executor) as engine:
                    for _ in range(3):
                        jobs = random_batch(layout, f, rng, 6)
                        if busy:
                            torch.cuda.synchronize()
                        dev = [t.cpu() for t in layout.tensors]
                        host = [t.clone() for t in pool.tensors]
                        reference(layout, f, dev, host, jobs)
                        ids = []
                        for store, dids, sizes, indices, hosts in jobs:
                            if busy:
                                with torch.cuda.stream(compute):
                                    a @ a  # the job waits for it (its ready event)
                                    job_id = _submit(engine, job_id, store, dids, sizes, indices, hosts)
                            else:
                                job_id = _submit(engine, job_id, store, dids, sizes, indices, hosts)
                            ids.append(job_id)
                        wait(engine, ids)
                        results = engine.poll()
                        failed += sum(not r.success for r in results) + len(ids) - len(results)
                        jobs_run += len(ids)
                        if busy:
                            torch.cuda.synchronize()
                        wrong += sum(int((x.cpu() != y).sum()) for x, y in zip(layout.tensors, dev))
                        wrong += sum(int((x != y).sum()) for x, y in zip(pool.tensors, host))
                if executor is not None:
                    note_staging(executor)
                configs.append(f"{kind}/F={f}/{'interleaved' if pool.interleaved else 'tensor-major'}")
    return {"jobs": jobs_run, "failed_jobs": failed, "wrong_bytes": wrong, "configs": sorted(set(configs))}


def _submit(engine, job_id, store, ids, sizes, indices, hosts) -> int:
    job_id += 1
    d, h = DeviceLoadStoreSpec(ids, sizes, indices), CPULoadStoreSpec(hosts)
    engine.submit(job_id, *((d, h) if store else (h, d)))
    return job_id


# -- 2. ordering, 3. failure fence ------------------------------------------------------


def big_setup(layers: int = 8, blocks: int = 512, page: int = 64 << 10):
    kv = {f"l{i}": torch.zeros((blocks, page), dtype=torch.uint8, device="cuda") for i in range(layers)}
    layout = KVLayout.from_layer_tensors(kv)
    return layout, HostBlockPool(layout, blocks // 2)


def ordering_case(case: str, broken: bool, layout: KVLayout, pool: HostBlockPool) -> bool:
    """True when the rule held in this run."""
    n = 128
    dev_ids, host_ids = np.arange(n) * 2, np.arange(n) + 7
    compute = torch.cuda.Stream()
    cls = NoReady if broken and case != "reported_after_copy" else CUDAExecutor
    cuda = _Cuda(sync=False) if broken and case == "reported_after_copy" else None
    executor = cls(layout, pool, cuda=cuda)
    rows = torch.from_numpy(dev_ids).cuda()
    for t in layout.tensors:  # no bytes left over from the previous case
        t.zero_()
    pool.region.zero_()
    with TransferEngine(layout, pool, executor=executor) as engine:
        torch.cuda.synchronize()
        d, h = DeviceLoadStoreSpec(dev_ids, [n], [0]), CPULoadStoreSpec(host_ids)
        if case == "load_after_zeroing":
            for t in range(len(layout.tensors)):
                pool.sub_blocks(t)[host_ids] = 0xCD
            with torch.cuda.stream(compute):
                gpu_sleep(50)
                for t in layout.tensors:
                    t.index_fill_(0, rows, 0)  # the engine zeroes blocks it hands to a load
                engine.submit(1, h, d)
            ok = wait(engine, [1]) and all(r.success for r in engine.poll())
            torch.cuda.synchronize()
            return ok and all(bool((t[rows] == 0xCD).all()) for t in layout.tensors)
        with torch.cuda.stream(compute):
            gpu_sleep(50)
            for t in layout.tensors:
                t.index_fill_(0, rows, 0xAB)  # the forward pass writes the KV to store
            engine.submit(1, d, h)
        ok = wait(engine, [1]) and all(r.success for r in engine.poll())
        # No synchronize: the engine said the job is done, so its bytes must be there.
        landed = all(bool((pool.sub_blocks(t)[host_ids] == 0xAB).all()) for t in range(len(layout.tensors)))
        torch.cuda.synchronize()
        return ok and landed


def staging_reuse_case(broken: bool, layout: KVLayout, pool: HostBlockPool) -> bool:
    """True when a store of many small batches (two staging buffers taking turns) landed
    byte-exact in the host pool."""
    n = 128
    dev_ids, host_ids = np.arange(n) * 3 % layout.tensors[0].shape[0], np.arange(n) + 5
    for t in layout.tensors:
        t.random_(0, 256)
    pool.region.zero_()
    row = sum(layout.page_bytes(t) for t in range(len(layout.tensors)))
    cls = ReuseAtOnce if broken else SlowLink
    executor = cls(layout, pool, staging_bytes=4 * row)  # batches of two rows
    with TransferEngine(layout, pool, executor=executor) as engine:
        torch.cuda.synchronize()
        engine.submit(1, DeviceLoadStoreSpec(dev_ids, [n], [0]), CPULoadStoreSpec(host_ids))
        ok = wait(engine, [1]) and all(r.success for r in engine.poll())
        rows = torch.from_numpy(dev_ids).cuda()
        landed = all(
            bool((pool.sub_blocks(t)[host_ids] == layout.tensors[t][rows].cpu()).all())
            for t in range(len(layout.tensors))
        )
        torch.cuda.synchronize()
        return ok and landed


def ordering(page: int = 64 << 10) -> dict:
    layout, pool = big_setup(page=page)
    out = {}
    for case in ("store_after_write", "load_after_zeroing", "reported_after_copy"):
        correct = ordering_case(case, False, layout, pool)
        broken_held = ordering_case(case, True, layout, pool)
        out[case] = {"holds": correct, "broken_variant_caught": not broken_held}
        log(f"ordering {case}: {out[case]}")
    correct = staging_reuse_case(False, layout, pool)
    broken_held = staging_reuse_case(True, layout, pool)
    out["staging_reused_after_its_copies"] = {"holds": correct, "broken_variant_caught": not broken_held}
    log(f"ordering staging_reused_after_its_copies: {out['staging_reused_after_its_copies']}")
    return out


def failure_fence(page: int = 64 << 10) -> dict:
    layout, pool = big_setup(page=page)
    n = 256
    out = {}
    for name, cls in (("fenced", CUDAExecutor), ("broken_no_fence", NoFence)):
        executor = cls(layout, pool, cuda=_Cuda(fail_end=True))
        compute = torch.cuda.Stream()
        with TransferEngine(layout, pool, executor=executor) as engine:
            torch.cuda.synchronize()
            with torch.cuda.stream(compute):
                gpu_sleep(50)  # the copies queue behind this, then the job fails
                engine.submit(1, DeviceLoadStoreSpec(np.arange(n), [n], [0]), CPULoadStoreSpec(np.arange(n)))
            ok = wait(engine, [1])
            (result,) = engine.poll() or [None]
            reported = time.perf_counter()
            executor._states[0].synchronize()
            still_running_ms = (time.perf_counter() - reported) * 1e3
            out[name] = {
                "reported_failed": bool(ok and result is not None and not result.success),
                "copies_ran_on_ms": round(still_running_ms, 3),
            }
        torch.cuda.synchronize()
    return out


# -- 4. bandwidth, 5. CPU while waiting, 6. matmul slowdown ------------------------------


def timed(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def flat_copy_seconds(nbytes: int) -> dict[str, float]:
    """Best of 5 of one large pinned ``copy_`` of ``nbytes`` each way: the baseline."""
    dev_flat = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host_flat = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    return {
        "store": min(timed(lambda: host_flat.copy_(dev_flat, non_blocking=True)) for _ in range(5)),
        "load": min(timed(lambda: dev_flat.copy_(host_flat, non_blocking=True)) for _ in range(5)),
    }


def bandwidth(layers: int = 32, blocks: int = 1024, job: int = 128, pages_kib=(4, 16, 64, 128)) -> dict:
    rng = np.random.default_rng(1)
    rows, beyond_kv = [], {}
    for page_kib in pages_kib:
        page = page_kib << 10
        nbytes = layers * job * page
        flat = flat_copy_seconds(nbytes)
        kv = {f"l{i}": torch.empty((blocks, page), dtype=torch.uint8, device="cuda") for i in range(layers)}
        layout = KVLayout.from_layer_tensors(kv)
        pool = HostBlockPool(layout, blocks // 2)
        torch.cuda.synchronize()
        kv_bytes = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        for path in ("batched", "per_tensor_kernels", "per_row"):
            # batched: staged, one gather kernel per batch when the layout allows it (the
            # default); per_tensor_kernels: staged, one kernel per tensor; per_row: no staging
            executor = CUDAExecutor(
                layout, pool, coalesce=path != "per_row", one_kernel=None if path == "batched" else False
            )
            with TransferEngine(layout, pool, executor=executor) as engine:
                job_id = 0
                for pattern in ("consecutive", "scattered"):
                    for direction in ("store", "load"):
                        best, cpu = float("inf"), 0.0
                        reps = 6
                        for rep in range(reps):
                            ids = rng.choice(blocks, job, replace=False)
                            if pattern == "scattered":
                                host = rng.choice(blocks // 2, job, replace=False)
                            else:
                                host = np.arange(job) + rng.integers(0, blocks // 2 - job)
                            d, h = DeviceLoadStoreSpec(ids, [job], [0]), CPULoadStoreSpec(host)
                            job_id += 1
                            torch.cuda.synchronize()
                            c0, t0 = time.process_time(), time.perf_counter()
                            engine.submit(job_id, *((d, h) if direction == "store" else (h, d)))
                            wait(engine, [job_id])
                            best = min(best, time.perf_counter() - t0)
                            if rep:  # the first job also allocates staging and pins buffers
                                cpu += time.process_time() - c0
                            assert all(r.success for r in engine.poll())
                        pieces = [(t, ids, host) for t in range(layers)]
                        plan = plan_batches(pieces, pool, executor.batch_bytes, executor.coalesce)
                        rows.append(
                            {
                                "page_kib": page_kib,
                                "path": path,
                                "host_ids": pattern,
                                "direction": direction,
                                "gb_s": round(nbytes / best / 1e9, 2),
                                "pinned_copy_gb_s": round(nbytes / flat[direction] / 1e9, 2),
                                "ratio": round(flat[direction] / best, 3),
                                "cpu_ms_per_job": round(cpu / (reps - 1) * 1e3, 3),
                                "copies_per_job": sum(b.num_copies for b in plan),
                                "span_granule": executor.span.granule if executor.span else None,
                            }
                        )
                        log(f"bandwidth {rows[-1]}")
                if path == "batched":
                    for direction in ("store", "load"):
                        rows.append(
                            streamed(engine, job_id, direction, layers, blocks, job, nbytes, flat, rng)
                        )
                        job_id += STREAMED_JOBS
                        log(f"bandwidth {rows[-1]}")
            note_staging(executor)
        # staging, temporaries and row ids: the device memory transfers took beyond the KV
        beyond_kv[page_kib] = torch.cuda.max_memory_allocated() - kv_bytes
        del kv, layout, pool, executor
        torch.cuda.empty_cache()
    return {"layers": layers, "blocks_per_job": job, "rows": rows, "device_bytes_beyond_kv": beyond_kv}


STREAMED_JOBS = 4


def streamed(engine, job_id, direction, layers, blocks, job, nbytes, flat, rng) -> dict:
    """``STREAMED_JOBS`` jobs with scattered ids submitted back to back, then waited for:
    the throughput of a queue of jobs, where one job's planning overlaps another's copies."""
    best, cpu = float("inf"), 0.0
    for _ in range(3):
        devices = rng.permutation(blocks)[: STREAMED_JOBS * job].reshape(STREAMED_JOBS, job)
        hosts = rng.permutation(blocks // 2)[: STREAMED_JOBS * job].reshape(STREAMED_JOBS, job)
        ids = list(range(job_id + 1, job_id + 1 + STREAMED_JOBS))
        torch.cuda.synchronize()
        c0, t0 = time.process_time(), time.perf_counter()
        for k, jid in enumerate(ids):
            d, h = DeviceLoadStoreSpec(devices[k], [job], [0]), CPULoadStoreSpec(hosts[k])
            engine.submit(jid, *((d, h) if direction == "store" else (h, d)))
        wait(engine, ids)
        best = min(best, time.perf_counter() - t0)
        cpu += time.process_time() - c0
        assert all(r.success for r in engine.poll())
    return {
        "page_kib": nbytes // (layers * job) >> 10,
        "path": f"batched_streamed_{STREAMED_JOBS}",
        "host_ids": "scattered",
        "direction": direction,
        "gb_s": round(STREAMED_JOBS * nbytes / best / 1e9, 2),
        "pinned_copy_gb_s": round(nbytes / flat[direction] / 1e9, 2),
        "ratio": round(STREAMED_JOBS * flat[direction] / best, 3),
        "cpu_ms_per_job": round(cpu / 3 / STREAMED_JOBS * 1e3, 3),
    }


def far_apart(gap_gib: int = 20, page: int = 64 << 10, blocks: int = 256) -> dict:
    """Round trips through a one-kernel executor whose tensors lie ``gap_gib`` GiB apart
    (the two ends of one allocation): span offsets past 2**31 elements must not wrap."""
    size = blocks * page
    whole = torch.empty((gap_gib << 30) + 2 * size, dtype=torch.uint8, device="cuda")
    first, second = whole[:size].view(blocks, page), whole[-size:].view(blocks, page)
    first.random_(0, 256)
    second.random_(0, 256)
    layout = KVLayout.from_layer_tensors({"a": first, "b": second})
    pool = HostBlockPool(layout, blocks)
    executor = CUDAExecutor(layout, pool)
    span = executor.span
    wrong = 0
    with TransferEngine(layout, pool, executor=executor) as engine:
        ids = np.arange(blocks)[::-1].copy()
        engine.submit(1, DeviceLoadStoreSpec(ids, [blocks], [0]), CPULoadStoreSpec(np.arange(blocks)))
        ok = wait(engine, [1]) and all(r.success for r in engine.poll())
        want = [t[torch.from_numpy(ids).cuda()].cpu() for t in layout.tensors]
        wrong += sum(int((pool.sub_blocks(t) != want[t]).sum()) for t in range(2))
        for t in layout.tensors:
            t.zero_()
        engine.submit(2, CPULoadStoreSpec(np.arange(blocks)), DeviceLoadStoreSpec(ids, [blocks], [0]))
        ok = ok and wait(engine, [2]) and all(r.success for r in engine.poll())
        torch.cuda.synchronize()
        wrong += sum(
            int((t[torch.from_numpy(ids).cuda()].cpu() != want[i]).sum())
            for i, t in enumerate(layout.tensors)
        )
    del whole, first, second, layout, pool, executor
    return {
        "one_kernel": span is not None,
        "span_elements": span.rows.numel() if span else 0,
        "jobs_ok": bool(ok),
        "wrong_bytes": wrong,
    }


def cpu_while_waiting(page: int = 64 << 10) -> dict:
    layout, pool = big_setup(layers=16, blocks=1024, page=page)
    out = {}
    for name, cuda in (("blocking_events", None), ("broken_spinning_events", _Cuda(blocking=False))):
        executor = CUDAExecutor(layout, pool, cuda=cuda)
        with TransferEngine(layout, pool, executor=executor) as engine:
            torch.cuda.synchronize()
            c0, t0 = time.process_time(), time.perf_counter()
            gpu_sleep(300)  # the job waits on the device for this long
            engine.submit(
                1, DeviceLoadStoreSpec(np.arange(512), [512], [0]), CPULoadStoreSpec(np.arange(512))
            )
            wait(engine, [1])
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            engine.poll()
        out[name] = {
            "wall_ms": round(wall * 1e3, 1),
            "cpu_ms": round(cpu * 1e3, 1),
            "cpu_fraction": round(cpu / wall, 3),
        }
    return out


def matmul_slowdown(size: int = 8192, page: int = 64 << 10) -> dict:
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    layout, pool = big_setup(layers=16, blocks=1024, page=page)  # 512 MiB jobs

    def matmuls() -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(30):
            a @ a
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    alone = min(matmuls() for _ in range(3))
    with TransferEngine(layout, pool) as engine:
        torch.cuda.synchronize()
        ids = np.arange(512)
        for job_id in range(1, 9):
            d, h = DeviceLoadStoreSpec(ids, [512], [0]), CPULoadStoreSpec(ids)
            engine.submit(job_id, *((d, h) if job_id % 2 else (h, d)))
        together = matmuls()
        wait(engine, list(range(1, 9)))
        moved = sum(r.bytes for r in engine.poll())
    return {
        "matmuls_ms_alone": round(alone, 2),
        "matmuls_ms_with_transfers": round(together, 2),
        "slowdown": round(together / alone, 3),
        "bytes_in_flight": moved,
    }


# -- 7. pinned region -------------------------------------------------------------------


def pinned_region(blocks: int = 6200, page: int = 1 << 20) -> dict:
    kv = {"l0": torch.empty((4, page), dtype=torch.uint8, device="cuda")}
    layout = KVLayout.from_layer_tensors(kv)
    # default 6.5 GB: not a power of two
    out = {"requested_bytes": blocks * page}
    for name, kwargs in (("parallel_chunks", {}), ("one_register_call", {"register_threads": 1})):
        if name == "one_register_call":
            kwargs["register_chunk_bytes"] = blocks * page
        t0 = time.perf_counter()
        pool = HostBlockPool(layout, blocks, **kwargs)
        out[name] = {
            "seconds": round(time.perf_counter() - t0, 3),
            "bytes": pool.nbytes,
            "pinned": pool.pinned,
            "chunks": len(pool.register_bounds),
        }
        del pool
    stats = getattr(torch.cuda, "host_memory_stats", lambda: {})
    before = stats().get("allocated_bytes.current", None)
    t0 = time.perf_counter()
    pinned = torch.empty(blocks * page, dtype=torch.uint8, pin_memory=True)
    seconds = time.perf_counter() - t0
    after = stats().get("allocated_bytes.current", None)
    out["torch_pin_memory"] = {
        "seconds": round(seconds, 3),
        "allocator_bytes": None if before is None or after is None else after - before,
    }
    del pinned
    return out


# -- summary ----------------------------------------------------------------------------


def targets(s: dict) -> dict:
    t = {}
    rt = s.get("round_trips") or {}
    t["round_trip_jobs >= 200"] = rt.get("jobs", 0) >= 200
    t["wrong_bytes == 0"] = rt.get("wrong_bytes", 1) == 0 and rt.get("failed_jobs", 1) == 0
    far = s.get("far_apart") or {}
    t["one-kernel span past 2**31 elements: 0 wrong bytes"] = bool(far) and (
        far["one_kernel"] and far["span_elements"] > 2**31 and far["jobs_ok"] and far["wrong_bytes"] == 0
    )
    t["hangs == 0"] = HANGS == 0
    order = s.get("ordering") or {}
    t["ordering holds, broken variants caught"] = bool(order) and all(
        v["holds"] and v["broken_variant_caught"] for v in order.values()
    )
    fence = s.get("failure_fence") or {}
    t["copies after a reported failure ~0 ms (< 2), > 10 ms unfenced"] = bool(fence) and (
        fence["fenced"]["reported_failed"]
        and fence["fenced"]["copies_ran_on_ms"] < 2.0
        and fence["broken_no_fence"]["copies_ran_on_ms"] > 10.0
    )
    rows = (s.get("bandwidth") or {}).get("rows", [])
    ratios = [r["ratio"] for r in rows if r["path"] == "batched" and r["page_kib"] >= 64]
    t["batched >= 0.85x pinned copy_ at >= 64 KiB pages, one job at a time"] = (
        bool(ratios) and min(ratios) >= 0.85
    )
    queued = [r["ratio"] for r in rows if r["path"].startswith("batched_streamed") and r["page_kib"] >= 64]
    t[f"batched >= 0.85x pinned copy_ at >= 64 KiB pages, {STREAMED_JOBS} jobs queued"] = (
        bool(queued) and min(queued) >= 0.85
    )
    cpu = s.get("cpu_while_waiting") or {}
    t["cpu fraction while waiting < 0.25"] = bool(cpu) and cpu["blocking_events"]["cpu_fraction"] < 0.25
    staging = s.get("staging") or {}
    t["peak staging <= cap x threads"] = (
        0 < staging.get("peak_bytes", 0) <= (staging["cap_bytes_per_thread"] * staging["threads"])
    )
    region = s.get("pinned_region") or {}
    t["pinned region exactly the requested size"] = bool(region) and (
        region["parallel_chunks"]["pinned"]
        and region["parallel_chunks"]["bytes"] == region["requested_bytes"]
    )
    return t


def main() -> int:
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device", "torch": torch.__version__}))
        return 0
    global CYCLES_PER_MS
    CYCLES_PER_MS = calibrate()
    summary: dict = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
    sections = [
        ("round_trips", round_trips),
        ("ordering", ordering),
        ("failure_fence", failure_fence),
        ("far_apart", far_apart),
        ("bandwidth", bandwidth),
        ("cpu_while_waiting", cpu_while_waiting),
        ("matmul_slowdown", matmul_slowdown),
        ("pinned_region", pinned_region),
    ]
    errors = {}
    for name, fn in sections:
        if time.monotonic() - START > BUDGET_S:
            errors[name] = "skipped: time budget spent"
            continue
        log(f"{name} ...")
        try:
            summary[name] = fn()
        except Exception:  # noqa: BLE001 - reported in the summary, the other sections still run
            errors[name] = traceback.format_exc(limit=4)
            log(errors[name])
        try:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        except Exception:  # noqa: BLE001 - a broken context: the summary still prints
            errors.setdefault(name, traceback.format_exc(limit=2))
        log(f"{name}: {json.dumps(summary.get(name))[:400]}")
    summary["staging"] = PEAK_STAGING
    summary["hangs"] = HANGS
    summary["errors"] = errors
    summary["targets"] = targets(summary)
    summary["ok"] = all(summary["targets"].values()) and not errors
    summary["seconds"] = round(time.monotonic() - START, 1)
    print(json.dumps(summary))
    return 0 if summary["ok"] else 1


CYCLES_PER_MS = 2e6

if __name__ == "__main__":
    sys.exit(main())
