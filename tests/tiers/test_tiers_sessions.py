"""Session controls of the tiered manager: retention in every tier, and prefetch below
every request's own promotions. The secondary is the CPU bookkeeping under another
medium (``shelf_tier.Shelf``); transfers are completed by the test as the worker would."""

from __future__ import annotations

import random

import pytest

from kvoffload.cpu import CPUOffloadingManager
from kvoffload.keys import make_offload_key
from kvoffload.manager import LookupResult
from kvoffload.sessions import RetainOutcome, SessionId
from kvoffload.tiers.tiered import TieredOffloadingManager
from manual_clock import ManualClock
from shelf_tier import Shelf

HIT, MISS, PENDING = LookupResult.HIT, LookupResult.MISS, LookupResult.PENDING
A = SessionId("tenant-a", "s")
B = SessionId("tenant-b", "s")


def keys(*ids):
    return [make_offload_key(i.to_bytes(32, "big"), 0) for i in ids]


def make(cpu=4, shelf=64, fraction=0.5, **kw):
    clock = ManualClock(10.0)
    primary = CPUOffloadingManager(cpu, "lru", retention_fraction=fraction, clock=clock)
    secondary = Shelf(shelf, "lru", retention_fraction=fraction, clock=clock)
    return clock, primary, secondary, TieredOffloadingManager(primary, [secondary], **kw)


def store(tiered, ks):
    """Store ``ks`` in the primary and complete the write-through to the shelf."""
    out = tiered.prepare_store(ks)
    tiered.complete_store(out.keys_to_store)
    for transfer in tiered.take_transfers():
        tiered.complete_transfer(transfer.token, True)


def below(tiered, ids, cpu=4):
    """``ids`` held by the shelf only: stored, then pushed out of the primary."""
    for i in ids:
        store(tiered, keys(i))
    store(tiered, keys(*range(1000, 1000 + cpu)))


def test_retain_reaches_every_tier_and_release_ends_it_everywhere():
    clock, primary, secondary, tiered = make(cpu=8, shelf=8)
    store(tiered, keys(1, 2))
    outcome = tiered.retain(A, keys(1, 2, 3), clock.now + 5)
    assert outcome == RetainOutcome(retained=4, absent=2)  # two tiers: summed
    assert sorted((b.medium, b.key) for b in tiered.retained(A)) == sorted(
        [("CPU", k) for k in keys(1, 2)] + [("SHELF", k) for k in keys(1, 2)]
    )
    assert tiered.retained(B) == [] and tiered.release(B) == 0  # another tenant's "s"
    assert tiered.release(A) == 4
    assert tiered.retained(A) == []


def test_secondary_keeps_retained_blocks_under_pressure_until_expiry():
    clock, primary, secondary, tiered = make(cpu=4, shelf=8)
    store(tiered, keys(1, 2))
    tiered.retain(A, keys(1, 2), clock.now + 5)
    for i in range(100, 130):
        store(tiered, keys(i))
    assert [secondary.state(k) for k in keys(1, 2)] == [0, 0]
    assert [primary.state(k) for k in keys(1, 2)] == [0, 0]
    clock.now += 5
    for i in range(200, 230):
        store(tiered, keys(i))
    assert [secondary.state(k) for k in keys(1, 2)] == [None, None]


def test_prefetch_promotes_what_only_a_lower_tier_holds():
    clock, primary, secondary, tiered = make()
    below(tiered, [1, 2])
    assert [primary.state(k) for k in keys(1, 2)] == [None, None]
    assert tiered.prefetch(keys(1, 2, 1000, 999)) == 2  # 1000 is in CPU, 999 nowhere
    assert tiered.prefetch(keys(1)) == 0  # queued already
    (transfer,) = tiered.take_transfers()
    assert transfer.src_spec.medium == "SHELF" and transfer.dst_spec.medium == "CPU"
    assert [tiered.lookup(k) for k in keys(1, 2)] == [PENDING, PENDING]  # being promoted
    tiered.complete_transfer(transfer.token, True)
    assert [tiered.lookup(k) for k in keys(1, 2)] == [HIT, HIT]
    assert tiered.load_source(keys(1)[0]) == "SHELF"
    assert tiered.prefetched == 2


def test_a_prefetch_that_finds_no_room_is_dropped_not_declined():
    clock, primary, secondary, tiered = make()
    below(tiered, [1])
    tiered.prefetch(keys(1))
    pins = keys(*range(1000, 1004))
    primary.prepare_load(pins)  # the primary is full of pinned blocks
    assert tiered.take_transfers() == []
    primary.complete_load(pins)
    assert tiered.take_transfers() == []  # dropped, not queued again
    assert tiered.lookup(keys(1)[0]) is PENDING  # a request's lookup still asks for it
    assert len(tiered.take_transfers()) == 1


@pytest.mark.parametrize("in_flight", [1, 3])
def test_a_flood_of_prefetches_never_delays_a_request_promotion(in_flight):
    """Thousands of prefetch keys queued; requests arrive at random steps. Each request's
    promotion is issued in the step its lookup asked for it, no prefetch is issued in
    that step, and at most ``in_flight`` prefetch transfers are ever in flight (all that
    can be ahead of a request's promotion at the worker). With no request, the flood
    drains."""
    rng = random.Random(5)
    _, _, _, tiered = make(cpu=64, shelf=4096, prefetch_in_flight=in_flight, prefetch_batch=8)
    flood = list(range(1, 2001))
    for i in flood:
        store(tiered, keys(i))  # write-through to the shelf; the primary keeps the last 64
    requests = list(range(3000, 3100))
    for i in requests:
        store(tiered, keys(i))
    store(tiered, keys(*range(5000, 5064)))  # nothing of the flood or the requests left in CPU
    assert tiered.prefetch(keys(*flood)) == len(flood)
    pending: list = []  # prefetch transfers in flight (the worker is slow: 2 steps each)
    delays = []
    for step in range(400):
        asked = None
        if requests and rng.random() < 0.3:
            asked = keys(requests.pop())[0]
            assert tiered.lookup(asked) is PENDING
        transfers = tiered.take_transfers()
        prefetches = transfers
        if asked is not None:
            (promotion,) = transfers  # its own, and no prefetch this step
            delays.append(len(pending))  # prefetch transfers ahead of it
            tiered.complete_transfer(promotion.token, True)
            assert tiered.lookup(asked) is HIT
            prefetches = []
        pending += [(step, t) for t in prefetches]
        assert len(pending) <= in_flight
        for issued, t in list(pending):
            if step - issued >= 2:
                tiered.complete_transfer(t.token, True)
                pending.remove((issued, t))
    assert delays and max(delays) <= in_flight
    for _, t in pending:
        tiered.complete_transfer(t.token, True)
    for _ in range(2000):  # no more requests: the flood drains
        for t in tiered.take_transfers():
            tiered.complete_transfer(t.token, True)
    assert tiered.prefetched >= len(flood) - 64
