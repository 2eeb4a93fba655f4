"""The writer ``test_fs_crash`` kills: a process of its own (``python fs_crash_writer.py ROOT
FIRST BYTES_TO_USE FD``) that stores new disk-tier blocks 8 at a time until it is killed,
writing 8 bytes to the pipe ``FD`` when a job starts (0) and when it has finished (the next
block number). Started with exec, not forked from the threaded test process: a forked child
may block on a lock another thread of the parent held (it did once under ASan)."""

from __future__ import annotations

import os
import sys

import numpy as np
import torch

from kvoffload.keys import make_offload_key
from kvoffload.specs import CPULoadStoreSpec
from kvoffload.tiers.fs.manager import FSOffloadingManager
from kvoffload.tiers.fs.worker import FSWorker
from kvoffload.transfer import HostBlockPool, KVLayout

PAGES = (100_000, 150_003)  # two tensors of odd sizes: a block is ~250 KB
NAMESPACE = "kv-crash"


def content(n: int) -> bytes:
    """Block ``n``'s bytes, the same in every process."""
    return np.random.default_rng(n).integers(0, 256, size=sum(PAGES), dtype=np.uint8).tobytes()


def write_forever(root: str, first: int, bytes_to_use: int, progress: int) -> None:
    layout = KVLayout([torch.empty((1, p), dtype=torch.uint8) for p in PAGES])
    pool = HostBlockPool(layout, 8)
    manager = FSOffloadingManager(root, NAMESPACE, sum(PAGES), bytes_to_use)
    worker = FSWorker(pool, root, NAMESPACE, bytes_to_use, store_threads=4)
    rows = [t.numpy() for t in pool.tensors]
    n, job = first, 0
    while True:
        keys = [make_offload_key(i.to_bytes(32, "big"), 0) for i in range(n, n + 8)]
        for h, i in enumerate(range(n, n + 8)):
            data = np.frombuffer(content(i), dtype=np.uint8)
            rows[0][h] = data[: PAGES[0]]
            rows[1][h] = data[PAGES[0] :]
        out = manager.prepare_store(keys)
        job += 1
        worker.submit(job, CPULoadStoreSpec(range(len(out.keys_to_store))), out.store_spec)
        os.write(progress, (0).to_bytes(8, "little"))  # "writing now"
        worker.wait([job])
        (result,) = worker.poll()
        manager.complete_store(out.keys_to_store, result.success)
        n += 8
        os.write(progress, n.to_bytes(8, "little"))


if __name__ == "__main__":
    root, first, bytes_to_use, fd = sys.argv[1:]
    write_forever(root, int(first), int(bytes_to_use), int(fd))
