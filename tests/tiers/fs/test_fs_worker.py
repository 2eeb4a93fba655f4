"""FSWorker with a real HostBlockPool and real files: byte-exact stores and loads, the
worker contract, corrupt and truncated blocks, the free-space floor, restarts and
namespaces. No mocks: files are damaged with ordinary writes."""

from __future__ import annotations

import errno
import os
import threading
import time

import numpy as np
import pytest
import torch

from kvoffload.keys import make_offload_key
from kvoffload.manager import LookupResult, OffloadingEvent
from kvoffload.specs import CPULoadStoreSpec, DeviceLoadStoreSpec, DiskLoadStoreSpec
from kvoffload.tiers.fs import index as index_module
from kvoffload.tiers.fs.block_io import BlockFiles
from kvoffload.tiers.fs.format import DATA_FILE, HEADER_FILE, RECORD_BYTES, Geometry
from kvoffload.tiers.fs.manager import FSOffloadingManager
from kvoffload.tiers.fs.namespace import namespace_digest
from kvoffload.tiers.fs.worker import LOAD, STORE, FSWorker
from transfer_oracle import host_block, make_pool, pool_block_bytes, randomize

HIT, MISS = LookupResult.HIT, LookupResult.MISS
NUM_HOST = 16


def k(i: int) -> bytes:
    return make_offload_key(i.to_bytes(32, "big"), i % 3)


class Tier:
    """A manager and a worker on one namespace, as an engine would build them."""

    def __init__(self, root, pool, blocks=32, namespace="ns", **worker_kw):
        self.pool = pool
        self.bytes_to_use = blocks * Geometry(pool_block_bytes(pool)).stored_block_bytes
        self.manager = FSOffloadingManager(root, namespace, pool_block_bytes(pool), self.bytes_to_use,
                                           enable_events=True)  # fmt: skip
        self.worker = FSWorker(pool, root, namespace, self.bytes_to_use, **worker_kw)
        self.next_job = 0

    def run(self, src, dst):
        self.next_job += 1
        assert self.worker.submit(self.next_job, src, dst) is True
        self.worker.wait([self.next_job])
        (result,) = self.worker.poll()
        assert result.job_id == self.next_job
        return result

    def store(self, keys, host_ids, expect=True):
        out = self.manager.prepare_store(keys)
        result = self.run(CPULoadStoreSpec(host_ids), out.store_spec)
        self.manager.complete_store(out.keys_to_store, result.success)
        assert result.success is expect, result.error
        return result

    def load(self, keys, host_ids):
        spec = self.manager.prepare_load(keys)
        result = self.run(spec, CPULoadStoreSpec(host_ids))
        self.manager.complete_load(keys)
        if not result.success:
            self.manager.discard(keys)
        return result

    def close(self):
        self.worker.close()
        self.manager.close()


@pytest.mark.parametrize("f", [1, 4])
def test_store_then_load_is_byte_exact(tmp_path, f):
    pool = make_pool(f=f)
    tier = Tier(tmp_path, pool)
    keys = [k(i) for i in range(8)]
    expected = {key: host_block(pool, h) for key, h in zip(keys, range(8))}
    result = tier.store(keys, list(range(8)))
    assert result.bytes == 8 * pool_block_bytes(pool) and result.direction == STORE
    gen = torch.Generator().manual_seed(9)
    for t in pool.tensors:
        randomize(t, gen)
    untouched = {h: host_block(pool, h) for h in range(8)}
    order = [5, 0, 7, 2]
    result = tier.load([keys[i] for i in order], [8, 9, 10, 15])
    assert result.success and result.direction == LOAD and result.bytes == 4 * pool_block_bytes(pool)
    for i, h in zip(order, [8, 9, 10, 15]):
        assert host_block(pool, h) == expected[keys[i]]
    assert {h: host_block(pool, h) for h in range(8)} == untouched  # nothing else moved
    counters = tier.worker.counters()
    assert (counters.blocks_written, counters.blocks_read, counters.stores, counters.loads) == (8, 4, 1, 1)
    tier.close()


