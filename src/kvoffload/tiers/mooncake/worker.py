"""``MooncakeWorker``: moves blocks between the host pool and the shared Mooncake Store.

It is the ``kvoffload.worker.OffloadingWorker`` of routes ``CPU -> MOONCAKE`` (a store)
and ``MOONCAKE -> CPU`` (a load), a peer of the other movers behind a ``WorkerRouter``.

One object per block, in the Redis tier's value format (``kvoffload.tiers.redis.format``):
header and key (``head``: magic, version, lengths, CRC32C of key and payload, namespace
digest), then the payload (the block's row of every host-pool tensor, in tensor order).
Where the header lives: in a small registered *staging* array of this worker (one row of
``batch_blocks`` header slots per I/O thread), and the object is put from, and got into,
two or more buffers at once (``batch_put_from_multi_buffers`` /
``batch_get_into_multi_buffers``): the header slot, then the block's rows in the host
pool, which is registered with the client as well. So the payload moves between the pool
and the store with no Python copy, and a block is still one object: present or absent as
a whole, one lease, one master round trip per block, none of the states a separate
header object would add (a header without its payload, or the other way round, after an
eviction or a restart). The only bytes Python writes are the 60 to 100 of each header.

* store: ``submit(job_id, CPULoadStoreSpec(host_ids), MooncakeLoadStoreSpec(keys))`` puts
  host block ``host_ids[i]`` as ``keys[i]``'s object, in batches of ``batch_blocks``. A
  put of a name the store holds already keeps the old object and answers success (a block
  another replica stored is not written again). A full store answers ``-200`` for the
  blocks it had no room for (``store_full``); any failed block fails the job (the blocks
  that were put stay, checked on every read like any other).
* load: ``submit(job_id, MooncakeLoadStoreSpec(keys), CPULoadStoreSpec(host_ids))`` gets
  each object into its header slot and its host block's rows, then checks it there: the
  size, the header, the key, the namespace digest, the CRC32C of the key and the rows. A
  missing object (evicted, or lost to a master restart) fails the load
  (``missing_values``); one that fails a check or does not fit its block fails it too, is
  removed from the store and is counted (``corrupt_values``): it never reaches the engine.
  (Mooncake answers a get into buffers larger than the object with a transfer failure,
  ``-800``, and one into smaller buffers with ``-600``: the first is told from a lost
  segment holder by asking the object's size.)
  A failed load leaves its host rows unspecified (they may hold a bad object's bytes: the
  rows of a load are reserved, not loadable, and a failed load never makes them so).

``submit`` validates first (``TypeError``, ``ValueError`` naming the bad value,
``RuntimeError`` after ``close``) and never calls the client. Every call goes through the
``MooncakeStore`` (breaker; refuses after close): while the master is down jobs fail at
once, never raise, and ``close`` lets queued jobs finish before it closes the client.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from kvoffload.counters import Counters
from kvoffload.specs import MEDIUM_CPU, MEDIUM_MOONCAKE, LoadStoreSpec
from kvoffload.tiers.host_rows import HostRows
from kvoffload.tiers.mooncake.names import MooncakeLoadStoreSpec, object_names
from kvoffload.tiers.mooncake.store import (
    INVALID_PARAMS,
    NO_AVAILABLE_HANDLE,
    OBJECT_NOT_FOUND,
    TRANSFER_FAIL,
    MooncakeStore,
    is_outage,
    split_codes,
)
from kvoffload.tiers.redis.format import HEADER_BYTES, CorruptValue, KeyNames, check_head, crc32c, head
from kvoffload.tiers.shared_store_jobs import check_job
from kvoffload.validation import positive_int
from kvoffload.worker import JobBook, OffloadingWorker, Route, TransferResult

STORE = "mooncake_store"  # host -> Mooncake
LOAD = "mooncake_load"  # Mooncake -> host
_DIRECTIONS: dict[Route, str] = {(MEDIUM_CPU, MEDIUM_MOONCAKE): STORE, (MEDIUM_MOONCAKE, MEDIUM_CPU): LOAD}
MAX_KEY_BYTES = 64  # an OffloadKey: a block hash (32 bytes for sha256) and a 4-byte group


@dataclass
class MooncakeWorkerCounters(Counters):
    stores: int = 0  # store jobs that succeeded
    stores_dropped: int = 0  # store jobs failed (master down, store full, refused)
    loads: int = 0
    loads_failed: int = 0
    blocks_written: int = 0  # puts answered success (new, or kept: stored already)
    store_full: int = 0  # blocks the store had no room for (-200)
    blocks_read: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    missing_values: int = 0  # a loaded key the store no longer had
    corrupt_values: int = 0  # failed a check on read, or did not fit; removed from the store
    outages: int = 0


class _JobFailed(Exception):
    pass


class MooncakeWorker(OffloadingWorker):
    """Moves blocks between ``host_pool`` and the store behind ``store`` (which it owns
    from now on: ``close`` closes it)."""

    routes = frozenset(_DIRECTIONS)

    def __init__(
        self,
        host_pool,
        store: MooncakeStore,
        names: KeyNames,
        *,
        io_threads: int = 2,
        batch_blocks: int = 256,
    ) -> None:
        threads = positive_int("io_threads", io_threads)
        self._batch = positive_int("batch_blocks", batch_blocks)
        self.host_pool = host_pool
        self._host = HostRows(host_pool)
        self.block_bytes = self._host.block_bytes
        self.store = store
        self._names = names
        tensors = list(host_pool.tensors)
        self._base = min(t.data_ptr() for t in tensors) if self._host.num_blocks else 0
        self._widths = [w for _, _, w in self._host.segments]
        region = getattr(host_pool, "region", None)
        if region is not None and region.numel():
            store.register(region.data_ptr(), region.numel())
        elif self._host.num_blocks:
            end = max(t.data_ptr() + (t.shape[0] - 1) * t.stride(0) + t.shape[1] for t in tensors)
            store.register(self._base, end - self._base)
        self._slot = HEADER_BYTES + MAX_KEY_BYTES
        self._staging = np.zeros((threads, self._batch, self._slot), dtype=np.uint8)
        store.register(self._staging.ctypes.data, self._staging.nbytes)
        self._thread = threading.local()
        order = itertools.count()

        def assign_row() -> None:
            self._thread.row = next(order)

        self._pool = ThreadPoolExecutor(threads, "kvoffload-mooncake-io", initializer=assign_row)
        self._jobs = JobBook()
        self._lock = self._jobs.lock  # also guards the counters
        self._counters = MooncakeWorkerCounters()

    # -- submission ----------------------------------------------------------------------

    def submit(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        direction, host_ids, keys = check_job(
            "MooncakeWorker",
            _DIRECTIONS,
            MooncakeLoadStoreSpec,
            job_id,
            src_spec,
            dst_spec,
            self.host_pool.num_blocks,
        )
        long = [k for k in keys if len(k) > MAX_KEY_BYTES]
        if long:
            raise ValueError(f"key of {len(long[0])} bytes is longer than {MAX_KEY_BYTES}: {long[0].hex()}")
        self._jobs.begin(job_id)
        self._pool.submit(self._run, job_id, direction, host_ids, keys)
        return True

    # -- the jobs ------------------------------------------------------------------------

    def _run(self, job_id: int, direction: str, host_ids: list[int], keys: list[bytes]) -> None:
        start = time.perf_counter()
        error = None
        try:
            step = self._batch
            move = self._store if direction == STORE else self._load
            for i in range(0, len(keys), step):
                move(host_ids[i : i + step], keys[i : i + step])
            moved = self.block_bytes * len(keys)
        except _JobFailed as exc:
            moved, error = 0, str(exc)
        except Exception as exc:  # noqa: BLE001 - a job never raises into the engine
            moved, error = 0, f"{type(exc).__name__}: {exc}"
        with self._lock:
            counters = self._counters
            if direction == STORE:
                counters.stores += error is None
                counters.stores_dropped += error is not None
                counters.bytes_written += moved
            else:
                counters.loads += error is None
                counters.loads_failed += error is not None
                counters.bytes_read += moved
            self._jobs.finish(
                TransferResult(job_id, error is None, moved, time.perf_counter() - start, direction, error)
            )

    def _buffers(self, host_ids: list[int], heads: list[int]) -> tuple[list[list[int]], list[list[int]]]:
        """Per block: [header slot, its rows in the pool] as pointers and sizes."""
        slots = self._staging[self._thread.row]
        slot0, slot = slots.ctypes.data, self._slot
        base, segments, widths = self._base, self._host.segments, self._widths
        ptrs = [
            [slot0 + j * slot, *(base + o + b * s for o, s, _ in segments)] for j, b in enumerate(host_ids)
        ]
        sizes = [[n, *widths] for n in heads]
        return ptrs, sizes

    def _store(self, host_ids: list[int], keys: list[bytes]) -> None:
        digest, block = self._names.digest, self._host.block
        slots = self._staging[self._thread.row]
        heads = []
        for j, (b, key) in enumerate(zip(host_ids, keys)):
            h = head(key, block(b), digest)
            slots[j, : len(h)] = np.frombuffer(h, dtype=np.uint8)
            heads.append(len(h))
        ptrs, sizes = self._buffers(host_ids, heads)
        names = object_names(self._names, keys)
        codes = split_codes(self.store.call("batch_put_from_multi_buffers", names, ptrs, sizes), len(keys))
        with self._lock:
            self._counters.blocks_written += sum(1 for c in codes if c == 0)
            self._counters.store_full += sum(1 for c in codes if c == NO_AVAILABLE_HANDLE)
        bad = next((c for c in codes if c != 0), None)
        if bad is not None:
            why = (
                "the store is full"
                if bad == NO_AVAILABLE_HANDLE
                else "the master is down"
                if is_outage(bad)
                else ""
            )
            failed = sum(1 for c in codes if c != 0)
            raise _JobFailed(
                f"store failed: {failed} of {len(codes)} puts returned an error ({bad}) {why}".rstrip()
            )

    def _load(self, host_ids: list[int], keys: list[bytes]) -> None:
        digest, block, size = self._names.digest, self._host.block, self.block_bytes
        heads = [HEADER_BYTES + len(key) for key in keys]
        ptrs, sizes = self._buffers(host_ids, heads)
        names = object_names(self._names, keys)
        codes = split_codes(self.store.call("batch_get_into_multi_buffers", names, ptrs, sizes), len(keys))
        slots = self._staging[self._thread.row]
        corrupt: list[str] = []
        failure = None
        missing = 0
        for j, (b, key, code) in enumerate(zip(host_ids, keys, codes)):
            try:
                if code == OBJECT_NOT_FOUND:
                    missing += 1
                    failure = failure or f"block {key.hex()} is no longer in the store"
                    continue
                if code == INVALID_PARAMS:  # larger than its buffers: not this block
                    raise CorruptValue("the object is larger than the block")
                if code == TRANSFER_FAIL:  # also what an object smaller than its buffers gets
                    held = self.store.call("get_size", names[j])
                    if isinstance(held, int) and held >= 0 and held != heads[j] + size:
                        raise CorruptValue(f"the object holds {held} bytes, not {heads[j] + size}")
                if code < 0:
                    failure = failure or f"load failed: get returned {code}"
                    continue
                crc = check_head(slots[j, : heads[j]], key, digest, size, code)
                got = crc32c(key)
                for view in block(b):
                    got = crc32c(view, got)
                if got != crc:
                    raise CorruptValue("CRC32C mismatch")
            except CorruptValue as exc:
                corrupt.append(names[j])
                failure = failure or f"block {key.hex()} is corrupt: {exc}"
        with self._lock:
            self._counters.missing_values += missing
            self._counters.corrupt_values += len(corrupt)
        if corrupt:
            self.store.call("batch_remove", corrupt, True)
        if failure:
            raise _JobFailed(failure)
        with self._lock:
            self._counters.blocks_read += len(keys)

    # -- results -------------------------------------------------------------------------

    def poll(self) -> list[TransferResult]:
        return self._jobs.poll()

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> None:
        self._jobs.wait(job_ids, timeout)

    def counters(self) -> MooncakeWorkerCounters:
        with self._lock:
            return self._counters.snapshot(outages=self.store.breaker.outages)

    def close(self) -> None:
        """Let queued jobs finish (each bounded by Mooncake's own timeouts), then close the
        client (which unregisters the pool and the staging array)."""
        if self._jobs.close():
            self._pool.shutdown(wait=True)
            self.store.close()
