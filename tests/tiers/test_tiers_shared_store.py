"""What the shared-store tier types (``redis``, ``mooncake``) build alike
(``kvoffload.tiers.shared_store_tier``): a byte budget that holds no block, counting every
rank's share, fails the manager's build naming it; a worker whose host pool disagrees with
the sizing is refused naming both sizes (neither needs a server: both fail before any
call). And the shared manager's event contract (``kvoffload.tiers.shared_store_manager``),
against a real redis-server: blocks adopted from another replica are announced neither
stored nor removed, and a budget eviction deletes only this engine's own."""

from __future__ import annotations

import pytest

from free_ports import free_port
from kvoffload.manager import LookupResult
from kvoffload.tiers.redis.format import value_bytes
from kvoffload.tiers.secondary import TierContext, parse_secondary_tiers
from redis_replica import IDENTITY, Replica, k
from redis_server import redis_server  # noqa: F401 - fixture
from transfer_oracle import make_pool


def entry(kind: str, **options) -> dict:
    port = free_port()  # nothing listens there: the Redis tier logs it unreachable and goes on
    where = {"url": f"redis://127.0.0.1:{port}/0"} if kind == "redis" else {"master": f"127.0.0.1:{port}"}
    return {"type": kind, **where, **options}


@pytest.mark.parametrize("kind", ["redis", "mooncake"])
def test_a_budget_that_holds_no_block_over_every_rank_fails_the_build_naming_it(kind):
    block_bytes, world_size = 4096, 2
    per_block = value_bytes(block_bytes) * world_size  # every rank's share counts
    budget = per_block - 1  # one rank's share would fit; all of them do not
    (tier,) = parse_secondary_tiers([entry(kind, bytes_to_use=budget)])
    context = TierContext(block_bytes, IDENTITY, world_size=world_size)
    with pytest.raises(ValueError, match=rf"bytes_to_use={budget} holds no block \({per_block} bytes each\)"):
        tier.build_manager(context, "lru")


@pytest.mark.parametrize("kind", ["redis", "mooncake"])
def test_a_worker_whose_host_pool_disagrees_with_the_sizing_is_refused(kind):
    pytest.importorskip("mooncake" if kind == "mooncake" else "redis")
    pool = make_pool()
    pool_bytes = sum(int(t.shape[1]) for t in pool.tensors)
    (tier,) = parse_secondary_tiers([entry(kind)])
    context = TierContext(pool_bytes + 8, IDENTITY)
    message = rf"host pool holds {pool_bytes} bytes per block but the tier was sized for {pool_bytes + 8}"
    with pytest.raises(ValueError, match=message):
        tier.build_worker(context, pool)


def test_adopted_blocks_are_announced_neither_stored_nor_removed(redis_server):  # noqa: F811
    a = Replica(redis_server.url, seed=0)
    b = Replica(redis_server.url, seed=1, bytes_to_use=4 * value_bytes(a.block_bytes))
    try:
        theirs = [k(i) for i in range(2)]
        assert a.store(theirs, [0, 1]).success
        assert [b.settle(key) for key in theirs] == [LookupResult.HIT] * 2  # adopted from a
        assert b.manager.take_events() == []

        ours = [k(i) for i in range(10, 14)]
        assert b.store(ours, [0, 1, 2, 3]).success  # evicts both adopted blocks from b's index
        assert [(e.removed, list(e.keys)) for e in b.manager.take_events()] == [(False, ours)]
        more = [k(20), k(21)]
        assert b.store(more, [4, 5]).success  # evicts two of its own
        events = [(e.removed, sorted(e.keys)) for e in b.manager.take_events()]
        assert events == [(True, sorted(ours[:2])), (False, sorted(more))]

        client = redis_server.client()
        assert all(client.exists(a.names.name(key)) for key in theirs)  # b deletes only its own
        assert b.manager.counters().deleted == 2
    finally:
        b.close()
        a.close()


class _ScriptedLookups:
    """The lookups' interface with answers the test posts and no store behind it: a
    reconciliation asked for is recorded and never answered."""

    down, outages = False, 0

    def __init__(self) -> None:
        self.posted: list = []
        self.reconciles = 0

    def has_answers(self) -> bool:
        return bool(self.posted)

    def answers(self) -> list:
        out, self.posted = self.posted, []
        return out

    def reconcile(self, keys) -> None:
        self.reconciles += 1

    def probe(self, key) -> None:
        pass

    def delete(self, keys) -> None:
        pass

    def close(self) -> None:
        pass


def test_a_store_back_from_an_outage_that_emptied_it_leaves_nothing_indexed_at_once() -> None:
    """``lost`` (a Mooncake master restarted: it holds nothing) drops every idle indexed
    block in the same call, announced removed, without waiting for a reconciliation's
    answer; ``resync`` only asks for one."""
    from kvoffload.manager import LookupResult
    from kvoffload.tiers.mooncake.manager import MooncakeOffloadingManager
    from kvoffload.tiers.shared_store_lookups import Answer

    # after "lost" a key is unknown again: probed (RETRY) until the store answers
    for kind, after in (("resync", LookupResult.HIT), ("lost", LookupResult.RETRY)):
        lookups = _ScriptedLookups()
        manager = MooncakeOffloadingManager(lookups, 8, enable_events=True)
        keys = [bytes([i]) * 8 for i in range(3)]
        out = manager.prepare_store(keys)
        manager.complete_store(out.keys_to_store)
        manager.take_events()
        asked = lookups.reconciles
        lookups.posted.append(Answer(kind, ()))
        assert [manager.lookup(key) for key in keys] == [after] * 3, kind
        assert lookups.reconciles == asked + 1  # a check of what is left is asked for either way
        removed = [key for e in manager.take_events() if e.removed for key in e.keys]
        assert sorted(removed) == (sorted(keys) if kind == "lost" else []), kind
        assert manager.counters().gone == (3 if kind == "lost" else 0)
