"""One engine's halves of the shared (Redis) tier, built from configuration as an engine
builds them, over a test host pool: ``Replica(url, **options)`` with ``store``, ``run``,
``settle`` (ask until a lookup is no longer ``RETRY``) and ``close``; ``k(i)`` a test key,
``until`` a bounded wait, ``IDENTITY`` the blocks' identity."""

from __future__ import annotations

import time

from kvoffload.keys import make_offload_key
from kvoffload.manager import LookupResult
from kvoffload.specs import CPULoadStoreSpec
from kvoffload.tiers.redis.format import KeyNames, redis_namespace
from kvoffload.tiers.secondary import TierContext, parse_secondary_tiers
from transfer_oracle import make_pool
from worker_jobs import run_job

RETRY = LookupResult.RETRY
IDENTITY = {"model": "test", "dtype": "uint8", "block_size": 8}


def k(i: int) -> bytes:
    return make_offload_key(i.to_bytes(32, "big"), i % 2)


def until(predicate, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.01)
    raise AssertionError("condition not reached in time")


class Replica:
    """One engine's halves of the tier, built from configuration as an engine builds them."""

    def __init__(self, url: str, seed: int = 0, **options):
        (self.tier,) = parse_secondary_tiers([{"type": "redis", "url": url, "timeout_s": 1.0,
                                               "connect_timeout_s": 0.5, **options}])  # fmt: skip
        self.pool = make_pool(seed=seed)
        self.block_bytes = sum(int(t.shape[1]) for t in self.pool.tensors)
        context = TierContext(self.block_bytes, IDENTITY)
        self.manager = self.tier.build_manager(context, "lru")
        self.worker = self.tier.build_worker(context, self.pool)
        self.names = KeyNames("kvoffload", redis_namespace({**IDENTITY, "rank": 0}))
        self.job = 0

    def run(self, src, dst, timeout: float = 10.0):
        self.job += 1
        return run_job(self.worker, self.job, src, dst, timeout)

    def store(self, keys, host_ids):
        out = self.manager.prepare_store(keys)
        result = self.run(CPULoadStoreSpec(host_ids[: len(out.keys_to_store)]), out.store_spec)
        self.manager.complete_store(out.keys_to_store, result.success)
        return result

    def wait_listening(self, timeout: float = 30.0) -> None:
        """Until the server confirmed the keyspace-notification subscription: removals
        after this are heard (before it, only reconciliation finds them)."""
        assert self.manager._remote.listening.wait(timeout), "not subscribed to notifications"

    def settle(self, key, timeout: float = 5.0):
        """Ask until the answer is no longer RETRY (the scheduler asks once per step)."""
        return until(lambda: (r := self.manager.lookup(key)) is not RETRY and r, timeout)

    def close(self):
        self.worker.close()
        self.manager.close()
