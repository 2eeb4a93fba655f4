"""The tiered manager's fast lookup (one C call over the CPU tier's table and the disk
tiers' probes, or a Python closure without the C extension) against its general path:
the same answer for every key and the same counts in every tier, under random stores,
write-throughs, promotions (declined ones included), failed reads, evictions, discards
and resets; with one disk tier and with two.
Real disk-tier managers in tmp_path (bookkeeping only: no bytes move here)."""

from __future__ import annotations

import random

import pytest

from kvoffload.cpu import CPUOffloadingManager
from kvoffload.keys import make_offload_key
from kvoffload.manager import LookupResult
from kvoffload.tiers.fs import index as index_module
from kvoffload.tiers.fs.format import Geometry
from kvoffload.tiers.fs.manager import FSOffloadingManager
from kvoffload.tiers.tiered import TieredOffloadingManager

HIT, MISS, PENDING = LookupResult.HIT, LookupResult.MISS, LookupResult.PENDING
STORED = Geometry(4096).stored_block_bytes


@pytest.fixture(params=[True, False], ids=["C lookup", "Python lookup"])
def native(request, monkeypatch) -> bool:
    if request.param and not index_module.NATIVE:
        pytest.skip("could not import kvoffload.tiers.fs._slotfind (not built: no C compiler at install)")
    monkeypatch.setattr(index_module, "NATIVE", request.param)
    return request.param


def k(i: int) -> bytes:
    return make_offload_key(i.to_bytes(32, "big"), 0)


def make(folder, disks: int, fast: bool) -> TieredOffloadingManager:
    primary = CPUOffloadingManager(6, "lru", enable_events=True)
    below = [
        FSOffloadingManager(folder / f"disk{i}", "ns", 4096, (12 + 4 * i) * STORED, "lru", True)
        for i in range(disks)
    ]
    for i, disk in enumerate(below[1:], 2):
        disk.medium = f"DISK{i}"  # every tier has its own medium
    tiered = TieredOffloadingManager(primary, below)
    assert "lookup" in vars(tiered)  # the fast path applies to disk tiers
    assert (type(tiered.lookup).__name__ == "builtin_function_or_method") is index_module.NATIVE
    if not fast:
        del tiered.lookup  # the class's general path
    return tiered


def counts(tiered: TieredOffloadingManager) -> list[tuple[int, ...]]:
    return [(s.hits, s.misses, s.used, s.in_flight, s.pinned, s.evictions) for s in tiered.tier_stats()]


@pytest.mark.parametrize("disks", [1, 2])
def test_fast_lookup_answers_and_counts_as_the_general_path(tmp_path, disks, native):
    rng = random.Random(disks)
    fast = make(tmp_path / "fast", disks, True)
    slow = make(tmp_path / "slow", disks, False)
    both = (fast, slow)
    transfers: list[list] = [[], []]  # per manager, the tokens in flight, in the same order
    pinned: list[list[bytes]] = []
    for _ in range(3000):
        op = rng.random()
        ks = [k(rng.randrange(30)) for _ in range(rng.randint(1, 4))]
        if op < 0.25:
            outs = [m.prepare_store(ks) for m in both]
            assert (outs[0] is None) == (outs[1] is None)
            if outs[0] is not None:
                assert outs[0].keys_to_store == outs[1].keys_to_store
                ok = rng.random() < 0.9
                for m, out in zip(both, outs):
                    m.complete_store(out.keys_to_store, ok)
        elif op < 0.55:
            answers = [[m.lookup(x) for x in ks] for m in both]
            assert answers[0] == answers[1]
            hits = [x for x, a in zip(ks, answers[0]) if a is HIT]
            if hits and rng.random() < 0.5:
                for m in both:
                    m.prepare_load(hits)
                pinned.append(hits)
        elif op < 0.65:
            for m in both:
                m.touch(ks)
        elif op < 0.8:
            for m, mine in zip(both, transfers):
                mine.extend(t.token for t in m.take_transfers())
            assert len(transfers[0]) == len(transfers[1])
        elif op < 0.9 and transfers[0]:
            i = rng.randrange(len(transfers[0]))
            ok = rng.random() < 0.85
            for m, mine in zip(both, transfers):
                m.complete_transfer(mine.pop(i), ok)
        elif op < 0.95 and pinned:
            done = pinned.pop(rng.randrange(len(pinned)))
            for m in both:
                m.complete_load(done)
        elif op < 0.99:
            tier = rng.randrange(disks)
            for m in both:
                m.secondaries[tier].discard(ks)
        else:
            for m in both:
                m.reset()
            transfers = [[], []]
            pinned.clear()
        assert counts(fast) == counts(slow)
    assert [(e.keys, e.medium, e.removed) for e in fast.take_events()] == [
        (e.keys, e.medium, e.removed) for e in slow.take_events()
    ]


def test_a_tier_hears_the_fast_lookups_counts_by_the_next_step(tmp_path, native):
    tiered = make(tmp_path, 1, True)
    primary, disk = tiered.primary, tiered.secondaries[0]
    out = tiered.prepare_store([k(1)])
    tiered.complete_store(out.keys_to_store)
    assert [tiered.lookup(k(1)), tiered.lookup(k(2)), tiered.lookup(k(3))] == [HIT, MISS, MISS]
    tiered.take_transfers()  # a step: the counts reach the tiers themselves
    assert (primary.stats().hits, primary.stats().misses) == (1, 2)
    assert disk.stats().misses == 2
    assert tiered.lookup(k(4)) is MISS
    assert tiered.stats().misses == 3  # stats() hands them over too
    assert [s.misses for s in tiered.tier_stats()] == [3, 3]


def test_a_key_on_disk_is_pending_then_promoted(tmp_path, native):
    tiered = make(tmp_path, 2, True)
    primary = tiered.primary
    second = tiered.secondaries[1]
    out = second.prepare_store([k(7)])
    second.complete_store(out.keys_to_store)
    assert tiered.lookup(k(7)) is PENDING
    (promotion,) = tiered.take_transfers()
    assert promotion.src_spec.medium == "DISK" and primary.state(k(7)) == -1
    assert tiered.lookup(k(7)) is PENDING
    tiered.complete_transfer(promotion.token, True)
    assert tiered.lookup(k(7)) is HIT
    assert tiered.load_source(k(7)) == "DISK2"


def test_a_primary_that_answers_lookups_its_own_way_keeps_them(tmp_path):
    class Counting(CPUOffloadingManager):
        asked = 0

        def lookup(self, key):
            Counting.asked += 1
            return super().lookup(key)

    disk = FSOffloadingManager(tmp_path, "ns", 4096, 8 * STORED)
    tiered = TieredOffloadingManager(Counting(4), [disk])
    assert "lookup" not in vars(tiered)
    assert tiered.lookup(k(1)) is MISS and Counting.asked == 1


def test_the_c_lookup_is_collected_with_its_manager(tmp_path, native):
    import gc
    import weakref

    tiered = make(tmp_path, 1, True)
    gone = weakref.ref(tiered)
    for disk in tiered.secondaries:
        disk.close()
    del tiered
    gc.collect()
    assert gone() is None  # the lookup refers back to the manager: a cycle the GC breaks
