"""The tiered manager's bookkeeping: write-through, promotion, failures, events. The
secondary here is a CPU-tier manager under another medium name (the bookkeeping is the
same; bytes are moved by the worker, tested elsewhere)."""

from __future__ import annotations

import pytest

from kvoffload.cpu import CPUOffloadingManager
from kvoffload.keys import make_offload_key
from kvoffload.manager import LookupResult, OffloadingEvent
from kvoffload.tiers.tiered import DECLINE_STEPS, TieredOffloadingManager
from shelf_tier import Shelf

HIT, MISS, PENDING = LookupResult.HIT, LookupResult.MISS, LookupResult.PENDING


def keys(*ids):
    return [make_offload_key(bytes([i]) * 32, 0) for i in ids]


def make(cpu=4, shelf=8, admit=None):
    primary = CPUOffloadingManager(cpu, "lru", enable_events=True)
    secondary = Shelf(shelf, "lru", enable_events=True)
    return primary, secondary, TieredOffloadingManager(primary, [secondary], admit)


def store(tiered, ks):
    out = tiered.prepare_store(ks)
    tiered.complete_store(out.keys_to_store)
    return out


def finish(tiered, transfers, success=True):
    for t in transfers:
        tiered.complete_transfer(t.token, success)


def test_completed_stores_are_written_through_with_the_primary_blocks_pinned():
    primary, secondary, tiered = make()
    out = store(tiered, keys(1, 2))
    (write,) = tiered.take_transfers()
    assert write.src_spec.medium == "CPU" and write.dst_spec.medium == "SHELF"
    assert write.src_spec.block_ids.tolist() == out.store_spec.block_ids.tolist()
    assert [primary.state(k) for k in keys(1, 2)] == [1, 1]  # pinned while read
    assert [secondary.lookup(k) for k in keys(1, 2)] == [PENDING] * 2
    assert tiered.take_transfers() == []  # handed out once
    finish(tiered, [write])
    assert [primary.state(k) for k in keys(1, 2)] == [0, 0]
    assert [secondary.lookup(k) for k in keys(1, 2)] == [HIT] * 2
    assert tiered.take_events() == [
        OffloadingEvent(keys(1, 2), "CPU", False),
        OffloadingEvent(keys(1, 2), "SHELF", False),
    ]


def test_a_failed_write_frees_the_secondary_and_unpins_the_primary():
    primary, secondary, tiered = make()
    store(tiered, keys(1))
    finish(tiered, tiered.take_transfers(), success=False)
    assert primary.state(keys(1)[0]) == 0
    assert secondary.lookup(keys(1)[0]) is MISS
    assert secondary.stats().used == 0


def test_a_key_evicted_from_the_primary_is_promoted_back_then_hits():
    primary, secondary, tiered = make(cpu=2)
    store(tiered, keys(1, 2))
    finish(tiered, tiered.take_transfers())
    store(tiered, keys(3, 4))  # evicts 1 and 2 from the primary
    finish(tiered, tiered.take_transfers())
    assert [primary.state(k) for k in keys(1, 2)] == [None, None]
    assert [tiered.lookup(k) for k in keys(1, 2)] == [PENDING, PENDING]
    assert tiered.lookup(keys(1)[0]) is PENDING  # asked again: still one promotion
    tiered.take_events()
    (promotion,) = tiered.take_transfers()
    assert promotion.src_spec.medium == "SHELF" and promotion.dst_spec.medium == "CPU"
    assert [secondary.state(k) for k in keys(1, 2)] == [1, 1]  # pinned while read
    assert [tiered.lookup(k) for k in keys(1, 2)] == [PENDING, PENDING]  # being written
    finish(tiered, [promotion])
    assert [tiered.lookup(k) for k in keys(1, 2)] == [HIT, HIT]
    assert [secondary.state(k) for k in keys(1, 2)] == [0, 0]
    events = tiered.take_events()
    # room made for the promotion (in the order the policy evicts)
    assert [set(e.keys) for e in events if e.removed] == [set(keys(3, 4))]
    assert OffloadingEvent(keys(1, 2), "CPU", False) in events


