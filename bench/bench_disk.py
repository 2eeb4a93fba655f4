"""The local-disk tier: layouts, throughput against a sequential baseline, latency,
index rebuild speed and index memory.

Run: .venv/bin/python bench/bench_disk.py [--dir DIR] [--mib 128] [--reps 3] [--threads 4]
     [--store-threads 2]
     [--throughput-only] [--no-file-per-block] [--before-src DIR] [--quick]
     [--pool interleaved|tensor-major|both]

Everything runs in one folder (``--dir``, default a fresh folder under /tmp) in one run:

* **Against vLLM**: vLLM 0.32's own fs-tier I/O functions (file per block, its C
  extension) on the same bytes with the same threads and job size (``vllm_fs``).
* **Throughput** of ``FSWorker`` (the chosen layout: a slot file, its space reserved
  ahead of the writes, plus a header file, ``kvoffload.tiers.fs``) and of a
  *file-per-block* layout written here for the comparison (one file per block named by
  its key, written to a temporary name and renamed, header + payload, the same CRC32C),
  with the same ``--threads`` (default 4; the slot file stores with ``--store-threads``,
  default the tier's 2) and 16 MiB jobs, against a plain sequential
  write/read of the same bytes (8 MiB ``write``/``readinto`` calls, one thread:
  ``dd``-like). ``--before-src`` adds the slot file of another source tree, run in a
  child process on the same bytes. Blocks come from a real ``HostBlockPool`` of 32 layer
  tensors; ``--pool`` picks its layout: *interleaved* (the default pool: a block is one
  buffer of its 32 pages side by side) or *tensor-major* (what a pool whose host block
  spans several device blocks has: a block is 32 pages scattered over 32 slabs), or both.
  Every layout stores twice, in the same states: *fresh* (a new file, namespace or
  files) and *reused* (the steady state of a full tier: the slot file's second fill
  evicts the first and reuses its slots; the per-block layouts delete the first fill's
  files, untimed, as an eviction does; the baseline rewrites its file in place; the page
  cache is dropped first). *Cached* is submit-to-done with the data in the page cache;
  *durable* adds ``os.sync()`` (dirty data of earlier steps is flushed before every
  clock starts). Before every cold *load* each file involved is ``fsync``ed and dropped
  from the page cache with ``posix_fadvise(DONTNEED)`` (a VM's host may still cache its
  virtual disk); *warm* loads read the page cache. The chosen slot file reads what the
  page cache does not hold with ``O_DIRECT`` (``kvoffload.tiers.fs.direct``); *slot file,
  page cache only* is the same worker with ``direct_reads=False``.
  Repetitions run the layouts in turns; ratios are taken within each repetition
  (median, min-max); CPU seconds per GB (``getrusage``, every thread) are given beside
  wall-clock GB/s, and the load average at start and end: on a shared machine the wall
  figures swing with other work, CPU per byte far less.
* **Latency** of single-block loads, p50/p99: ``FSWorker`` submit-to-done, and the two
  layouts' read functions called directly, cold (dropped cache) and warm.
* **Rebuild**: the header file of 1 M blocks (written here record by record, the data file
  sparse) read back by ``FSOffloadingManager``'s constructor; the file-per-block layout's
  rebuild (``scandir`` + reading each file's header) on 20 k files for comparison.
* **Index memory** per block at 1 M blocks: the resident memory (RSS) the manager adds
  across its constructor in a fresh process (the rebuild's temporaries freed), and the
  bytes of its arrays,
  with the registry's ``lru`` (compact ``SlotLRU``) and, at 200 k blocks, with ``arc`` (a
  per-key policy), against ``CPUOffloadingManager`` holding the same keys (which it owns);
  and the scheduler-thread cost of ``lookup`` (hit, miss; 200 k keys whose hashes are
  cached, as the scheduler's are).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from kvoffload.cpu import CPUOffloadingManager
from kvoffload.keys import make_offload_key
from kvoffload.specs import CPULoadStoreSpec
from kvoffload.tiers.fs.format import DATA_FILE, HEADER_FILE, RECORD_BYTES, Geometry, checksum, pack_record
from kvoffload.tiers.fs.manager import FSOffloadingManager
from kvoffload.tiers.fs.namespace import namespace_digest
from kvoffload.tiers.fs.vectored import preadv_all
from kvoffload.tiers.fs.worker import STORE_THREADS, FSWorker
from kvoffload.transfer import HostBlockPool, KVLayout

LAYERS = 32
THREADS = 4
JOB_BYTES = 16 << 20
CHUNK = 8 << 20
COLUMNS = (
    "store_fresh", "store_fresh_durable", "store_reused", "store_reused_durable", "load_cold", "load_warm",
)  # fmt: skip
HEADERS = (
    "store fresh (cached)", "store fresh (durable)", "store reused (cached)", "store reused (durable)",
    "load (cold)", "load (warm)",
)  # fmt: skip


def key(i: int) -> bytes:
    return make_offload_key(i.to_bytes(32, "big"), 0)


def drop_cache(paths) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def files_under(folder: str) -> list[str]:
    """Every file below ``folder``, sub-folders included."""
    return [os.path.join(root, name) for root, _, names in os.walk(folder) for name in names]


# -- the alternative layout: a file per block ---------------------------------------------


class FilePerBlock:
    """One file per block named by its key: header record + payload, written to a
    temporary name and renamed (so a reader never sees a partial file)."""

    def __init__(self, folder: str, payload_bytes: int, digest: bytes) -> None:
        self.folder = folder
        self.payload_bytes = payload_bytes
        self.digest = digest
        os.makedirs(folder, exist_ok=True)

    def path(self, k: bytes) -> str:
        return os.path.join(self.folder, k.hex() + ".blk")

    def write(self, k: bytes, rows) -> None:
        crc = checksum(rows)
        header = pack_record(k, self.payload_bytes, crc, time.time_ns(), self.digest)
        final = self.path(k)
        tmp = f"{final}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.pwritev(fd, [header, *rows], 0)
        finally:
            os.close(fd)
        os.rename(tmp, final)

    def read(self, k: bytes, rows) -> None:
        header = bytearray(RECORD_BYTES)
        fd = os.open(self.path(k), os.O_RDONLY)
        try:
            got = preadv_all(fd, [header, *rows], 0)
        finally:
            os.close(fd)
        stored_key = bytes(header[48 : 48 + len(k)])
        if got != RECORD_BYTES + self.payload_bytes or stored_key != k:
            raise ValueError(f"bad block {k.hex()}")
        if checksum(rows) != int.from_bytes(header[8 + 8 : 8 + 8 + 4], "little"):
            raise ValueError(f"checksum mismatch in {k.hex()}")

    def rebuild(self) -> int:
        found = 0
        header = bytearray(RECORD_BYTES)
        for entry in os.scandir(self.folder):
            if entry.name.endswith(".blk"):
                fd = os.open(entry.path, os.O_RDONLY)
                try:
                    os.preadv(fd, [header], 0)
                finally:
                    os.close(fd)
                found += header[:4] == b"KVOB"
        return found


# -- throughput ---------------------------------------------------------------------------


def make_pool(block_bytes: int, blocks: int, interleave: bool = True) -> HostBlockPool:
    """A pool of ``LAYERS`` tensors, seeded bytes; ``interleave``: each block one buffer (the
    default pool), else tensor-major (each block ``LAYERS`` scattered pages)."""
    page = block_bytes // LAYERS
    layout = KVLayout([torch.empty((1, page), dtype=torch.uint8) for _ in range(LAYERS)])
    pool = HostBlockPool(layout, blocks, pin_memory=False, interleave=interleave)
    rng = np.random.default_rng(0)
    for t in pool.tensors:
        t.numpy()[:] = rng.integers(0, 256, size=t.shape, dtype=np.uint8)
    return pool


def pool_bytes(pool: HostBlockPool) -> int:
    return sum(int(t.shape[1]) for t in pool.tensors)


def _cpu() -> float:
    """CPU seconds of this process so far, every thread, user and system."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _timed_store(fn) -> tuple[float, float, float]:
    """Seconds until ``fn`` returns (data in the page cache) and until ``os.sync()`` is
    done (on the device), and the process's CPU seconds until ``fn`` returns. Dirty data
    of earlier steps is flushed before the clock starts."""
    os.sync()
    start, cpu = time.perf_counter(), _cpu()
    fn()
    cached, cpu = time.perf_counter() - start, _cpu() - cpu
    os.sync()
    return cached, time.perf_counter() - start, cpu


