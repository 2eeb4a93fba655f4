"""Where a disk-tier store or load spends its time: each part of ``BlockFiles``'s work
timed alone, one thread, on the same blocks.

Run: .venv/bin/python bench/profile_disk_io.py [--dir DIR] [--mib 128] [--reps 5]

Blocks of 256 KiB and 2 MiB from a ``HostBlockPool`` of 32 layer tensors (32 pages per
block). Each part is timed over ``--mib`` MiB, ``--reps`` times taken in turns, median:

* *crc*: CRC32C over the 32 pages of every block (what a store or load checks);
* *iov build*: the Python work that turns a run's host ids into the buffers handed to
  ``pwritev`` (the worker's buffer lists);
* *pwritev into a fresh file* (sparse: the file system allocates at every write), *into
  space reserved with fallocate*, and *over allocated space* (the file's blocks exist,
  its page cache dropped: a reused slot) -- 32 page buffers per block against one
  contiguous buffer of the same bytes;
* *store run*: a store's payload work on 1 MiB runs (``pwritev`` + CRC32C), the CRC
  taken before the write (as before) or after it (now);
* *preadv* of the page cache (warm) into the 32 pages and into one buffer.

Two figures per part: wall-clock GB/s and CPU seconds per GB of this thread
(``time.thread_time``). The second is what the part costs; the first also holds the
waits for other processes on a shared machine, and for dirty-page writeback.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import crc32c
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from bench_disk import LAYERS, make_pool  # noqa: E402
from kvoffload.tiers.fs.format import checksum  # noqa: E402
from kvoffload.tiers.host_rows import HostRows  # noqa: E402


def timed(fn) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.thread_time()
    fn()
    return time.perf_counter() - wall, time.thread_time() - cpu


def profile(folder: str, block_bytes: int, mib: int, reps: int) -> dict[str, tuple[float, float]]:
    blocks = (mib << 20) // block_bytes
    nbytes = blocks * block_bytes
    pool = make_pool(block_bytes, blocks)
    rows = [t.numpy() for t in pool.tensors]
    host_rows = HostRows(pool)
    pages = [[r[i] for r in rows] for i in range(blocks)]
    flat = np.concatenate([r.reshape(-1) for r in rows])
    one = [memoryview(flat)[i * block_bytes : (i + 1) * block_bytes] for i in range(blocks)]
    path = os.path.join(folder, "profile.dat")

    def crc():
        for bufs in pages:
            v = 0
            for b in bufs:
                v = crc32c.crc32c(b, v)

    def iov_old():
        for i in range(blocks):
            [memoryview(b).cast("B") for b in [r[i] for r in rows]]

    def iov_new():
        for i in range(blocks):
            host_rows.block(i)

    def open_file(state: str) -> int:
        if state != "allocated" and os.path.exists(path):
            os.unlink(path)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        if state in ("fallocated", "allocated"):
            os.posix_fallocate(fd, 0, nbytes)
        if state == "allocated" and os.fstat(fd).st_blocks * 512 < nbytes:
            os.pwrite(fd, bytes(nbytes), 0)  # real blocks, not unwritten extents
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return fd

    def writer(state: str, iov: bool):
        def run():
            fd = open_file(state)
            try:
                wall, cpu = timed(
                    (lambda: [os.pwritev(fd, pages[i], i * block_bytes) for i in range(blocks)])
                    if iov
                    else (lambda: [os.pwrite(fd, one[i], i * block_bytes) for i in range(blocks)])
                )
                os.fsync(fd)  # not timed: the next part starts clean
                return wall, cpu
            finally:
                os.close(fd)

        return run

    def store_run(crc_first: bool):
        """A store's payload work as ``BlockFiles.write_run`` does it on 1 MiB runs, into
        allocated space: CRC32C before the ``pwritev`` (the bytes come from memory twice)
        or after it (the second pass finds them in the CPU cache)."""
        run_blocks = max(1, (1 << 20) // block_bytes)

        def body(fd):
            for first in range(0, blocks, run_blocks):
                views = [host_rows.block(i) for i in range(first, min(blocks, first + run_blocks))]
                if crc_first:
                    [checksum(v) for v in views]
                os.pwritev(fd, [b for v in views for b in v], first * block_bytes)
                if not crc_first:
                    [checksum(v) for v in views]

        def run():
            fd = open_file("allocated")
            try:
                out = timed(lambda: body(fd))
                os.fsync(fd)
                return out
            finally:
                os.close(fd)

        return run

    def reader(iov: bool):
        def run():
            fd = os.open(path, os.O_RDONLY)
            try:
                return timed(
                    (lambda: [os.preadv(fd, pages[i], i * block_bytes) for i in range(blocks)])
                    if iov
                    else (lambda: [os.preadv(fd, [one[i]], i * block_bytes) for i in range(blocks)])
                )
            finally:
                os.close(fd)

        return run

    parts = {
        "crc (32 pages per block)": lambda: timed(crc),
        "iov build, numpy rows + cast (before)": lambda: timed(iov_old),
        "iov build, HostRows slices (now)": lambda: timed(iov_new),
    }
    for state in ("fresh", "fallocated", "allocated"):
        for iov in (True, False):
            parts[f"pwritev {state}, {'32 pages' if iov else '1 buffer'}"] = writer(state, iov)
    parts["store run (1 MiB): CRC32C, then pwritev (before)"] = store_run(True)
    parts["store run (1 MiB): pwritev, then CRC32C (now)"] = store_run(False)
    for iov in (True, False):
        parts[f"preadv warm, {'32 pages' if iov else '1 buffer'}"] = reader(iov)
    return parts, nbytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default=None)
    parser.add_argument("--mib", type=int, default=128)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    folder = tempfile.mkdtemp(prefix="kvoffload-profile-", dir=args.dir)
    print(
        f"`.venv/bin/python bench/profile_disk_io.py {' '.join(sys.argv[1:])}`: load average "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} at start"
    )
    try:
        for block_bytes in (256 << 10, 2 << 20):
            parts, nbytes = profile(folder, block_bytes, args.mib, args.reps)
            runs: dict[str, list[tuple[float, float]]] = {name: [] for name in parts}
            for _ in range(args.reps):
                for name, part in parts.items():
                    runs[name].append(part())
            print(
                f"\n{block_bytes >> 10} KiB blocks ({LAYERS} pages each), {args.mib} MiB, "
                f"median of {args.reps}:\n"
            )
            print("| part | wall GB/s | CPU s per GB |")
            print("|---|---:|---:|")
            for name, rs in runs.items():
                wall = statistics.median(r[0] for r in rs)
                cpu = statistics.median(r[1] for r in rs)
                print(f"| {name} | {nbytes / wall / 1e9:.2f} | {cpu / (nbytes / 1e9):.3f} |")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(f"\nload average at end {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
