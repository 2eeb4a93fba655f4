"""FSOffloadingManager: the tier-manager contract on a compact in-memory index, the same
eviction order as the CPU tier, discard, capacity, the namespace lock and the rebuild
event. Real directories in tmp_path; the bytes themselves are tested in test_fs_worker."""

from __future__ import annotations

import random
import subprocess
import sys

import numpy as np
import pytest

from kvoffload.cpu import CPUOffloadingManager
from kvoffload.keys import make_offload_key
from kvoffload.manager import LookupResult, OffloadingEvent, RequestContext
from kvoffload.policies import available_policies
from kvoffload.specs import DiskLoadStoreSpec
from kvoffload.tiers.fs import index as index_module
from kvoffload.tiers.fs.format import RECORD_BYTES, Geometry
from kvoffload.tiers.fs.manager import FSOffloadingManager

HIT, MISS, PENDING = LookupResult.HIT, LookupResult.MISS, LookupResult.PENDING
BLOCK = 4096  # payload bytes; a stored block is 4096 + 128
STORED = BLOCK + RECORD_BYTES


def k(i: int) -> bytes:
    return make_offload_key(i.to_bytes(32, "big"), 0)


def keys(*ids: int) -> list[bytes]:
    return [k(i) for i in ids]


def make(tmp_path, blocks=4, policy="lru", events=True, name="ns", **kw) -> FSOffloadingManager:
    return FSOffloadingManager(tmp_path, name, BLOCK, blocks * STORED, policy, events, **kw)


def store(m, *ids):
    out = m.prepare_store(keys(*ids))
    assert out is not None
    m.complete_store(out.keys_to_store)
    return out


def test_capacity_is_bytes_to_use_over_stored_block_bytes(tmp_path):
    assert Geometry(BLOCK).stored_block_bytes == STORED
    assert Geometry(5000).slot_stride == 8192
    m = FSOffloadingManager(tmp_path, "ns", BLOCK, 10 * STORED - 1)
    assert m.stats().capacity == 9 and m.medium == "DISK"
    with pytest.raises(ValueError, match="bytes_to_use=100"):
        FSOffloadingManager(tmp_path, "other", BLOCK, 100)
    with pytest.raises(ValueError, match="bytes_to_use"):
        FSOffloadingManager(tmp_path, "other", BLOCK, 0)
    with pytest.raises(ValueError, match="block_bytes"):
        FSOffloadingManager(tmp_path, "other", -1, 10 * STORED)
    with pytest.raises(ValueError, match="unknown eviction policy 'nope'"):
        FSOffloadingManager(tmp_path, "other", BLOCK, 10 * STORED, "nope")
    with pytest.raises(ValueError, match="namespace must be a plain directory name"):
        FSOffloadingManager(tmp_path, "../x", BLOCK, 10 * STORED)


def test_slots_order_specs_and_events(tmp_path):
    m = make(tmp_path)
    out = m.prepare_store(keys(1, 2, 3))
    assert isinstance(out.store_spec, DiskLoadStoreSpec) and out.store_spec.medium == "DISK"
    assert out.store_spec.block_ids.tolist() == [0, 1, 2] and out.store_spec.keys == keys(1, 2, 3)
    assert m.lookup(k(1)) is PENDING and m.state(k(1)) == -1
    m.complete_store(out.keys_to_store)
    assert m.take_events() == [OffloadingEvent(keys(1, 2, 3), "DISK", False)]
    m.touch(keys(1, 2, 3))
    out = m.prepare_store(keys(4, 5, 6))
    assert out.evicted_keys == keys(3, 2)
    assert out.store_spec.block_ids.tolist() == [3, 1, 2]
    assert m.take_events() == [OffloadingEvent(keys(3, 2), "DISK", True)]
    assert m.lookup(k(2)) is MISS and m.lookup(k(1)) is HIT


def test_load_pins_all_or_nothing_and_complete_load(tmp_path):
    m = make(tmp_path)
    store(m, 1, 2)
    m.prepare_store(keys(3))
    spec = m.prepare_load(keys(2, 1, 2))
    assert spec.block_ids.tolist() == [1, 0, 1] and spec.keys == keys(2, 1, 2)
    assert m.state(k(2)) == 2 and m.stats().pinned == 2
    with pytest.raises(KeyError, match="still being stored"):
        m.prepare_load(keys(1, 3))
    with pytest.raises(KeyError, match="absent"):
        m.prepare_load(keys(1, 9))
    assert m.state(k(1)) == 1
    with pytest.raises(KeyError, match="no load was prepared"):
        m.complete_load(keys(1, 1))
    assert m.state(k(1)) == 1
    m.complete_load(keys(2, 1, 2))
    assert m.stats().pinned == 0 and m.state(k(1)) == 0


