"""One engine's halves of the object-storage tier, built from configuration as an engine
builds them, over a test host pool: ``Replica(server, **options)`` with ``store``, ``run``,
``settle`` (ask until a lookup is no longer ``RETRY``), ``name(key)`` (its object's name)
and ``close``. ``POOLS``: a pool with the row prefix the engine's factory gives it beside
an object tier (objects put straight from the pool) and one without (header and rows
joined first)."""

from __future__ import annotations

import torch

from kvoffload.manager import LookupResult
from kvoffload.specs import CPULoadStoreSpec
from kvoffload.tiers.mooncake.objects import SLOT_BYTES
from kvoffload.tiers.redis.format import redis_namespace
from kvoffload.tiers.s3.names import ObjectNames
from kvoffload.tiers.secondary import TierContext, parse_secondary_tiers
from kvoffload.transfer.host_pool import HostBlockPool
from kvoffload.transfer.layout import KVLayout
from redis_replica import IDENTITY, until
from s3_server import S3Server
from transfer_oracle import make_pool, randomize, three_group_layer_caches
from worker_jobs import run_job

RETRY = LookupResult.RETRY
WAIT_S = 30.0  # a hang guard only


def prefixed_pool(num_host: int = 16, seed: int = 0) -> HostBlockPool:
    """``transfer_oracle.make_pool``'s layout (three groups, random rows, seeded) with the
    object header prefix before each block; the prefixes hold random bytes too."""
    gen = torch.Generator().manual_seed(seed)
    caches, groups = three_group_layer_caches(8, gen)
    pool = HostBlockPool(KVLayout.from_layer_tensors(caches, groups), num_host, row_prefix_bytes=SLOT_BYTES)
    randomize(pool.region, gen)
    return pool


def big_pool(num_host: int, block_bytes: int, seed: int, prefix: int = SLOT_BYTES) -> HostBlockPool:
    """A host pool of one tensor, ``block_bytes`` per block, random rows (seeded)."""
    gen = torch.Generator().manual_seed(seed)
    layout = KVLayout.from_layer_tensors({"layer": torch.empty((4, block_bytes), dtype=torch.uint8)})
    pool = HostBlockPool(layout, num_host, row_prefix_bytes=prefix)
    randomize(pool.tensors[0], gen)
    return pool


POOLS = {"one buffer": prefixed_pool, "joined": lambda seed=0: make_pool(seed=seed)}


class Replica:
    def __init__(self, server: S3Server, seed: int = 0, pool=None, identity: str = "writer", **options):
        options = {"probe_timeout_s": 5.0, "retry_max_s": 0.5, **options}
        (self.tier,) = parse_secondary_tiers([server.tier_config(identity, **options)])
        self.pool = prefixed_pool(seed=seed) if pool is None else pool
        self.block_bytes = sum(int(t.shape[1]) for t in self.pool.tensors)
        self.context = TierContext(self.block_bytes, IDENTITY)
        self.manager = self.tier.build_manager(self.context, "lru")
        self.worker = self.tier.build_worker(self.context, self.pool)
        self.names = ObjectNames(options.get("prefix", "kvoffload"), redis_namespace({**IDENTITY, "rank": 0}))
        self.job = 0

    def name(self, key: bytes) -> str:
        return self.names.name(key)

    def run(self, src, dst, timeout: float = WAIT_S):
        self.job += 1
        return run_job(self.worker, self.job, src, dst, timeout)

    def store(self, keys, host_ids):
        out = self.manager.prepare_store(keys)
        result = self.run(CPULoadStoreSpec(host_ids[: len(out.keys_to_store)]), out.store_spec)
        self.manager.complete_store(out.keys_to_store, result.success)
        return result

    def load(self, keys, host_ids):
        spec = self.manager.prepare_load(keys)
        result = self.run(spec, CPULoadStoreSpec(host_ids))
        self.manager.complete_load(keys)
        return result

    def settle(self, key, timeout: float = WAIT_S):
        """Ask until the answer is no longer RETRY (the scheduler asks once per step)."""
        return until(lambda: (r := self.manager.lookup(key)) is not RETRY and r, timeout)

    def close(self):
        self.worker.close()
        self.manager.close()
