import numpy as np
import pytest

from kvoffload.cpu import CPUOffloadingManager
from kvoffload.manager import LookupResult, OffloadingEvent
from kvoffload.policies import LRUPolicy
from kvoffload.specs import CPULoadStoreSpec


def k(i: int) -> bytes:
    return i.to_bytes(8, "big") + b"\x00\x00\x00\x00"


def keys(*ids: int) -> list[bytes]:
    return [k(i) for i in ids]


def store(m, *ids):
    out = m.prepare_store(keys(*ids))
    assert out is not None
    m.complete_store(out.keys_to_store)
    return out


def test_slots_never_used_first_then_last_freed_first():
    m = CPUOffloadingManager(4, "lru")
    out = m.prepare_store(keys(1, 2, 3))
    assert out.store_spec.block_ids.tolist() == [0, 1, 2]
    assert out.store_spec.block_ids.dtype == np.int64
    assert isinstance(out.store_spec, CPULoadStoreSpec) and out.store_spec.medium == "CPU"
    m.complete_store(out.keys_to_store)
    # 4 gets the last never-used id; 5 and 6 need evictions of 3 and 2 (tail first, see touch)
    m.touch(keys(1, 2, 3))
    out = m.prepare_store(keys(4, 5, 6))
    assert out.evicted_keys == keys(3, 2)
    # never-used id 3 first, then freed ids last-freed-first: 2's slot (1), then 3's slot (2)
    assert out.store_spec.block_ids.tolist() == [3, 1, 2]


def test_failed_store_frees_slot_for_reuse_stack_order():
    m = CPUOffloadingManager(2, "lru", enable_events=True)
    out = m.prepare_store(keys(1, 2))
    m.complete_store(keys(1), success=True)
    m.complete_store(keys(2), success=False)
    assert m.lookup(k(2)) is LookupResult.MISS
    assert [e for e in m.take_events()] == [OffloadingEvent(keys(1), "CPU", False)]
    out = m.prepare_store(keys(3))
    assert out.store_spec.block_ids.tolist() == [1]
    assert out.evicted_keys == []


def test_lookup_pending_then_hit():
    m = CPUOffloadingManager(4)
    m.prepare_store(keys(1))
    assert m.lookup(k(1)) is LookupResult.PENDING
    assert m.lookup(k(2)) is LookupResult.MISS
    m.complete_store(keys(1))
    assert m.lookup(k(1)) is LookupResult.HIT


def test_prepare_store_skips_present_and_duplicate_keys():
    m = CPUOffloadingManager(8)
    store(m, 1)
    m.prepare_store(keys(2))  # in flight
    out = m.prepare_store(keys(1, 2, 3, 3, 4))
    assert out.keys_to_store == keys(3, 4)
    assert out.store_spec.block_ids.tolist() == [2, 3]


def test_prepare_store_never_evicts_keys_named_in_call():
    m = CPUOffloadingManager(2, "lru")
    store(m, 1, 2)
    # 1 is the LRU but named in the call, so 2 must go instead
    m.touch(keys(2))
    out = m.prepare_store(keys(1, 3))
    assert out.keys_to_store == keys(3)
    assert out.evicted_keys == keys(2)


def test_prepare_store_is_atomic_when_room_cannot_be_made():
    m = CPUOffloadingManager(3, "lru", enable_events=True)
    store(m, 1, 2)
    m.prepare_load(keys(1))  # pinned
    m.prepare_store(keys(3))  # in flight
    m.take_events()
    before = m.stats()
    assert m.prepare_store(keys(4, 5)) is None  # only 2 is evictable
    assert m.stats() == before
    assert m.take_events() == []
    assert m.lookup(k(2)) is LookupResult.HIT
    assert m.prepare_store(keys(1, 2, 3, 4, 5)) is None  # more new keys than capacity
    out = m.prepare_store(keys(4))
    assert out.evicted_keys == keys(2)


def test_pinned_and_in_flight_blocks_are_not_evicted():
    m = CPUOffloadingManager(2, "lru")
    store(m, 1)
    m.prepare_load(keys(1))
    m.prepare_store(keys(2))
    assert m.prepare_store(keys(3)) is None
    m.complete_load(keys(1))
    out = m.prepare_store(keys(3))
    assert out.evicted_keys == keys(1)


def test_events_one_per_call_in_eviction_order():
    m = CPUOffloadingManager(3, "lru", enable_events=True)
    store(m, 1, 2, 3)
    m.touch(keys(3))
    m.touch(keys(1))
    out = store(m, 4, 5)
    assert out.evicted_keys == keys(2, 3)
    assert m.take_events() == [
        OffloadingEvent(keys(1, 2, 3), "CPU", False),
        OffloadingEvent(keys(2, 3), "CPU", True),
        OffloadingEvent(keys(4, 5), "CPU", False),
    ]
    assert m.take_events() == []


def test_events_disabled_by_default():
    m = CPUOffloadingManager(1)
    store(m, 1)
    store(m, 2)
    assert m.take_events() == []