def test_submit_validates_and_names_the_bad_value(tmp_path):
    pool = make_pool()
    tier = Tier(tmp_path, pool, blocks=8)
    w = tier.worker
    disk = DiskLoadStoreSpec([0, 1], [k(0), k(1)])
    with pytest.raises(TypeError, match="CPU->CPU"):
        w.submit(1, CPULoadStoreSpec([0]), CPULoadStoreSpec([1]))
    with pytest.raises(TypeError, match="GPU->DISK"):
        w.submit(1, DeviceLoadStoreSpec([0], [1], [0]), disk)
    with pytest.raises(ValueError, match=r"host block id 16 out of range \[0, 16\)"):
        w.submit(1, CPULoadStoreSpec([0, 16]), disk)
    with pytest.raises(ValueError, match=r"disk slot 8 out of range \[0, 8\)"):
        w.submit(1, CPULoadStoreSpec([0, 1]), DiskLoadStoreSpec([0, 8], [k(0), k(1)]))
    with pytest.raises(ValueError, match="3 host blocks but 2 disk slots"):
        w.submit(1, CPULoadStoreSpec([0, 1, 2]), disk)
    with pytest.raises(ValueError, match="writes disk slot 1 twice"):
        w.submit(1, CPULoadStoreSpec([0, 2]), DiskLoadStoreSpec([1, 1], [k(0), k(1)]))
    with pytest.raises(ValueError, match="writes host block 3 twice"):
        w.submit(1, disk, CPULoadStoreSpec([3, 3]))
    with pytest.raises(ValueError, match="a key must be 1..64 bytes"):
        w.submit(1, CPULoadStoreSpec([0]), DiskLoadStoreSpec([0], [b"x" * 65]))
    assert w.poll() == []
    # a job id in flight is refused: every write waits until released
    release = threading.Event()
    write = w.files.write_run

    def held(*args):
        release.wait()
        return write(*args)

    w.files.write_run = held
    try:
        assert w.submit(7, CPULoadStoreSpec([0]), DiskLoadStoreSpec([0], [k(0)]))
        with pytest.raises(ValueError, match=r"^job id 7 is already in flight$"):
            w.submit(7, DiskLoadStoreSpec([1], [k(1)]), CPULoadStoreSpec([1]))
        with pytest.raises(TimeoutError, match=r"jobs \[7\] still running"):
            w.wait([7], timeout=0.01)
    finally:
        release.set()
    w.wait([7, 12345])  # unknown ids count as finished
    assert [r.job_id for r in w.poll()] == [7]
    tier.close()
    tier.close()  # idempotent
    with pytest.raises(RuntimeError, match="after close"):
        w.submit(8, CPULoadStoreSpec([0]), DiskLoadStoreSpec([0], [k(0)]))


def test_jobs_of_each_direction_complete_in_submission_order(tmp_path):
    pool = make_pool()
    tier = Tier(tmp_path, pool, blocks=64, store_threads=3, load_threads=2)
    w, m = tier.worker, tier.manager
    outs = [m.prepare_store([k(i) for i in range(j * 8, j * 8 + 8)]) for j in range(6)]
    for j, out in enumerate(outs):
        w.submit(100 + j, CPULoadStoreSpec(list(range(8))), out.store_spec)
    w.wait(range(100, 106))
    results = w.poll()
    assert [r.job_id for r in results] == list(range(100, 106)) and all(r.success for r in results)
    for out in outs:
        m.complete_store(out.keys_to_store)
    for j in range(6):
        w.submit(
            200 + j, m.prepare_load([k(j * 8 + i) for i in range(8)]), CPULoadStoreSpec(list(range(8, 16)))
        )
    w.wait(range(200, 206))
    assert [r.job_id for r in w.poll()] == list(range(200, 206))
    tier.close()