def _stores(result: dict, nbytes: int, state: str, times: tuple[float, float, float]) -> None:
    result[f"store_{state}"] = nbytes / times[0]
    result[f"store_{state}_durable"] = nbytes / times[1]
    result[f"cpu_store_{state}"] = times[2] / (nbytes / 1e9)


def _timed_load(result: dict, nbytes: int, mode: str, fn) -> None:
    start, cpu = time.perf_counter(), _cpu()
    fn()
    result[f"load_{mode}"] = nbytes / (time.perf_counter() - start)
    result[f"cpu_load_{mode}"] = (_cpu() - cpu) / (nbytes / 1e9)


def sequential(folder: str, nbytes: int, buf: np.ndarray) -> dict[str, float]:
    """``dd``-like, one thread, 8 MiB calls: a new file (fresh), then the same file
    rewritten in place (reused), then read cold and warm."""
    path = os.path.join(folder, "sequential.bin")
    out: dict[str, float] = {}

    def write(mode: str):
        def run():
            with open(path, mode, buffering=0) as f:
                for off in range(0, nbytes, CHUNK):
                    f.write(buf[off : off + CHUNK])

        return run

    _stores(out, nbytes, "fresh", _timed_store(write("wb")))
    drop_cache([path])
    _stores(out, nbytes, "reused", _timed_store(write("r+b")))
    for mode in ("cold", "warm"):
        if mode == "cold":
            drop_cache([path])

        def read():
            with open(path, "rb", buffering=0) as f:
                for off in range(0, nbytes, CHUNK):
                    f.readinto(memoryview(buf)[off : off + CHUNK])

        _timed_load(out, nbytes, mode, read)
    os.unlink(path)
    return out