def test_duplicate_load_pins_twice():
    m = CPUOffloadingManager(2)
    store(m, 1, 2)
    spec = m.prepare_load(keys(2, 1, 2))
    assert spec.block_ids.tolist() == [1, 0, 1]
    assert m.stats().pinned == 2
    m.complete_load(keys(2))
    assert m.prepare_store(keys(3, 4)) is None  # 1 and 2 still pinned
    m.complete_load(keys(1, 2))
    assert m.stats().pinned == 0
    with pytest.raises(KeyError, match="no load was prepared"):
        m.complete_load(keys(2))


def test_prepare_load_rejects_non_hits_without_pinning():
    m = CPUOffloadingManager(4)
    store(m, 1)
    m.prepare_store(keys(2))
    with pytest.raises(KeyError, match=k(2).hex()):
        m.prepare_load(keys(1, 2))
    with pytest.raises(KeyError, match=k(9).hex()):
        m.prepare_load(keys(9))
    assert m.stats().pinned == 0


def test_complete_store_ignores_keys_not_in_flight():
    m = CPUOffloadingManager(2, enable_events=True)
    store(m, 1)
    m.take_events()
    m.complete_store(keys(1, 7))
    m.complete_store(keys(7), success=False)
    assert m.take_events() == []
    assert m.lookup(k(1)) is LookupResult.HIT


def test_lookup_prefix_and_stats_counters():
    m = CPUOffloadingManager(4)
    store(m, 1, 2, 3)
    assert m.lookup_prefix(keys(1, 2, 9, 3)) == 2
    m.prepare_store(keys(4))
    assert m.lookup_prefix(keys(1, 4, 2)) == 1  # PENDING stops the prefix
    s = m.stats()
    assert (s.capacity, s.used, s.in_flight, s.pinned) == (4, 4, 1, 0)
    assert (s.hits, s.misses, s.evictions) == (3, 1, 0)


def test_reset_drops_everything_and_announces_removal():
    m = CPUOffloadingManager(4, enable_events=True)
    store(m, 1, 2)
    m.prepare_store(keys(3))
    m.take_events()
    m.reset()
    assert m.take_events() == [OffloadingEvent(keys(1, 2), "CPU", True)]
    assert m.stats().used == 0
    assert all(m.lookup(x) is LookupResult.MISS for x in keys(1, 2, 3))
    out = m.prepare_store(keys(5))
    assert out.store_spec.block_ids.tolist() == [0]


def test_zero_capacity_stores_nothing():
    m = CPUOffloadingManager(0)
    assert m.prepare_store(keys(1)) is None
    out = m.prepare_store([])
    assert out.keys_to_store == [] and out.store_spec.block_ids.tolist() == []


@pytest.mark.parametrize("bad", [-1, 1.5, "8", True])
def test_bad_capacity(bad):
    with pytest.raises(ValueError, match="num_blocks"):
        CPUOffloadingManager(bad)


def test_unknown_policy_is_named():
    with pytest.raises(ValueError, match="'nope'"):
        CPUOffloadingManager(4, "nope")


class _OddOnly(LRUPolicy):
    """Admits only keys whose block id is odd."""

    admits_all = False

    def admit(self, key):
        return key[7] % 2 == 1


def test_declined_keys_are_left_out_of_the_store():
    m = CPUOffloadingManager(4, _OddOnly, enable_events=True)
    out = m.prepare_store(keys(1, 2, 3, 4))
    assert out.keys_to_store == keys(1, 3)
    assert out.store_spec.block_ids.tolist() == [0, 1]
    m.complete_store(out.keys_to_store)
    assert m.lookup(k(2)) is LookupResult.MISS and m.lookup(k(3)) is LookupResult.HIT


def test_batch_paths_keep_the_per_key_answers():
    # lookup_prefix, loads and stores take whole batches at once where they can; the
    # batches that cannot (a pending key, a miss after a pending one, duplicates, a
    # store named twice) get the per-key answers
    m = CPUOffloadingManager(8, enable_events=True)
    store(m, 1, 2, 3)
    m.prepare_store(keys(4))
    assert m.lookup_prefix(keys(1, 2, 4, 9)) == 2  # a pending key ends it: no miss counted
    assert m.lookup_prefix(iter(keys(1, 2, 3))) == 3  # any iterable
    assert m.lookup_prefix([]) == 0
    assert (m.stats().hits, m.stats().misses) == (5, 0)
    m.take_events()
    m.complete_store(keys(4, 4))  # named twice: announced once
    assert m.take_events() == [OffloadingEvent(keys(4), "CPU", False)]
    assert m.stats().in_flight == 0
    assert m.prepare_load(keys(1, 2)).block_ids.tolist() == [0, 1]
    assert m.stats().pinned == 2
    with pytest.raises(KeyError, match="no load was prepared"):
        m.complete_load(keys(1, 3))  # 3 is not pinned: 1 stays pinned
    assert m.stats().pinned == 2
    m.complete_load(keys(2, 1))
    assert m.stats().pinned == 0
    out = m.prepare_store(keys(5, 6))
    m.complete_store(out.keys_to_store + keys(5), success=False)  # 5 twice: freed once
    assert m.stats().used == 4 and m.stats().in_flight == 0
    # never-used slots, then the freed ones (4, 5 once each, then 0 of key 1, evicted) last first
    assert m.prepare_store(keys(5, 6, 7, 8, 9)).store_spec.block_ids.tolist() == [6, 7, 0, 5, 4]
