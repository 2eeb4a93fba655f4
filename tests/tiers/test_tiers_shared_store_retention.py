"""Session retention in the shared-store tiers (Redis, Mooncake, S3 share
``SharedStoreManager``): the budget evictions of the local index, and so the deletions of
``delete_on_evict``, pass over retained blocks; a retained block the store dropped leaves
the retention. One test against a real redis-server."""

from __future__ import annotations

from kvoffload.manager import LookupResult
from kvoffload.sessions import SessionId
from kvoffload.tiers.mooncake.manager import MooncakeOffloadingManager
from kvoffload.tiers.redis.format import value_bytes
from kvoffload.tiers.shared_store_lookups import Answer
from manual_clock import ManualClock
from redis_replica import Replica, k
from redis_server import redis_server  # noqa: F401 - fixture

A = SessionId("t", "chat")


class _Lookups:
    """The lookups' interface with no store behind it; records deletions."""

    down, outages = False, 0

    def __init__(self) -> None:
        self.posted: list = []
        self.deleted: list = []

    def has_answers(self) -> bool:
        return bool(self.posted)

    def answers(self) -> list:
        out, self.posted = self.posted, []
        return out

    def reconcile(self, keys) -> None:
        pass

    def probe(self, key) -> None:
        pass

    def delete(self, keys) -> None:
        self.deleted += keys

    def close(self) -> None:
        pass


def store(manager, ks):
    out = manager.prepare_store(ks)
    manager.complete_store(out.keys_to_store)


def test_budget_deletions_pass_over_retained_blocks_until_expiry():
    lookups, clock = _Lookups(), ManualClock(0.0)
    manager = MooncakeOffloadingManager(
        lookups, 4, delete_on_evict=True, clock=clock, retention_fraction=0.5, reconcile_interval=1e9
    )
    ks = [bytes([i]) * 8 for i in range(12)]
    store(manager, ks[:4])
    assert manager.retain(A, ks[:2], clock.now + 10).retained == 2
    for key in ks[4:8]:
        store(manager, [key])
    assert not set(ks[:2]) & set(lookups.deleted)
    assert [manager.lookup(key) for key in ks[:2]] == [LookupResult.HIT] * 2
    assert [b.medium for b in manager.retained(A)] == [manager.medium] * 2
    clock.now += 10
    for key in ks[8:12]:
        store(manager, [key])
    assert set(ks[:2]) <= set(lookups.deleted)


def test_a_retained_block_the_store_dropped_leaves_the_retention():
    lookups, clock = _Lookups(), ManualClock(0.0)
    manager = MooncakeOffloadingManager(lookups, 4, clock=clock, retention_fraction=1, reconcile_interval=1e9)
    ks = [bytes([i]) * 8 for i in range(3)]
    store(manager, ks)
    manager.retain(A, ks, clock.now + 10)
    lookups.posted.append(Answer("gone", (ks[0],)))
    assert [b.key for b in manager.retained(A)] == ks  # not heard yet
    manager.lookup(ks[1])  # the scheduler's next call hears it
    assert [b.key for b in manager.retained(A)] == ks[1:]
    assert manager.release(A) == 2


def test_redis_budget_eviction_keeps_a_retained_block_on_the_server(redis_server):  # noqa: F811
    probe = Replica(redis_server.url)
    per_block = value_bytes(probe.block_bytes)
    probe.close()
    replica = Replica(redis_server.url, bytes_to_use=4 * per_block)
    try:
        first = [k(i) for i in range(4)]
        assert replica.store(first, [0, 1, 2, 3]).success
        assert replica.manager.retain(A, first[:1], 1e12).retained == 1  # budget: one block
        assert replica.store([k(i) for i in range(10, 13)], [4, 5, 6]).success  # the other three go
        client = redis_server.client()
        assert client.exists(replica.names.name(first[0]))  # retained: not deleted
        assert not any(client.exists(replica.names.name(key)) for key in first[1:])
        assert replica.manager.lookup(first[0]) is LookupResult.HIT
    finally:
        replica.close()