def slot_file(
    folder: str,
    pool: HostBlockPool,
    blocks: int,
    threads: int,
    direct_reads: bool = True,
    store_threads: int = STORE_THREADS,
) -> dict[str, float]:
    """``FSWorker``: a tier of exactly ``blocks`` slots filled with keys A (fresh: a new
    namespace), then with keys B, which evict A and reuse its slots (reused); loads of B
    (``direct_reads=False``: every load through the page cache). ``threads`` load,
    ``store_threads`` store."""
    block_bytes = sum(int(t.shape[1]) for t in pool.tensors)
    nbytes = blocks * block_bytes
    bytes_to_use = blocks * Geometry(block_bytes).stored_block_bytes
    manager = FSOffloadingManager(folder, "slots", block_bytes, bytes_to_use)
    worker = FSWorker(
        pool,
        folder,
        "slots",
        bytes_to_use,
        load_threads=threads,
        store_threads=store_threads,
        direct_reads=direct_reads,
    )
    per_job = max(1, JOB_BYTES // block_bytes)
    job_ids = iter(range(1 << 30))

    def run(specs):
        jobs = []
        for first in range(0, blocks, per_job):
            ids = list(range(first, min(blocks, first + per_job)))
            src, dst = specs(ids)
            jobs.append(next(job_ids))
            worker.submit(jobs[-1], src, dst)
        worker.wait(jobs)
        assert all(r.success for r in worker.poll())

    result: dict[str, float] = {}
    for state, offset in (("fresh", 0), ("reused", blocks)):
        keys = [key(offset + i) for i in range(blocks)]
        out = manager.prepare_store(keys)
        assert len(out.keys_to_store) == blocks and len(out.evicted_keys) == offset
        spec = out.store_spec
        times = _timed_store(lambda s=spec: run(lambda ids: (CPULoadStoreSpec(ids), _disk_spec(s, ids))))
        _stores(result, nbytes, state, times)
        manager.complete_store(keys)
        drop_cache(files_under(worker.path))
    for mode in ("cold", "warm"):
        if mode == "cold":
            drop_cache(files_under(worker.path))
        spec = manager.prepare_load(keys)
        _timed_load(
            result, nbytes, mode, lambda s=spec: run(lambda ids: (_disk_spec(s, ids), CPULoadStoreSpec(ids)))
        )
        manager.complete_load(keys)
    worker.close()
    manager.close()
    return result


def slot_file_elsewhere(
    src: str, folder: str, block_bytes: int, blocks: int, threads: int, interleave: bool
) -> dict:
    """``slot_file`` with the ``kvoffload`` package of another source tree (``src``, e.g.
    an earlier commit's ``git archive``), in a child process on the same bytes
    (``make_pool`` is seeded); its start-up is not timed."""
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); import bench_disk as b; "
        "print(json.dumps(b.slot_file(sys.argv[2], b.make_pool(int(sys.argv[3]), int(sys.argv[4]), "
        "sys.argv[6] == '1'), int(sys.argv[4]), int(sys.argv[5]))))"
    )
    env = dict(os.environ, PYTHONPATH=src)
    argv = [sys.executable, "-c", code, os.path.dirname(os.path.abspath(__file__)), folder]
    argv += [str(block_bytes), str(blocks), str(threads), str(int(interleave))]
    out = subprocess.run(argv, env=env, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.splitlines()[-1])