def test_a_job_runs_beside_the_previous_one_but_its_result_waits_for_it(tmp_path):
    """No barrier between jobs: the second job's runs move while the first job's are still
    running; its result is posted only after the first job's."""
    pool = make_pool()
    tier = Tier(tmp_path, pool, blocks=32, store_threads=2)
    w, m = tier.worker, tier.manager
    first = m.prepare_store([k(i) for i in range(4)])
    second = m.prepare_store([k(i) for i in range(4, 8)])
    held, release, second_written = threading.Event(), threading.Event(), threading.Event()
    write_run = w.files.write_run
    first_slot = min(int(s) for s in first.store_spec.block_ids)

    def gated(slot, keys, blocks):
        if slot == first_slot:
            held.set()
            assert release.wait(10)
        write_run(slot, keys, blocks)
        if slot != first_slot:
            second_written.set()

    w.files.write_run = gated
    w.submit(1, CPULoadStoreSpec([0, 1, 2, 3]), first.store_spec)
    assert held.wait(10)
    w.submit(2, CPULoadStoreSpec([4, 5, 6, 7]), second.store_spec)
    assert second_written.wait(10), "the second job waited for the first one to finish"
    time.sleep(0.05)
    assert w.poll() == []
    release.set()
    w.wait([1, 2])
    results = w.poll()
    assert [r.job_id for r in results] == [1, 2] and all(r.success for r in results)
    tier.close()


def test_after_a_run_fails_the_jobs_other_runs_are_skipped(tmp_path):
    """Four runs (slots not consecutive), one store thread: the first write fails with EIO,
    the job fails naming it, and the three runs behind it are never written."""
    pool = make_pool()
    tier = Tier(tmp_path, pool, blocks=32, store_threads=1)
    w = tier.worker
    written = []

    def failing(slot, keys, blocks):
        written.append(slot)
        raise OSError(errno.EIO, "injected")

    w.files.write_run = failing
    keys = [k(i) for i in range(4)]
    w.submit(1, CPULoadStoreSpec([0, 1, 2, 3]), DiskLoadStoreSpec([0, 2, 4, 6], keys))
    w.wait([1])
    (result,) = w.poll()
    assert not result.success and "injected" in result.error and result.bytes == 0
    assert written == [0]
    assert w.counters().io_errors == 1 and w.counters().stores_failed == 1
    tier.close()


def _flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))


@pytest.mark.parametrize(
    "damage, reason",
    [
        ("payload byte", "checksum mismatch"),
        ("header byte", "header record checksum mismatch"),
        ("truncated data", "truncated: read"),
        ("truncated headers", "header record truncated"),
    ],
)
def test_damaged_block_fails_the_load_is_invalidated_counted_and_discarded(tmp_path, damage, reason):
    pool = make_pool()
    tier = Tier(tmp_path, pool)
    keys = [k(i) for i in range(4)]
    tier.store(keys, [0, 1, 2, 3])
    geometry = tier.worker.geometry
    ns = tier.worker.path
    bad = keys[3]  # slot 3, the last one: truncation cuts it alone
    if damage == "payload byte":
        _flip(os.path.join(ns, DATA_FILE), geometry.data_offset(3) + 1234)
    elif damage == "header byte":
        _flip(os.path.join(ns, HEADER_FILE), 3 * RECORD_BYTES + 60)
    elif damage == "truncated data":
        os.truncate(os.path.join(ns, DATA_FILE), geometry.data_offset(3) + 100)
    else:
        os.truncate(os.path.join(ns, HEADER_FILE), 3 * RECORD_BYTES + 50)
    poison = host_block(pool, 12)
    result = tier.load([keys[0], bad], [10, 11])
    assert not result.success and result.bytes == 0
    assert bad.hex() in result.error and reason in result.error and "slot 3" in result.error
    assert tier.worker.counters().corrupt_blocks == 1 and tier.worker.counters().loads_failed == 1
    # the tiered manager discards every key of a failed read: both are misses now
    assert tier.manager.lookup(bad) is MISS and tier.manager.counters().discarded == 2
    assert [e for e in tier.manager.take_events() if e.removed] == [
        OffloadingEvent([keys[0], bad], "DISK", True)
    ]
    # the bad block is invalidated on disk: read again under its slot it is an empty slot
    w = tier.worker
    w.submit(99, DiskLoadStoreSpec([3], [bad]), CPULoadStoreSpec([12]))
    w.wait([99])
    (again,) = w.poll()
    assert not again.success and ("empty slot" in again.error or "header record truncated" in again.error)
    assert host_block(pool, 12) == poison or not again.success
    # intact neighbours still load byte-exact (re-stored keys[0] under a new slot)
    expected = host_block(pool, 1)
    assert tier.load([keys[1]], [13]).success and host_block(pool, 13) == expected
    tier.close()


