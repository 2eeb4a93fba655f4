"""A small but real second tier for tests: "SHELF", blocks kept as bytes in a dict.

Its manager is the CPU tier's bookkeeping under another medium; its worker copies every
pool tensor's row of a host block into the dict and back, on a thread per job (jobs wait
for ``release``, set by default, so a test can hold them in flight). ``ShelfTierType`` makes
it configurable as ``{"type": "shelf_tier:ShelfTierType", "blocks": N}``, the way an
out-of-tree tier is; ``ShelfTierType.last_worker`` is the worker the factory built.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from kvoffload.cpu import CPUOffloadingManager
from kvoffload.manager import PrepareStoreOutput
from kvoffload.specs import LoadStoreSpec
from kvoffload.tiers.secondary import SecondaryTierType
from kvoffload.validation import positive_int
from kvoffload.worker import OffloadingWorker, TransferResult


class ShelfSpec(LoadStoreSpec):
    medium = "SHELF"

    def __init__(self, block_ids):
        self.block_ids = np.asarray(block_ids, dtype=np.int64)


class Shelf(CPUOffloadingManager):
    """The CPU tier's bookkeeping under another medium, handing out ``ShelfSpec``s."""

    medium = "SHELF"

    def prepare_load(self, keys):
        return ShelfSpec(super().prepare_load(keys).block_ids)

    def prepare_store(self, keys):
        out = super().prepare_store(keys)
        return out and PrepareStoreOutput(
            out.keys_to_store, ShelfSpec(out.store_spec.block_ids), out.evicted_keys
        )


class ShelfWorker(OffloadingWorker):
    """Moves whole host blocks (every pool tensor's row) between the pool and a dict."""

    routes = frozenset({("CPU", "SHELF"), ("SHELF", "CPU")})

    def __init__(self, pool):
        self.pool = pool
        self.shelf: dict[int, list[bytes]] = {}
        self.release = threading.Event()
        self.release.set()
        self.fail_reads = False  # a test's way to make every read fail, as a bad checksum would
        self._lock = threading.Lock()
        self._results: list[TransferResult] = []
        self._threads: dict[int, threading.Thread] = {}
        self.closed = False

    def submit(self, job_id, src_spec, dst_spec):
        if self.closed:
            raise RuntimeError(f"submit({job_id}) after close()")
        if job_id in self._threads:
            raise ValueError(f"job id {job_id} is already in flight")
        thread = threading.Thread(target=self._run, args=(job_id, src_spec, dst_spec))
        self._threads[job_id] = thread
        thread.start()
        return True

    def _run(self, job_id, src, dst):
        self.release.wait()
        tensors = self.pool.tensors
        direction = f"{src.medium}->{dst.medium}"
        if src.medium == "CPU":
            for block, slot in zip(src.block_ids.tolist(), dst.block_ids.tolist()):
                self.shelf[slot] = [t[block].numpy().tobytes() for t in tensors]
            result = TransferResult(job_id, True, 0, 0.0, direction)
        elif self.fail_reads:
            result = TransferResult(job_id, False, 0, 0.0, direction, "checksum mismatch (injected)")
        else:
            for slot, block in zip(src.block_ids.tolist(), dst.block_ids.tolist()):
                for t, row in zip(tensors, self.shelf[slot]):
                    t[block].copy_(torch.frombuffer(bytearray(row), dtype=torch.uint8))
            result = TransferResult(job_id, True, 0, 0.0, direction)
        with self._lock:
            self._results.append(result)

    def poll(self):
        with self._lock:
            results, self._results = self._results, []
        for result in results:
            self._threads.pop(result.job_id).join()
        return results

    def wait(self, job_ids, timeout=None):
        for job_id in job_ids:
            thread = self._threads.get(job_id)
            if thread is not None:
                thread.join(timeout)
                if thread.is_alive():
                    raise TimeoutError(f"job {job_id} still running")

    def close(self):
        self.release.set()
        for thread in list(self._threads.values()):
            thread.join()
        self.closed = True


class ShelfTierType(SecondaryTierType):
    type_name = "shelf"
    last_worker: ShelfWorker | None = None

    def __init__(self, blocks: int):
        self.blocks = blocks

    @classmethod
    def parse(cls, options):
        unknown = sorted(set(options) - {"blocks"})
        if unknown:
            raise ValueError(f"unknown key(s) {unknown}; known: ['blocks']")
        return cls(positive_int("blocks", options.get("blocks")))

    def build_manager(self, context, eviction_policy):
        return Shelf(self.blocks, eviction_policy, enable_events=True)

    def build_worker(self, context, host_pool):
        ShelfTierType.last_worker = ShelfWorker(host_pool)
        return ShelfTierType.last_worker