def test_pinned_and_in_flight_blocks_are_never_evicted_and_store_is_atomic(tmp_path):
    m = make(tmp_path, blocks=3)
    store(m, 1, 2)
    m.prepare_store(keys(3))  # in flight
    m.prepare_load(keys(1))
    assert m.prepare_store(keys(4, 5)) is None  # only 2 is evictable
    assert m.lookup(k(2)) is HIT and m.stats().used == 3
    out = m.prepare_store(keys(4))
    assert out.evicted_keys == keys(2)
    assert m.prepare_store(keys(1, 2, 3, 4, 5)) is None  # more new keys than capacity


def test_a_key_named_in_the_call_is_never_evicted(tmp_path):
    m = make(tmp_path, blocks=2)
    store(m, 1, 2)
    m.touch(keys(2))
    out = m.prepare_store(keys(1, 3))  # 1 is least recent but named: 2 goes
    assert out.evicted_keys == keys(2) and out.keys_to_store == keys(3)


def test_failed_store_frees_silently_and_discard_drops_idle_only(tmp_path):
    m = make(tmp_path)
    store(m, 1, 2)
    m.take_events()
    m.prepare_store(keys(3, 4))
    m.complete_store(keys(3), success=False)
    assert m.lookup(k(3)) is MISS and m.take_events() == []
    m.prepare_load(keys(2))
    m.discard(keys(1, 2, 4, 99))  # 2 pinned, 4 in flight, 99 absent: only 1 goes
    assert m.lookup(k(1)) is MISS and m.state(k(2)) == 1 and m.state(k(4)) == -1
    assert m.take_events() == [OffloadingEvent(keys(1), "DISK", True)]
    m.complete_load(keys(2))
    m.discard(keys(2))
    assert m.lookup(k(2)) is MISS and m.counters().discarded == 2
    out = m.prepare_store(keys(5, 6))  # discarded slots are reused, last freed first
    assert sorted(out.store_spec.block_ids.tolist()) == [0, 1]


def test_reset_drops_everything_and_announces_loadable(tmp_path):
    m = make(tmp_path)
    store(m, 1, 2)
    m.prepare_store(keys(3))
    m.take_events()
    m.reset()
    assert m.take_events() == [OffloadingEvent(keys(1, 2), "DISK", True)]
    assert m.stats().used == 0 and m.lookup(k(1)) is MISS
    assert m.prepare_store(keys(5)).store_spec.block_ids.tolist() == [0]


def test_keys_longer_than_max_key_bytes_are_rejected(tmp_path):
    m = make(tmp_path)
    with pytest.raises(ValueError, match="1..36 bytes"):
        m.prepare_store([b"x" * 37])
    short = make(tmp_path, name="short", max_key_bytes=12)
    out = short.prepare_store([b"abc", b"abcdefghijkl"])
    assert out.keys_to_store == [b"abc", b"abcdefghijkl"]


def same_events(cpu, disk) -> bool:
    return [(e.keys, e.removed) for e in cpu.take_events()] == [
        (e.keys, e.removed) for e in disk.take_events()
    ]


