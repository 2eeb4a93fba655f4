"""The shared tier on a real 3-master Redis Cluster on loopback: blocks spread over the
masters; with one master killed its keys miss while the other masters still serve."""

from __future__ import annotations

import pytest

from kvoffload.manager import LookupResult
from kvoffload.specs import CPULoadStoreSpec
from redis_replica import Replica, k
from redis_server import RedisCluster
from transfer_oracle import host_block

HIT, MISS = LookupResult.HIT, LookupResult.MISS


@pytest.fixture
def cluster(tmp_path):
    nodes = RedisCluster(tmp_path).start()
    yield nodes
    nodes.stop()


def test_blocks_spread_over_the_masters_and_survive_one_masters_death(cluster):
    # The dead master refuses connections at once (loopback); the live ones must answer
    # within the timeout, which a loaded machine (or a sanitizer build) can stretch past the
    # 1 s Replica default: a live master's timed-out lookup is a miss, not the fault tested.
    slow_ok = {"timeout_s": 10.0, "connect_timeout_s": 5.0}
    a = Replica(cluster.url, cluster=True, **slow_ok)
    b = Replica(cluster.url, seed=1, cluster=True, **slow_ok)
    try:
        keys = [k(i) for i in range(48)]
        for start in range(0, 48, 16):
            assert a.store(keys[start : start + 16], list(range(16))).success
        per_node = [node.client().dbsize() for node in cluster.nodes]
        assert sum(per_node) == 48 and all(n > 0 for n in per_node), per_node

        dead = cluster.nodes[1]
        held = set(dead.client().keys("kvoffload:*"))
        on_dead = {key for key in keys if a.names.name(key) in held}
        dead.kill()
        answers = {key: b.settle(key) for key in keys}
        assert {key for key, r in answers.items() if r is MISS} == on_dead
        alive = [key for key in keys if key not in on_dead]
        assert all(answers[key] is HIT for key in alive)
        result = b.run(b.manager.prepare_load(alive[:8]), CPULoadStoreSpec(range(8)))
        b.manager.complete_load(alive[:8])
        assert result.success
        for i, key in enumerate(alive[:8]):
            assert host_block(b.pool, i) == host_block(a.pool, keys.index(key) % 16)
        for calls in (a.worker.calls, b.worker.calls):  # the worker's own RESP path, per node
            assert calls.streamed_batches >= 2 and calls.command_batches == 0
    finally:
        a.close()
        b.close()
