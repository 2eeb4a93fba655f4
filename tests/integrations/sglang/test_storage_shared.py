"""kvoffload's SGLang backend on the shared tiers (a real redis-server, a real Mooncake
store) and what it tells the outside: two engines sharing one Redis server, the server
killed (misses, no exception, nothing hangs) and back, KV events over ZMQ with replay that
``kvoffload index`` scores, Prometheus metrics per tier."""

from __future__ import annotations

import time
import urllib.request

import pytest
import torch
from sglang_pools import backend, host_indices, mha_pool, page_bytes, page_keys

from kvoffload.events.subscriber import EventSubscriber
from kvoffload.events.types import BlockRemoved, BlockStored
from kvoffload.index import BlockIndex
from kvoffload.integrations.sglang.pages import PageViews
from redis_server import RedisServer


def redis(server: RedisServer, **extra) -> dict:
    return {"interface_v1": 1, "secondary_tiers": [{"type": "redis", "url": server.url}], **extra}


@pytest.fixture
def server(tmp_path):
    server = RedisServer(tmp_path).start()
    yield server
    server.stop()


def test_two_engines_share_pages_through_one_redis_server(server) -> None:
    source, target = mha_pool("page_first", seed=1), mha_pool("page_first", seed=2)
    first, second = backend(source, redis(server)), backend(target, redis(server))
    keys = page_keys(8)
    assert first.batch_set_v1(keys, host_indices(range(8))) == [True] * 8
    assert second.batch_exists(keys) == 8  # asked the server (background lookups)
    assert second.batch_get_v1(keys, host_indices(range(10, 18))) == [True] * 8
    for i in range(8):
        assert torch.equal(page_bytes(target, 10 + i), page_bytes(source, i))
    assert first.batch_set_v1(keys, host_indices(range(8))) == [True] * 8  # already there: nothing sent
    assert first.tiers.counters().present_pages == 8
    first.close()
    second.close()


def test_a_killed_server_costs_misses_never_an_exception_and_its_return_is_noticed(server) -> None:
    pool = mha_pool("page_first_direct", seed=1)
    storage = backend(pool, redis(server, exists_wait_s=1.0))
    keys = page_keys(6)
    assert storage.batch_set_v1(keys[:3], host_indices(range(3))) == [True] * 3
    server.kill()
    # every call answers (a miss, a failed store), none raises
    assert storage.batch_get_v1(keys[:3], host_indices(range(10, 13))) == [False] * 3
    assert storage.batch_exists(keys) == 0
    assert storage.batch_set_v1(keys[3:], host_indices(range(3, 6))) == [False] * 3
    assert storage.errors == 0
    server.start()
    deadline = time.monotonic() + 20
    while storage.batch_set_v1(keys[3:], host_indices(range(3, 6))) != [True] * 3:
        assert time.monotonic() < deadline, "the backend never noticed the server's return"
        time.sleep(0.2)
    assert storage.batch_exists(keys[3:]) == 3
    assert storage.batch_get_v1(keys[3:], host_indices(range(20, 23))) == [True] * 3
    assert torch.equal(page_bytes(pool, 21), page_bytes(pool, 4))
    storage.close()