def test_a_key_gone_from_the_secondary_before_its_load_is_prepared_promotes_nothing():
    """A shared tier applies its server's evictions inside its own calls: between the
    promotion's check of a key and ``prepare_load`` the key may have gone. Nothing is
    promoted then, nothing stays reserved or pinned, and the next step tries again."""
    primary, secondary, tiered = make(cpu=2)
    store(tiered, keys(1, 2))
    finish(tiered, tiered.take_transfers())
    store(tiered, keys(3, 4))  # evicts 1 and 2 from the primary
    finish(tiered, tiered.take_transfers())
    assert [tiered.lookup(k) for k in keys(1, 2)] == [PENDING, PENDING]
    tiered.take_events()
    real_lookup = secondary.lookup

    def lookup_then_lose_key_2(key):
        result = real_lookup(key)
        if key == keys(2)[0]:  # as if a notification arrived during this call
            secondary.discard(keys(2))
        return result

    secondary.lookup = lookup_then_lose_key_2
    assert tiered.take_transfers() == []
    # The room made for the promotion is free again (its evictions stand: 3 and 4 are
    # still below), and nothing is left being written or pinned.
    assert [primary.state(k) for k in keys(1, 2)] == [None, None]
    assert primary.stats().in_flight == 0
    assert secondary.state(keys(1)[0]) == 0  # not pinned
    secondary.lookup = real_lookup
    assert [tiered.lookup(k) for k in keys(1, 2)] == [PENDING, MISS]
    (promotion,) = tiered.take_transfers()  # the next step promotes what is left
    finish(tiered, [promotion])
    assert tiered.lookup(keys(1)[0]) is HIT


def test_a_failed_promotion_drops_the_block_from_the_secondary():
    primary, secondary, tiered = make(cpu=1)
    store(tiered, keys(1))
    finish(tiered, tiered.take_transfers())
    store(tiered, keys(2))
    finish(tiered, tiered.take_transfers())
    assert tiered.lookup(keys(1)[0]) is PENDING
    finish(tiered, tiered.take_transfers(), success=False)  # e.g. a checksum mismatch
    assert tiered.lookup(keys(1)[0]) is MISS
    assert primary.state(keys(1)[0]) is None and secondary.state(keys(1)[0]) is None
    assert OffloadingEvent(keys(1), "SHELF", True) in tiered.take_events()


def test_no_promotion_when_the_primary_cannot_make_room():
    primary, secondary, tiered = make(cpu=1)
    store(tiered, keys(1))
    finish(tiered, tiered.take_transfers())
    store(tiered, keys(2))
    finish(tiered, tiered.take_transfers())
    primary.prepare_load(keys(2))  # the only primary block is pinned by a load
    assert tiered.lookup(keys(1)[0]) is PENDING
    assert tiered.take_transfers() == []
    assert secondary.state(keys(1)[0]) == 0  # nothing pinned below
    # declined: a miss for a while, so the request goes on without it instead of waiting
    for _ in range(DECLINE_STEPS - 1):
        assert tiered.lookup(keys(1)[0]) is MISS
        assert tiered.take_transfers() == []
    assert tiered.lookup(keys(1)[0]) is MISS
    tiered.take_transfers()
    assert tiered.lookup(keys(1)[0]) is PENDING  # then asked again


def test_a_prefix_longer_than_the_primary_is_promoted_as_far_as_it_fits():
    primary, secondary, tiered = make(cpu=2)
    for k in range(1, 5):
        store(tiered, keys(k))
        finish(tiered, tiered.take_transfers())
    store(tiered, keys(9, 10))  # the primary now holds only 9 and 10
    finish(tiered, tiered.take_transfers())
    assert [tiered.lookup(k) for k in keys(1, 2, 3, 4)] == [PENDING] * 4
    (promotion,) = tiered.take_transfers()
    assert len(promotion.dst_spec.block_ids) == 2  # the leading two fit
    assert [tiered.lookup(k) for k in keys(1, 2, 3, 4)] == [PENDING, PENDING, MISS, MISS]
    finish(tiered, [promotion])
    # the request finds its leading two and computes the rest; asking for 3 and 4 does
    # not promote them over the two it is about to load
    assert [tiered.lookup(k) for k in keys(1, 2, 3, 4)] == [HIT, HIT, MISS, MISS]
    assert tiered.take_transfers() == []
    assert [primary.state(k) for k in keys(1, 2)] == [0, 0]