def test_a_slot_holding_another_key_is_not_served(tmp_path):
    pool = make_pool()
    tier = Tier(tmp_path, pool)
    tier.store([k(1)], [0])
    result = tier.run(DiskLoadStoreSpec([0], [k(2)]), CPULoadStoreSpec([5]))
    assert not result.success and f"slot holds key {k(1).hex()} instead" in result.error
    tier.close()


def test_free_space_floor_declines_stores_and_counts_them(tmp_path):
    pool = make_pool()
    tier = Tier(tmp_path, pool, min_free_fraction=0.999)
    result = tier.store([k(1), k(2)], [0, 1], expect=False)
    assert "declined" in result.error and "free-space floor" in result.error
    assert tier.worker.counters().floor_declines == 1 and tier.manager.lookup(k(1)) is MISS
    tier.worker.free_floor = 0  # the file system has room again: the worker carries on
    tier.store([k(1), k(2)], [0, 1])
    assert tier.manager.lookup(k(2)) is HIT
    tier.close()
    with pytest.raises(ValueError, match="min_free_fraction must be in"):
        FSWorker(pool, tmp_path, "x", 1 << 20, min_free_fraction=1.5)
    with pytest.raises(ValueError, match="store_threads must be a positive int, got 0"):
        FSWorker(pool, tmp_path, "x", 1 << 20, store_threads=0)


@pytest.mark.parametrize("native", [True, False], ids=["C index", "Python index"])
def test_restart_rebuilds_the_index_serves_intact_blocks_and_drops_torn_ones(tmp_path, monkeypatch, native):
    if native and not index_module.NATIVE:
        pytest.skip("could not import kvoffload.tiers.fs._slotfind (not built: no C compiler at install)")
    monkeypatch.setattr(index_module, "NATIVE", native)
    pool = make_pool()
    tier = Tier(tmp_path, pool)
    keys = [k(i) for i in range(10)]
    tier.store(keys[:6], list(range(6)))
    tier.store(keys[6:], list(range(6, 10)))
    expected = {key: host_block(pool, h) for key, h in zip(keys, range(10))}
    geometry, ns = tier.worker.geometry, tier.worker.path
    tier.close()
    # slot 2: killed between zeroing the record and writing the new one (an empty slot);
    # slot 4: a torn record; slot 6: a record over a lost payload page (power cut);
    # slot 9: cut off by a truncated data file
    with open(os.path.join(ns, HEADER_FILE), "r+b") as f:
        f.seek(2 * RECORD_BYTES)
        f.write(bytes(RECORD_BYTES))
    _flip(os.path.join(ns, HEADER_FILE), 4 * RECORD_BYTES + 70)
    _flip(os.path.join(ns, DATA_FILE), geometry.data_offset(6) + 7)
    os.truncate(os.path.join(ns, DATA_FILE), geometry.data_offset(9) + geometry.payload_bytes - 1)

    gen = torch.Generator().manual_seed(3)
    for t in pool.tensors:
        randomize(t, gen)
    again = Tier(tmp_path, pool, blocks=10)
    m = again.manager
    assert m._index.native is native
    events = m.take_events()
    survivors = [key for i, key in enumerate(keys) if i not in (2, 4, 9)]
    assert len(events) == 1 and not events[0].removed and sorted(events[0].keys) == sorted(survivors)
    counters = m.counters()
    assert (counters.rebuilt, counters.torn_at_start) == (7, 2)  # the empty slot is not torn
    assert m.stats().used == 7 and all(m.lookup(key) is MISS for key in (keys[2], keys[4], keys[9]))
    served = 0
    for key in survivors:
        result = again.load([key], [15])
        if key == keys[6]:
            assert not result.success and "checksum mismatch" in result.error
            assert m.lookup(key) is MISS
        else:
            assert result.success, result.error
            assert host_block(pool, 15) == expected[key]
            served += 1
    assert served == 6
    # new stores take the never-used slot above the rebuilt ones, then the discarded one,
    # then the holes lowest first; they are served after another restart
    out = m.prepare_store([k(50 + i) for i in range(4)])
    assert out.store_spec.block_ids.tolist() == [9, 6, 2, 4]
    m.complete_store(out.keys_to_store, False)
    again.store([k(50)], [0])
    expected[k(50)] = host_block(pool, 0)
    again.close()
    third = Tier(tmp_path, pool)
    assert third.load([k(50)], [14]).success and host_block(pool, 14) == expected[k(50)]
    third.close()