def _disk_spec(spec, ids):
    from kvoffload.specs import DiskLoadStoreSpec

    return DiskLoadStoreSpec(spec.block_ids[ids[0] : ids[-1] + 1], spec.keys[ids[0] : ids[-1] + 1])


def _per_block_files(folder, blocks, block_bytes, threads, write, read, remove) -> dict[str, float]:
    """Stores of keys A into new files (fresh), then A's files deleted as an eviction
    would (not timed) and keys B stored (reused: the file system reuses the freed
    blocks); loads of B. ``write(i, offset)``/``read(i, offset)`` move block ``i`` under
    key ``offset + i``; ``remove(i)`` deletes key ``i``'s file."""

    def parallel(fn, offset):
        with ThreadPoolExecutor(threads) as ex:
            list(ex.map(lambda c: [fn(i, offset) for i in range(c, blocks, threads)], range(threads)))

    result: dict[str, float] = {}
    nbytes = blocks * block_bytes
    for state, offset in (("fresh", 0), ("reused", blocks)):
        if offset:
            for i in range(blocks):
                remove(i)
            os.sync()
        _stores(result, nbytes, state, _timed_store(lambda o=offset: parallel(write, o)))
    for mode in ("cold", "warm"):
        if mode == "cold":
            drop_cache(files_under(folder))
        _timed_load(result, nbytes, mode, lambda: parallel(read, blocks))
    return result


def file_per_block(folder: str, pool: HostBlockPool, blocks: int, threads: int) -> dict[str, float]:
    block_bytes = sum(int(t.shape[1]) for t in pool.tensors)
    layout = FilePerBlock(os.path.join(folder, "files"), block_bytes, namespace_digest("files"))
    rows = [t.numpy() for t in pool.tensors]
    return _per_block_files(
        layout.folder, blocks, block_bytes, threads,
        lambda i, off: layout.write(key(off + i), [r[i] for r in rows]),
        lambda i, off: layout.read(key(off + i), [r[i] for r in rows]),
        lambda i: os.unlink(layout.path(key(i))),
    )  # fmt: skip