def test_admission_rule_and_a_full_secondary_decline_without_error():
    primary, secondary, tiered = make(shelf=1, admit=[lambda key: key != keys(2)[0]])
    store(tiered, keys(1, 2))
    (write,) = tiered.take_transfers()
    assert write.dst_spec.block_ids.tolist() == [0] and secondary.state(keys(2)[0]) is None
    store(tiered, keys(3))  # the secondary's only block is being written: declined
    assert tiered.take_transfers() == []
    assert primary.state(keys(3)[0]) == 0  # not pinned for a write that never happens


def test_reset_drops_every_tier_and_forgets_transfers():
    primary, secondary, tiered = make()
    store(tiered, keys(1))
    (write,) = tiered.take_transfers()
    tiered.reset()
    assert primary.stats().used == 0 and secondary.stats().used == 0
    with pytest.raises(KeyError, match=f"unknown tier transfer {write.token}"):
        tiered.complete_transfer(write.token, True)


def test_tiers_need_distinct_media():
    primary = CPUOffloadingManager(2)
    with pytest.raises(ValueError, match=r"own medium, got \['CPU', 'CPU'\]"):
        TieredOffloadingManager(primary, [CPUOffloadingManager(2)])


# -- loads chained on promotions (kvoffload.tiers.chained) ---------------------------------


def below(cpu, n, shelf=64):
    """A tiered manager whose keys 1..n are in the secondary only."""
    primary, secondary, tiered = make(cpu=cpu, shelf=shelf)
    for k in range(1, n + 1):
        store(tiered, keys(k))
        finish(tiered, tiered.take_transfers())
    filler = list(range(100, 100 + cpu))
    store(tiered, keys(*filler))  # evicts them from the primary
    finish(tiered, tiered.take_transfers())
    assert all(primary.state(k) is None for k in keys(*range(1, n + 1)))
    return primary, secondary, tiered


def test_promote_now_plans_the_asked_promotions_for_this_step_and_a_load_reads_their_slots():
    primary, secondary, tiered = below(cpu=4, n=2)
    ks = keys(1, 2)
    assert [tiered.lookup(k) for k in ks] == [PENDING, PENDING]
    tiered.promote_now(ks)
    assert [primary.state(k) for k in ks] == [-1, -1]  # slots reserved now, being written
    assert tiered.chain_prefix(ks) == (2, False)
    spec, waiting = tiered.prepare_chained_load(ks)
    (promotion,) = tiered.take_transfers()  # handed out by this step's take_transfers
    assert spec.block_ids.tolist() == promotion.dst_spec.block_ids.tolist()
    assert waiting == {promotion.token: ks}
    assert tiered.load_source(ks[0]) == "SHELF"
    finish(tiered, [promotion])
    assert [primary.state(k) for k in ks] == [0, 0]  # loadable; the caller pins for its load
    assert tiered.load_source(ks[1]) == "SHELF" and tiered.load_source(ks[0]) == "CPU"


def test_chain_prefix_stops_at_a_declined_key_and_waits_for_a_store_in_flight():
    primary, secondary, tiered = below(cpu=2, n=4)
    ks = keys(1, 2, 3, 4)
    assert [tiered.lookup(k) for k in ks] == [PENDING] * 4
    tiered.promote_now(ks)  # room for two
    assert tiered.chain_prefix(ks) == (2, False)  # 3 is declined: a miss, load the two
    primary, secondary, tiered = make()
    pending = keys(50)
    assert primary.prepare_store(pending) is not None  # a store into the primary in flight
    assert tiered.chain_prefix(pending) == (0, True)


def test_a_chained_load_pins_what_is_loadable_and_a_failed_promotion_pins_nothing():
    primary, secondary, tiered = below(cpu=4, n=2)
    store(tiered, keys(7))
    finish(tiered, tiered.take_transfers())
    ks = keys(7, 1, 2)
    assert [tiered.lookup(k) for k in ks] == [HIT, PENDING, PENDING]
    tiered.promote_now(ks)
    spec, waiting = tiered.prepare_chained_load(ks)
    assert [primary.state(k) for k in ks] == [1, -1, -1]
    (promotion,) = tiered.take_transfers()
    finish(tiered, [promotion], success=False)
    assert [primary.state(k) for k in ks] == [1, None, None]  # freed, never loadable
    assert [secondary.state(k) for k in keys(1, 2)] == [None, None]  # dropped below
    assert primary.stats().in_flight == 0