@pytest.mark.parametrize("universe", [40, 3000], ids=["few keys", "reservations past their bound"])
@pytest.mark.parametrize("native", [True, False], ids=["C probe", "Python probe"])
def test_same_behaviour_as_the_cpu_tier_under_random_operations(tmp_path, monkeypatch, native, universe):
    """Same slots, evictions, lookups, events and stats as CPUOffloadingManager("lru"),
    request hooks included (reservations, re-ranking at the end of a request), with the
    index and the order probing in C and in Python."""
    if native and not index_module.NATIVE:
        pytest.skip("could not import kvoffload.tiers.fs._slotfind (not built: no C compiler at install)")
    monkeypatch.setattr(index_module, "NATIVE", native)
    rng = random.Random(7)
    running: list[RequestContext] = []
    cpu = CPUOffloadingManager(16, "lru", enable_events=True)
    disk = make(tmp_path, blocks=16)
    assert disk._index.native is native
    pinned: list[bytes] = []
    in_flight: list[bytes] = []
    for _ in range(4000):
        op = rng.random()
        ks = keys(*(rng.randrange(universe) for _ in range(rng.randint(1, 5))))
        if op < 0.35:
            a, b = cpu.prepare_store(ks), disk.prepare_store(ks)
            assert (a is None) == (b is None)
            if a is not None:
                assert a.keys_to_store == b.keys_to_store and a.evicted_keys == b.evicted_keys
                assert a.store_spec.block_ids.tolist() == b.store_spec.block_ids.tolist()
                in_flight.extend(a.keys_to_store)
        elif op < 0.55 and in_flight:
            done = [in_flight.pop(rng.randrange(len(in_flight))) for _ in range(min(3, len(in_flight)))]
            ok = rng.random() < 0.8
            cpu.complete_store(done, ok)
            disk.complete_store(done, ok)
        elif op < 0.65:
            assert [cpu.lookup(x) for x in ks] == [disk.lookup(x) for x in ks]
            assert cpu.lookup_prefix(ks) == disk.lookup_prefix(ks)
        elif op < 0.75:
            if universe > 40:  # long prompts: reservations outgrow their bound
                ks += keys(*(rng.randrange(universe) for _ in range(30)))
            cpu.touch(ks)
            disk.touch(ks)
        elif op < 0.85:
            answers = [(cpu.lookup(x), disk.lookup(x)) for x in ks]
            assert all(a is b for a, b in answers)
            hits = [x for x, (a, _) in zip(ks, answers) if a is HIT]
            if hits:
                assert cpu.prepare_load(hits).block_ids.tolist() == disk.prepare_load(hits).block_ids.tolist()
                pinned.extend(hits)
        elif op < 0.93 and pinned:
            x = pinned.pop(rng.randrange(len(pinned)))
            cpu.complete_load([x])
            disk.complete_load([x])
        elif op < 0.94:
            if running and rng.random() < 0.5:
                request = running.pop(rng.randrange(len(running)))
                groups = [keys(*range(rng.randrange(40), 40))[:6], keys(*range(rng.randrange(40)))[:3]]
                cpu.on_request_finished(request, groups, set(), set())
                disk.on_request_finished(request, groups, set(), set())
            else:
                request = RequestContext(f"r{len(running)}-{rng.random()}", group_tokens=(16, 32))
                running.append(request)
                cpu.on_new_request(request)
                disk.on_new_request(request)
        elif op < 0.97:
            cpu.discard(ks)
            disk.discard(ks)
        elif op < 0.975:
            assert same_events(cpu, disk)
            cpu.reset()
            disk.reset()
            pinned.clear()
            in_flight.clear()
            # reset lists the same keys; the CPU tier in insertion order, the disk tier by slot
            assert [sorted(e.keys) for e in cpu.take_events()] == [sorted(e.keys) for e in disk.take_events()]
        assert same_events(cpu, disk)
        a, b = cpu.stats(), disk.stats()
        assert (a.used, a.in_flight, a.pinned, a.hits, a.misses, a.evictions) == (
            b.used, b.in_flight, b.pinned, b.hits, b.misses, b.evictions,
        )  # fmt: skip


@pytest.mark.parametrize("policy", [p for p in available_policies() if p != "lru"])
def test_other_registry_policies_keep_the_contract(tmp_path, policy):
    m = make(tmp_path, blocks=8, policy=policy)
    rng = random.Random(3)
    stored: set[bytes] = set()
    for _ in range(300):
        ks = keys(*(rng.randrange(30) for _ in range(3)))
        out = m.prepare_store(ks)
        if out is None:
            continue
        stored.difference_update(out.evicted_keys)
        m.complete_store(out.keys_to_store)
        stored.update(out.keys_to_store)
        m.touch(ks)
        hits = [x for x in ks if m.lookup(x) is HIT]
        if hits:
            m.prepare_load(hits)
            m.complete_load(hits)
        assert m.stats().used == len(stored) <= 8
    assert all(m.lookup(x) is HIT for x in stored)


def test_one_manager_per_namespace(tmp_path):
    m = make(tmp_path)
    with pytest.raises(ValueError, match="in use by another disk-tier manager"):
        make(tmp_path)
    make(tmp_path, name="other").close()
    m.close()
    make(tmp_path).close()


def test_rebuild_of_an_empty_or_missing_namespace(tmp_path):
    m = make(tmp_path)
    assert m.take_events() == [] and m.counters().rebuilt == 0
    assert m.stats().used == 0


def test_index_memory_is_compact_with_lru(tmp_path):
    m = make(tmp_path, blocks=1 << 16)
    per_block = (m._index.nbytes + m._state_array.nbytes + m.order.nbytes) / m.num_blocks
    assert per_block <= 100, per_block
    for start in range(0, 1 << 16, 4096):
        store(m, *range(start, start + 4096))
    assert all(m.lookup(k(i)) is HIT for i in range(0, 1 << 16, 997))


def test_the_manager_imports_neither_torch_nor_the_worker():
    code = (
        "import sys, kvoffload.tiers.fs as fs; fs.FSOffloadingManager; fs.fs_namespace;"
        "assert 'torch' not in sys.modules, 'torch'; assert 'kvoffload.tiers.fs.worker' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_state_array_and_index_agree_after_churn(tmp_path):
    m = make(tmp_path, blocks=64)
    rng = np.random.default_rng(1)
    for _ in range(200):
        ids = rng.choice(200, size=8, replace=False).tolist()
        out = m.prepare_store(keys(*ids))
        m.complete_store(out.keys_to_store, success=bool(rng.random() < 0.9))
        m.discard(keys(*rng.choice(200, size=2).tolist()))
    resident = [i for i in range(200) if m.lookup(k(i)) is HIT]
    assert len(resident) == m.stats().used == int((m._state_array >= 0).sum())
    slots = m.prepare_load(keys(*resident)).block_ids.tolist()
    assert len(set(slots)) == len(slots)
