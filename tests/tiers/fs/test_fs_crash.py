"""A process killed with SIGKILL in the middle of a burst of disk-tier writes, restarted on
the same root_dir: every block the new process serves is byte-exact what was written under
its key; torn blocks are never served. The child writes blocks of ~250 KB (two tensors of
odd sizes) into a tier of 24 slots, so slots are overwritten all the time."""

from __future__ import annotations

import os
import random
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from fs_crash_writer import NAMESPACE, PAGES, content

from kvoffload.specs import CPULoadStoreSpec
from kvoffload.tiers.fs.format import Geometry
from kvoffload.tiers.fs.manager import FSOffloadingManager
from kvoffload.tiers.fs.worker import FSWorker
from kvoffload.transfer import HostBlockPool, KVLayout

SLOTS = 24
WRITER = Path(__file__).with_name("fs_crash_writer.py")


def key_number(key: bytes) -> int:
    return int.from_bytes(key[:32], "big")


def burst_and_kill(root, first: int, blocks: int, rng: random.Random) -> int:
    """Start a writer process, let it store ``blocks`` blocks and a few more jobs, SIGKILL it."""
    bytes_to_use = SLOTS * Geometry(sum(PAGES)).stored_block_bytes
    read_end, write_end = os.pipe()
    command = [sys.executable, str(WRITER), str(root), str(first), str(bytes_to_use), str(write_end)]
    writer = subprocess.Popen(command, pass_fds=(write_end,))
    os.close(write_end)
    try:
        written = first
        while True:
            ready, _, _ = select.select([read_end], [], [], 120)
            assert ready, "the writer stopped reporting (hung?)"  # a hang guard, not a timing
            data = os.read(read_end, 8)
            assert len(data) == 8, "the writer died on its own"
            message = int.from_bytes(data, "little")
            if message:
                written = message
            elif written >= first + blocks:
                break  # a job is being written: kill somewhere in it
        time.sleep(rng.uniform(0, 0.0015))
        writer.send_signal(signal.SIGKILL)
    finally:
        writer.kill()  # by its own PID; a no-op once it has been reaped
        status = writer.wait()
        os.close(read_end)
    assert status == -signal.SIGKILL
    return written + 8


def test_sigkill_during_writes_never_serves_a_torn_block(tmp_path):
    rng = random.Random(11)
    bytes_to_use = SLOTS * Geometry(sum(PAGES)).stored_block_bytes
    layout = KVLayout([torch.empty((1, p), dtype=torch.uint8) for p in PAGES])
    pool = HostBlockPool(layout, 4)
    next_key = 0
    served_total = 0
    for _ in range(4):
        next_key = burst_and_kill(tmp_path, next_key, 48 + rng.randrange(16), rng)
        manager = FSOffloadingManager(tmp_path, NAMESPACE, sum(PAGES), bytes_to_use, enable_events=True)
        worker = FSWorker(pool, tmp_path, NAMESPACE, bytes_to_use)
        (event,) = manager.take_events()
        assert not event.removed and 0 < len(event.keys) <= SLOTS
        served = failed = 0
        for job, key in enumerate(event.keys):
            spec = manager.prepare_load([key])
            for t in pool.tensors:
                t.numpy().fill(0xA5)
            worker.submit(job, spec, CPULoadStoreSpec([0]))
            worker.wait([job])
            (result,) = worker.poll()
            manager.complete_load([key])
            if result.success:
                got = b"".join(t[0].numpy().tobytes() for t in pool.tensors)
                assert got == content(key_number(key)), f"block {key_number(key)} served with wrong bytes"
                served += 1
            else:
                assert "checksum mismatch" in result.error or "empty slot" in result.error, result.error
                manager.discard([key])
                failed += 1
        # a SIGKILL loses no written page: everything announced is intact
        assert failed == 0 and served == len(event.keys)
        assert manager.counters().torn_at_start == 0  # records are zeroed first, never torn
        served_total += served
        worker.close()
        manager.close()
    assert served_total >= 4