def test_pages_are_announced_with_sglangs_hashes_and_the_index_scores_the_replica(tmp_path) -> None:
    pool = mha_pool("page_first")
    page = PageViews(pool).block_bytes
    endpoint = f"ipc://{tmp_path}/events"
    extra = {
        "interface_v1": 1,
        "secondary_tiers": [
            {"type": "fs", "root_dir": str(tmp_path / "kv"), "bytes_to_use": 6 * (page + 4096)}
        ],
        "kv_events_endpoint": endpoint,
        "kv_events_replay_endpoint": f"ipc://{tmp_path}/replay",
    }
    storage = backend(pool, extra)
    keys = page_keys(4)
    prefix = page_keys(1, salt="before")
    with EventSubscriber(endpoint, f"ipc://{tmp_path}/replay") as sub:
        time.sleep(0.2)  # (a batch sent before the subscription is live is replayed at the next one)
        storage.batch_set_v1(keys, host_indices(range(4)), _ExtraInfo(prefix))
        (_, batch) = sub.receive(timeout=10)
        (stored,) = batch.events
        assert isinstance(stored, BlockStored)
        assert stored.block_hashes == [int(key[:16], 16) for key in keys]
        assert stored.parent_block_hash == int(prefix[0][:16], 16)
        assert (stored.medium, stored.locality, stored.ownership) == ("STORAGE", "LOCAL", None)
        assert stored.block_size == 4 and stored.token_ids == []

        index = BlockIndex()
        engine = index.add_engine("tiny", "default", "sglang-0", 0, 4)
        index.apply(engine, batch.events)
        hashes = [int(key[:16], 16) for key in keys]
        (match,) = index.query_hashes("tiny", "default", hashes).matches
        assert match.levels == (0, 0, 4, 4)  # device, host, disk, shared (cumulative pages)

        # a full tier: 2 more pages than it holds evict the 2 least recently used
        capacity = storage.tiers.tier_stats()[0].capacity
        more = page_keys(capacity - 4 + 2, salt="more")
        storage.batch_set_v1(more, host_indices(range(4, 4 + len(more))))
        events = []
        while len([e for e in events if isinstance(e, BlockStored)]) < 1:
            got = sub.receive(timeout=10)
            assert got is not None
            events += got[1].events
        removed = [e for e in events if isinstance(e, BlockRemoved)]
        assert sum(len(e.block_hashes) for e in removed) == 2
        index.apply(engine, events)
        (match,) = index.query_hashes("tiny", "default", hashes).matches
        assert match.levels == (0, 0, 0, 0)  # its first pages are gone
    storage.close()


class _ExtraInfo:
    """SGLang's ``HiCacheStorageExtraInfo``: the page keys before a call's keys."""

    def __init__(self, prefix_keys):
        self.prefix_keys = prefix_keys
        self.extra_info = None


def test_metrics_per_tier_are_served(tmp_path, server) -> None:
    pool = mha_pool("page_first")
    extra = {
        "interface_v1": 1,
        "secondary_tiers": [
            {"type": "fs", "root_dir": str(tmp_path), "bytes_to_use": 16 << 20},
            {"type": "redis", "url": server.url},
        ],
        "metrics_port": 0,
    }
    storage = backend(pool, extra)
    keys = page_keys(3)
    storage.batch_set_v1(keys, host_indices(range(3)))
    storage.batch_get_v1(keys, host_indices(range(5, 8)))
    port = storage._metrics.server.server_port
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert 'kvoffload_transfer_blocks_total{direction="store",tier="1:fs"} 3.0' in text
    assert 'kvoffload_transfer_blocks_total{direction="store",tier="2:redis"} 3.0' in text
    assert 'kvoffload_transfer_blocks_total{direction="load",tier="1:fs"} 3.0' in text
    assert 'counter="loaded_pages",side="storage",tier="sglang"} 3.0' in text
    storage.close()


@pytest.mark.mooncake
def test_pages_round_trip_through_a_mooncake_store(tmp_path) -> None:
    from mooncake_server import MooncakeServer

    server = MooncakeServer(tmp_path).start()
    try:
        source, target = mha_pool("layer_first", seed=1), mha_pool("layer_first", seed=2)
        extra = {"interface_v1": 1, "secondary_tiers": [server.tier_config()]}
        first, second = backend(source, extra), backend(target, extra)
        keys = page_keys(5)
        assert first.batch_set_v1(keys, host_indices(range(5))) == [True] * 5
        assert second.batch_exists(keys) == 5
        assert second.batch_get_v1(keys, host_indices(range(10, 15))) == [True] * 5
        for i in range(5):
            assert torch.equal(page_bytes(target, 10 + i), page_bytes(source, i))
        first.close()
        second.close()
    finally:
        server.stop()
