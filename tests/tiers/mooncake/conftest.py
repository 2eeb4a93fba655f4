"""One engine's halves of the Mooncake tier, built from configuration as an engine builds
them, over a test host pool: ``Replica(server, **options)`` with ``store``, ``run``,
``settle`` (ask until a lookup is no longer ``RETRY``) and ``close``; the
``mooncake_replicas`` fixture makes them against one real store (``mooncake_server``) and closes them."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from kvoffload.manager import LookupResult
from kvoffload.specs import CPULoadStoreSpec
from kvoffload.tiers.mooncake.names import object_names
from kvoffload.tiers.mooncake.objects import SLOT_BYTES
from kvoffload.tiers.redis.format import KeyNames, redis_namespace
from kvoffload.tiers.secondary import TierContext, parse_secondary_tiers
from kvoffload.transfer.host_pool import HostBlockPool
from kvoffload.transfer.layout import KVLayout
from mooncake_server import MooncakeServer
from redis_replica import IDENTITY, until
from transfer_oracle import make_pool, randomize, three_group_layer_caches
from worker_jobs import run_job

RETRY = LookupResult.RETRY
READY_S = 30.0  # a hang guard only


class Replica:
    def __init__(self, server: MooncakeServer, seed: int = 0, rank: int = 0, world_size: int = 1,
                 pool=None, **options):  # fmt: skip
        (self.tier,) = parse_secondary_tiers([server.tier_config(probe_timeout_s=5.0, retry_max_s=0.5,
                                                                 **options)])  # fmt: skip
        self.pool = prefixed_pool(seed=seed) if pool is None else pool
        self.block_bytes = sum(int(t.shape[1]) for t in self.pool.tensors)
        self.context = TierContext(self.block_bytes, IDENTITY, rank=rank, world_size=world_size)
        self.manager = self.tier.build_manager(self.context, "lru")
        self.worker = self.tier.build_worker(self.context, self.pool)
        self.names = KeyNames("kvoffload", redis_namespace({**IDENTITY, "rank": rank}))
        self.job = 0
        assert self.worker.store.wait_ready(READY_S) and self.manager._remote.store.wait_ready(READY_S)

    def name(self, key: bytes) -> str:
        return object_names(self.names, [key])[0]

    def run(self, src, dst, timeout: float = READY_S):
        self.job += 1
        return run_job(self.worker, self.job, src, dst, timeout)

    def store(self, keys, host_ids):
        out = self.manager.prepare_store(keys)
        result = self.run(CPULoadStoreSpec(host_ids[: len(out.keys_to_store)]), out.store_spec)
        self.manager.complete_store(out.keys_to_store, result.success)
        return result

    def settle(self, key, timeout: float = READY_S):
        """Ask until the answer is no longer RETRY (the scheduler asks once per step)."""
        return until(lambda: (r := self.manager.lookup(key)) is not RETRY and r, timeout)

    def close(self):
        close_all([self.worker, self.manager])


def prefixed_pool(num_host: int = 16, seed: int = 0) -> HostBlockPool:
    """``transfer_oracle.make_pool``'s pool (three groups, random rows, seeded) with the row
    prefix the engine's factory gives it when a Mooncake tier is configured: its objects
    are one buffer each. Prefixes hold random bytes too: nothing may rely on them."""
    gen = torch.Generator().manual_seed(seed)
    caches, groups = three_group_layer_caches(8, gen)
    layout = KVLayout.from_layer_tensors(caches, groups)
    pool = HostBlockPool(layout, num_host, row_prefix_bytes=SLOT_BYTES)
    randomize(pool.region, gen)
    return pool


def split_pool(seed: int = 0) -> HostBlockPool:
    """The same without a prefix: objects are a header slot and the block's rows."""
    return make_pool(seed=seed)


POOLS = {"one buffer": prefixed_pool, "split buffers": split_pool}


def big_pool(num_host: int, block_bytes: int, seed: int, prefix: int = SLOT_BYTES) -> HostBlockPool:
    """A host pool of one tensor, ``block_bytes`` per block, random rows (seeded)."""
    gen = torch.Generator().manual_seed(seed)
    layout = KVLayout.from_layer_tensors({"layer": torch.empty((4, block_bytes), dtype=torch.uint8)})
    pool = HostBlockPool(layout, num_host, row_prefix_bytes=prefix)
    randomize(pool.tensors[0], gen)
    return pool


def close_all(closeable) -> None:
    """Close each at once: a Mooncake client takes about a second to close."""
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda c: c.close(), closeable))


@pytest.fixture
def mooncake_server(tmp_path):
    server = MooncakeServer(tmp_path).start()
    yield server
    server.stop()


@pytest.fixture
def mooncake_replicas(mooncake_server):
    made = []

    def make(layout: str = "one buffer", **options):
        pool = POOLS[layout](seed=len(made))
        made.append(Replica(mooncake_server, seed=len(made), pool=pool, **options))
        return made[-1]

    yield make
    close_all(made)