def test_restart_keeps_the_newest_copy_of_a_key(tmp_path):
    pool = make_pool()
    geometry = Geometry(pool_block_bytes(pool))
    ns = tmp_path / "ns"
    ns.mkdir()
    files = BlockFiles(str(ns), geometry, namespace_digest("ns"))
    rows = [t.numpy() for t in pool.tensors]
    files.write(0, k(1), [r[0] for r in rows])
    files.write(5, k(1), [r[1] for r in rows])  # written later: wins
    files.close()
    tier = Tier(tmp_path, pool)
    assert tier.manager.counters().duplicates_at_start == 1
    assert tier.manager.prepare_load([k(1)]).block_ids.tolist() == [5]
    tier.manager.complete_load([k(1)])
    expected = host_block(pool, 1)
    assert tier.load([k(1)], [9]).success and host_block(pool, 9) == expected
    tier.close()


def test_another_namespace_sees_nothing(tmp_path):
    pool = make_pool()
    a = Tier(tmp_path, pool, namespace="kv-aaaa")
    a.store([k(1), k(2)], [0, 1])
    a.close()
    b = Tier(tmp_path, pool, namespace="kv-bbbb")
    assert b.manager.take_events() == [] and b.manager.lookup(k(1)) is MISS
    b.close()
    # files copied into another namespace's directory carry the wrong digest: never served
    for name in (DATA_FILE, HEADER_FILE):
        with open(tmp_path / "kv-aaaa" / name, "rb") as src, open(tmp_path / "kv-bbbb" / name, "wb") as dst:
            dst.write(src.read())
    c = Tier(tmp_path, pool, namespace="kv-bbbb")
    assert c.manager.stats().used == 0 and c.manager.counters().torn_at_start == 2
    result = c.run(DiskLoadStoreSpec([0], [k(1)]), CPULoadStoreSpec([3]))
    assert not result.success and "written under another namespace" in result.error
    c.close()


def test_layout_identity_changes_the_namespace():
    from kvoffload.tiers.fs.namespace import fs_namespace, layout_identity, namespace_identity

    pool = make_pool()
    base = dict(model="m", dtype="bfloat16", block_size=16, kv_cache_groups=[{"kind": "full"}], hash_seed="s")
    one = fs_namespace(namespace_identity(layout=layout_identity(pool.layout, 1), **base))
    four = fs_namespace(namespace_identity(layout=layout_identity(pool.layout, 4), **base))
    assert one != four and one.startswith("kv-") and len(one) == 35
    assert one == fs_namespace(namespace_identity(layout=layout_identity(pool.layout, 1), **base))


def _tmpfs(path) -> str | None:
    """Mount a 2 MiB tmpfs at ``path``; the reason when it cannot be done."""
    if os.geteuid() != 0:
        return "needs root to mount a small tmpfs"
    path.mkdir()
    status = os.system(f"mount -t tmpfs -o size=2m kvoffload-test {path} 2>/dev/null")
    return None if status == 0 else f"mount -t tmpfs failed (status {status}): no CAP_SYS_ADMIN here?"