def vllm_fs(folder: str, buf: np.ndarray, block_bytes: int, blocks: int, threads: int) -> dict[str, float]:
    """vLLM 0.32's own fs-tier I/O functions (``vllm.v1.kv_offload.tiering.fs.io``: one
    file per block, temp file + rename, its C extension when built) on the same bytes,
    with the same threads and job size, through the page cache (``use_o_direct=False``,
    as ours)."""
    from vllm.v1.kv_offload.tiering.fs.io import batch_load_block, batch_store_block

    view = memoryview(buf)
    per_job = max(1, JOB_BYTES // block_bytes)

    def path(k: bytes) -> str:
        return os.path.join(folder, k[-5:-4].hex(), k.hex() + ".bin")

    for sub in range(256):
        os.makedirs(os.path.join(folder, f"{sub:02x}"), exist_ok=True)
    jobs = [range(first, min(blocks, first + per_job)) for first in range(0, blocks, per_job)]

    def run(fn, offset):
        def job(ids):
            fn([path(key(offset + i)) for i in ids], view, [i * block_bytes for i in ids], block_bytes, False)

        with ThreadPoolExecutor(threads) as ex:
            list(ex.map(job, jobs))

    result: dict[str, float] = {}
    nbytes = blocks * block_bytes
    for state, offset in (("fresh", 0), ("reused", blocks)):
        if offset:
            for i in range(blocks):
                os.unlink(path(key(i)))
            os.sync()
        _stores(result, nbytes, state, _timed_store(lambda o=offset: run(batch_store_block, o)))
    for mode in ("cold", "warm"):
        if mode == "cold":
            drop_cache(files_under(folder))
        _timed_load(result, nbytes, mode, lambda: run(batch_load_block, blocks))
    return result


# -- latency ------------------------------------------------------------------------------


def latencies(folder: str, block_bytes: int, count: int) -> dict[str, tuple[float, float]]:
    pool = make_pool(block_bytes, count)
    rows = [t.numpy() for t in pool.tensors]
    keys = [key(i) for i in range(count)]
    bytes_to_use = count * Geometry(block_bytes).stored_block_bytes
    manager = FSOffloadingManager(folder, "lat", block_bytes, bytes_to_use)
    worker = FSWorker(pool, folder, "lat", bytes_to_use)
    out = manager.prepare_store(keys)
    worker.submit(0, CPULoadStoreSpec(range(count)), out.store_spec)
    worker.wait([0])
    assert worker.poll()[0].success
    manager.complete_store(keys)
    files = FilePerBlock(os.path.join(folder, "latfiles"), block_bytes, namespace_digest("latfiles"))
    for i in range(count):
        files.write(keys[i], [r[i] for r in rows])
    order = np.random.default_rng(1).permutation(count).tolist()
    result = {}
    for mode in ("cold", "warm"):
        if mode == "cold":
            drop_cache(files_under(worker.path) + files_under(files.folder))
        times = []
        for j, i in enumerate(order):
            spec = manager.prepare_load([keys[i]])
            start = time.perf_counter()
            worker.submit(10 + j, spec, CPULoadStoreSpec([i]))
            worker.wait([10 + j])
            times.append(time.perf_counter() - start)
            manager.complete_load([keys[i]])
        assert all(r.success for r in worker.poll())
        result[f"FSWorker job, {mode}"] = _p50_p99(times)
        if mode == "cold":
            drop_cache(files_under(worker.path) + files_under(files.folder))
        for name, read in (
            (
                "slot file read",
                lambda i: worker.files.read(int(out.store_spec.block_ids[i]), keys[i], [r[i] for r in rows]),
            ),
            ("file-per-block read", lambda i: files.read(keys[i], [r[i] for r in rows])),
        ):
            times = []
            for i in order:
                start = time.perf_counter()
                read(i)
                times.append(time.perf_counter() - start)
            result[f"{name}, {mode}"] = _p50_p99(times)
    worker.close()
    manager.close()
    return result


def _p50_p99(times) -> tuple[float, float]:
    ms = np.asarray(times) * 1e3
    return float(np.percentile(ms, 50)), float(np.percentile(ms, 99))


# -- rebuild, memory, lookups -------------------------------------------------------------


def write_headers(folder: str, namespace: str, count: int, block_bytes: int) -> None:
    ns = os.path.join(folder, namespace)
    os.makedirs(ns, exist_ok=True)
    digest = namespace_digest(namespace)
    geometry = Geometry(block_bytes)
    with open(os.path.join(ns, HEADER_FILE), "wb") as f:
        for start in range(0, count, 65536):
            f.write(
                b"".join(
                    pack_record(key(i), block_bytes, 0, i, digest)
                    for i in range(start, min(count, start + 65536))
                )
            )
    with open(os.path.join(ns, DATA_FILE), "wb") as f:
        f.truncate(count * geometry.slot_stride)  # sparse: the scan only checks the size


def rebuild(folder: str, count: int) -> dict[str, float]:
    block_bytes = 4096
    write_headers(folder, "rebuild", count, block_bytes)
    bytes_to_use = count * Geometry(block_bytes).stored_block_bytes
    gc.collect()
    start = time.perf_counter()
    manager = FSOffloadingManager(folder, "rebuild", block_bytes, bytes_to_use, enable_events=True)
    seconds = time.perf_counter() - start
    (event,) = manager.take_events()
    assert len(event.keys) == count == manager.stats().used
    out = {"slot file (header file)": count / seconds}
    lookups = _lookup_ns(manager, count)
    manager.close()
    del manager, event
    # the alternative: scandir + read each file's header
    files = FilePerBlock(os.path.join(folder, "rebuild-files"), block_bytes, namespace_digest("x"))
    n_files = min(count, 20_000)
    header = pack_record(key(0), block_bytes, 0, 0, namespace_digest("x"))
    for i in range(n_files):
        with open(files.path(key(i)), "wb") as f:
            f.write(header)
    os.sync()
    start = time.perf_counter()
    assert files.rebuild() == n_files
    out[f"file per block ({n_files // 1000} k files, warm)"] = n_files / (time.perf_counter() - start)
    shutil.rmtree(files.folder)
    return out, lookups


def _lookup_ns(manager, count: int) -> dict[str, float]:
    present = [key(i) for i in range(0, count, max(1, count // 200_000))]
    absent = [key(count + i) for i in range(len(present))]
    for k in present + absent:
        hash(k)  # cached, as the scheduler's keys are
    out = {}
    for name, keys in (("hit", present), ("miss", absent)):
        lookup = manager.lookup
        start = time.perf_counter()
        for k in keys:
            lookup(k)
        out[name] = (time.perf_counter() - start) / len(keys) * 1e9
    return out


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


_MEMORY_PROBE = """
import gc, os, sys
from kvoffload.tiers.fs.format import Geometry
from kvoffload.tiers.fs.manager import FSOffloadingManager
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
folder, count, policy = sys.argv[1], int(sys.argv[2]), sys.argv[3]
gc.collect()
before = rss()
manager = FSOffloadingManager(folder, "rebuild", 4096, count * Geometry(4096).stored_block_bytes, policy)
gc.collect()
assert manager.stats().used == count
arrays = manager._index.nbytes + manager._state_array.nbytes + manager.order.nbytes
print((rss() - before) / count, arrays / count)
"""


def index_memory(folder: str, count: int, policy: str) -> tuple[float, float]:
    """Bytes per block the manager keeps after rebuilding ``count`` blocks (the header
    file of ``rebuild``), in a fresh process: resident memory grown across the constructor
    (its temporaries freed), and the bytes of its arrays."""
    out = subprocess.run(
        [sys.executable, "-c", _MEMORY_PROBE, folder, str(count), policy],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return float(out[0]), float(out[1])


def cpu_index_memory(count: int) -> tuple[float, dict[str, float]]:
    gc.collect()
    before = rss()
    manager = CPUOffloadingManager(count, "lru")
    for start in range(0, count, 4096):
        batch = [key(i) for i in range(start, min(count, start + 4096))]
        manager.complete_store(manager.prepare_store(batch).keys_to_store)
    del batch
    gc.collect()
    grown = rss() - before
    return grown / count, _lookup_ns(manager, count)


# -- report -------------------------------------------------------------------------------


def loadavg() -> str:
    return " / ".join(f"{x:.2f}" for x in os.getloadavg()) + " (1 / 5 / 15 min)"


def machine(folder: str) -> str:
    fs = subprocess.run(["df", "-T", folder], capture_output=True, text=True).stdout.splitlines()[-1].split()
    return f"{os.cpu_count()} CPUs, folder {folder} on {fs[1]} ({fs[0]}), Python {sys.version.split()[0]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default=None, help="folder to run in (default: a new one under /tmp)")
    parser.add_argument("--mib", type=int, default=128, help="MiB moved per throughput case")
    parser.add_argument("--blocks", type=int, default=1 << 20, help="blocks for rebuild and index memory")
    parser.add_argument("--reps", type=int, default=3, help="runs per throughput case (median)")
    parser.add_argument("--threads", type=int, default=THREADS, help="I/O threads of every layout")
    parser.add_argument(
        "--store-threads",
        type=int,
        default=STORE_THREADS,
        help="store threads of the chosen slot file (default: the tier's); its loads use --threads",
    )
    parser.add_argument("--throughput-only", action="store_true", help="skip latency, rebuild, memory")
    parser.add_argument("--no-file-per-block", action="store_true", help="skip the file-per-block layout")
    parser.add_argument("--before-src", default=None, help="also run the slot file from this src folder")
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    parser.add_argument(
        "--pool",
        choices=("interleaved", "tensor-major", "both"),
        default="both",
        help="host pool layout of the throughput cases: each block one buffer (the default "
        "pool) or 32 scattered pages (a pool whose host block spans several device blocks)",
    )
    args = parser.parse_args()
    if args.quick:
        args.mib, args.blocks, args.reps = 32, 1 << 16, 1
    folder = tempfile.mkdtemp(prefix="kvoffload-bench-", dir=args.dir)
    try:
        report(folder, args)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def report(folder: str, args) -> None:
    gb = 1e9
    print(f"`{' '.join(['.venv/bin/python', 'bench/bench_disk.py', *sys.argv[1:]])}`: {machine(folder)}\n")
    print(f"Load average at start: {loadavg()}\n")
    threads = args.threads
    print(
        f"### Throughput, GB/s ({args.mib} MiB per case, median of {args.reps} runs taken in turns, "
        f"{threads} I/O threads for every layout but the one-thread baseline, except the slot file's "
        f"{args.store_threads} store threads; blocks of {LAYERS} pages)\n"
    )
    header = "| block | layout | " + " | ".join(HEADERS) + " |"
    rule = "|---|---|" + "---|" * len(HEADERS)
    cases = {
        "sequential baseline": lambda sub, pool, blocks, buf: sequential(sub, blocks * pool_bytes(pool), buf),
        "slot file (chosen)": lambda sub, pool, blocks, buf: slot_file(
            sub, pool, blocks, threads, store_threads=args.store_threads
        ),
        "slot file, page cache only": lambda sub, pool, blocks, buf: slot_file(
            sub, pool, blocks, threads, direct_reads=False, store_threads=args.store_threads
        ),
        "file per block": lambda sub, pool, blocks, buf: file_per_block(sub, pool, blocks, threads),
        "vLLM 0.32 fs tier": lambda sub, pool, blocks, buf: vllm_fs(
            sub, buf, pool_bytes(pool), blocks, threads
        ),
    }
    if args.no_file_per_block:
        del cases["file per block"]
    if args.before_src:
        # both trees in a child process each, so that neither pays for this process's
        # heap (vLLM imported: more for the garbage collector to walk) and the other not
        here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
        cases["slot file (chosen, child)"] = lambda sub, pool, blocks, buf: slot_file_elsewhere(
            here, sub, pool_bytes(pool), blocks, threads, pool.interleaved
        )
        cases["slot file (before)"] = lambda sub, pool, blocks, buf: slot_file_elsewhere(
            args.before_src, sub, pool_bytes(pool), blocks, threads, pool.interleaved
        )
    all_runs = {}
    pools = {"interleaved": [True], "tensor-major": [False], "both": [True, False]}[args.pool]
    for block_bytes, interleave in ((b, i) for i in pools for b in (256 << 10, 2 << 20)):
        blocks = (args.mib << 20) // block_bytes
        pool = make_pool(block_bytes, blocks, interleave)
        buf = np.concatenate([t.numpy().reshape(-1) for t in pool.tensors])
        sequential(folder, len(buf), buf)  # warm-up: a VM backs fresh page-cache memory slowly
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in cases}
        for rep in range(args.reps):
            for name, case in cases.items():
                sub = os.path.join(folder, f"{name.split()[0]}-{block_bytes}-{rep}")
                os.makedirs(sub)
                runs[name].append(case(sub, pool, blocks, buf))
                shutil.rmtree(sub)
        del buf, pool
        all_runs[f"{block_bytes >> 10} KiB, {'interleaved' if interleave else 'tensor-major'}"] = runs
    print(header)
    print(rule)
    for case, runs in all_runs.items():
        for name, rs in runs.items():
            cells = " | ".join(f"{statistics.median(r[c] for r in rs) / gb:.2f}" for c in COLUMNS)
            print(f"| {case} | {name} | {cells} |")

    def ratio_rows(name: str, against: str) -> None:
        for case, runs in all_runs.items():
            per_run = [{c: a[c] / b[c] for c in COLUMNS} for a, b in zip(runs[name], runs[against])]
            cells = " | ".join(
                f"{statistics.median(r[c] for r in per_run):.2f} "
                f"({min(r[c] for r in per_run):.2f}-{max(r[c] for r in per_run):.2f})"
                for c in COLUMNS
            )
            print(f"| {case} | {name} | {cells} |")

    print(
        "\nRatios taken within each run (variant / reference of the same repetition), "
        "median (min-max) over the runs.\n\nTo the sequential baseline (target >= 0.8):\n"
    )
    print(header)
    print(rule)
    for name in cases:
        if name != "sequential baseline":
            ratio_rows(name, "sequential baseline")
    print("\nSlot file (chosen) to vLLM 0.32's fs tier I/O, same bytes and threads (target >= 1.5):\n")
    print(header)
    print(rule)
    ratio_rows("slot file (chosen)", "vLLM 0.32 fs tier")
    cpu_cols = ("cpu_store_fresh", "cpu_store_reused", "cpu_load_cold", "cpu_load_warm")
    print(
        "\nCPU seconds per GB moved (this process, every thread, user + system; the page cache's "
        "writeback to the device is not in it), median; in brackets the ratio to the sequential "
        "baseline of the same run, median:\n"
    )
    print("| block | layout | store fresh | store reused | load (cold) | load (warm) |")
    print("|---|---|---|---|---|---|")
    for case, runs in all_runs.items():
        base = runs["sequential baseline"]
        for name, rs in runs.items():
            cells = " | ".join(
                f"{statistics.median(r[c] for r in rs):.3f} "
                f"({statistics.median(r[c] / b[c] for r, b in zip(rs, base)):.2f})"
                for c in cpu_cols
            )
            print(f"| {case} | {name} | {cells} |")
    print(f"\nLoad average at the end of the throughput runs: {loadavg()}")
    if args.throughput_only:
        return
    print(
        "\n### Single-block load latency, ms (p50 / p99; 200 blocks of 256 KiB, 100 of 2 MiB, random order)\n"
    )
    print("| block | path | p50 | p99 |")
    print("|---|---|---|---|")
    for block_bytes in (256 << 10, 2 << 20):
        for name, (p50, p99) in latencies(
            os.path.join(folder, f"lat{block_bytes}"), block_bytes, 200
        ).items():
            print(f"| {block_bytes >> 10} KiB | {name} | {p50:.3f} | {p99:.3f} |")

    count = args.blocks
    speeds, fs_lookup = rebuild(folder, count)
    print(f"\n### Index rebuild at start-up ({count:,} blocks in the header file)\n")
    print("| layout | blocks/s |")
    print("|---|---|")
    for name, speed in speeds.items():
        print(f"| {name} | {speed:,.0f} |")

    print("\n### Index memory (resident memory the manager adds; its arrays) and lookup cost\n")
    lru, lru_arrays = index_memory(folder, count, "lru")
    small = min(count, 200_000)
    arc, _ = index_memory(folder, small, "arc")
    cpu_bytes, cpu_lookup = cpu_index_memory(count)
    print("| index | blocks | bytes/block (RSS) | arrays bytes/block | lookup hit ns | lookup miss ns |")
    print("|---|---|---|---|---|---|")
    hit, miss = fs_lookup["hit"], fs_lookup["miss"]
    name = "FSOffloadingManager, lru (SlotLRU)"
    print(f"| {name} | {count:,} | {lru:.1f} | {lru_arrays:.1f} | {hit:.0f} | {miss:.0f} |")
    print(f"| FSOffloadingManager, arc (per-key policy) | {small:,} | {arc:.1f} | | | |")
    hit, miss = cpu_lookup["hit"], cpu_lookup["miss"]
    name = "CPUOffloadingManager, lru (keys included)"
    print(f"| {name} | {count:,} | {cpu_bytes:.1f} | | {hit:.0f} | {miss:.0f} |")


if __name__ == "__main__":
    main()
