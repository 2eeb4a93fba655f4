"""``prefetch_pending()`` of the tiered manager: true from a prefetch's queueing until its
last transfer completed (or failed, or was dropped), so an engine that steps only for
requests (vLLM: ``has_pending_push_work``) keeps stepping until a prefetch is done."""

from __future__ import annotations

from kvoffload.cpu import CPUOffloadingManager
from kvoffload.keys import make_offload_key
from kvoffload.tiers.tiered import TieredOffloadingManager
from shelf_tier import Shelf


def keys(*ids):
    return [make_offload_key(i.to_bytes(32, "big"), 0) for i in ids]


def store(tiered, ks):
    out = tiered.prepare_store(ks)
    tiered.complete_store(out.keys_to_store)
    for transfer in tiered.take_transfers():
        tiered.complete_transfer(transfer.token, True)


def make(**kw):
    tiered = TieredOffloadingManager(CPUOffloadingManager(4, "lru"), [Shelf(64, "lru")], **kw)
    for i in range(1, 6):  # 1..5 on the shelf; 2..5 in CPU, 1 pushed out of it
        store(tiered, keys(i))
    store(tiered, keys(*range(100, 104)))  # now 1..5 are only on the shelf
    return tiered


def test_pending_from_queueing_until_the_last_transfer_completes():
    tiered = make(prefetch_in_flight=1, prefetch_batch=2)
    assert not tiered.prefetch_pending()
    assert tiered.prefetch(keys(1, 2, 3)) == 3
    assert tiered.prefetch_pending()  # queued, nothing issued yet
    (first,) = tiered.take_transfers()
    assert tiered.take_transfers() == []  # one in flight at most
    assert tiered.prefetch_pending()
    tiered.complete_transfer(first.token, True)
    assert tiered.prefetch_pending()  # one key still queued
    (second,) = tiered.take_transfers()
    assert tiered.prefetch_pending()
    tiered.complete_transfer(second.token, False)  # a failed one ends too
    assert not tiered.prefetch_pending()


def test_nothing_to_prefetch_is_nothing_pending():
    tiered = make()
    assert tiered.prefetch(keys(100, 999)) == 0  # in CPU already / held nowhere
    assert not tiered.prefetch_pending()