def test_a_full_file_system_fails_stores_cleanly_and_the_worker_recovers(tmp_path):
    small = tmp_path / "small"
    reason = _tmpfs(small)
    if reason:
        pytest.skip(reason)
    try:
        pool = make_pool()
        tier = Tier(small, pool, blocks=1000, min_free_fraction=0)  # capacity far above 2 MiB
        tier.store([k(i) for i in range(8)], list(range(8)))
        expected = host_block(pool, 3)
        filler = small / "filler"
        with open(filler, "wb") as f:  # fill the file system to the last byte
            try:
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
            except OSError:
                pass
        result = tier.store([k(100 + i) for i in range(8)], list(range(8)), expect=False)
        assert "No space left on device" in result.error
        assert tier.worker.counters().no_space >= 1 and tier.manager.lookup(k(100)) is MISS
        assert tier.load([k(3)], [12]).success and host_block(pool, 12) == expected  # loads go on
        filler.unlink()
        tier.store([k(100 + i) for i in range(8)], list(range(8)))  # recovered
        assert tier.manager.lookup(k(107)) is HIT
        # the floor: with 5% kept free, the tier declines before the disk is full
        tier.worker.free_floor = os.statvfs(small).f_bavail * os.statvfs(small).f_frsize
        assert "free-space floor" in tier.store([k(200)], [0], expect=False).error
        tier.worker.free_floor = 0
        counters = tier.worker.counters()
        assert counters.stores_failed == 2 and counters.floor_declines == 1
        tier.close()
    finally:
        os.system(f"umount {small} 2>/dev/null || umount -l {small}")


def test_a_read_only_file_system_fails_at_start_naming_root_dir(tmp_path):
    small = tmp_path / "ro"
    reason = _tmpfs(small)
    if reason:
        pytest.skip(reason)
    try:
        (small / "ns").mkdir()
        assert os.system(f"mount -o remount,ro {small}") == 0
        pool = make_pool()
        with pytest.raises(ValueError, match=f"root_dir '{small}' is not writable"):
            FSWorker(pool, small, "ns", 1 << 20)
        with pytest.raises(ValueError, match=f"root_dir '{small}' is not writable"):
            FSOffloadingManager(small, "ns", pool_block_bytes(pool), 1 << 20)
        with pytest.raises(ValueError, match=f"root_dir '{small}' cannot be created"):
            FSOffloadingManager(small, "other", pool_block_bytes(pool), 1 << 20)
    finally:
        os.system(f"umount {small} 2>/dev/null || umount -l {small}")


def test_pool_rows_are_read_in_place(tmp_path):
    """Loads land in the pool tensors themselves (no staging copy left behind)."""
    pool = make_pool()
    tier = Tier(tmp_path, pool)
    tier.store([k(1)], [2])
    expected = [t[2].clone() for t in pool.tensors]
    pointers = [t.data_ptr() for t in pool.tensors]
    for t in pool.tensors:
        t[7].zero_()
    assert tier.load([k(1)], [7]).success
    assert all(torch.equal(t[7], e) for t, e in zip(pool.tensors, expected))
    assert [t.data_ptr() for t in pool.tensors] == pointers
    first = np.frombuffer(tier.worker._host.block(7)[0], dtype=np.uint8)
    assert np.shares_memory(first, pool.tensors[0].numpy())
    tier.close()


def test_a_corrupt_block_inside_a_run_of_consecutive_slots_is_named(tmp_path):
    pool = make_pool()
    tier = Tier(tmp_path, pool)
    keys = [k(i) for i in range(6)]
    tier.store(keys, list(range(6)))
    expected = [host_block(pool, h) for h in range(6)]
    _flip(os.path.join(tier.worker.path, DATA_FILE), tier.worker.geometry.data_offset(4) + 5)
    result = tier.load(keys[2:6], [10, 11, 12, 13])  # slots 2..5: one run
    assert not result.success and f"key {keys[4].hex()} in slot 4: checksum mismatch" in result.error
    assert tier.worker.counters().corrupt_blocks == 1
    tier.store([keys[2], keys[3], keys[5]], [2, 3, 5])  # discarded with the job: stored again
    assert tier.load([keys[2], keys[3], keys[5]], [10, 11, 12]).success
    assert [host_block(pool, h) for h in (10, 11, 12)] == [expected[2], expected[3], expected[5]]
    tier.close()
