"""Replay of a trace through a real tier manager, the way a scheduler drives it.

Protocol, per request: look up its keys until the first non-hit, touch all of them, load
the hit prefix (prepare and complete), store the rest (prepare and complete). Every block
id in ``hash_ids`` is one key of KV-cache group 0, the trailing partial block included.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

from kvoffload.keys import OffloadKey, make_offload_key
from kvoffload.manager import OffloadingManager
from kvoffload.sim.trace import TraceRequest


def block_key(block_id: int, group_idx: int = 0) -> OffloadKey:
    """The offload key of a trace block id."""
    return make_offload_key(block_id.to_bytes(8, "big"), group_idx)


@dataclass(frozen=True)
class ReplayResult:
    requests: int
    keys: int
    hit_keys: int
    stored_keys: int
    evicted_keys: int
    seconds: float

    @property
    def hit_ratio(self) -> float:
        return self.hit_keys / self.keys if self.keys else 0.0

    @property
    def keys_per_second(self) -> float:
        return self.keys / self.seconds if self.seconds > 0 else float("inf")


def to_key_lists(requests: Iterable[TraceRequest]) -> list[list[OffloadKey]]:
    """Each request's keys, built once so that a replay times only the manager."""
    cache: dict[int, OffloadKey] = {}
    out = []
    for request in requests:
        keys = []
        for block_id in request.hash_ids:
            key = cache.get(block_id)
            if key is None:
                key = cache[block_id] = block_key(block_id)
            keys.append(key)
        out.append(keys)
    return out


def replay_keys(manager: OffloadingManager, key_lists: list[list[OffloadKey]]) -> ReplayResult:
    """Drive ``manager`` through ``key_lists`` with the protocol above."""
    hits = stored = evicted = total = 0
    lookup_prefix = manager.lookup_prefix
    touch = manager.touch
    prepare_load, complete_load = manager.prepare_load, manager.complete_load
    prepare_store, complete_store = manager.prepare_store, manager.complete_store
    start = time.perf_counter()
    for keys in key_lists:
        total += len(keys)
        hit = lookup_prefix(keys)
        touch(keys)
        if hit:
            prefix = keys[:hit]
            prepare_load(prefix)
            complete_load(prefix)
            hits += hit
        if hit < len(keys):
            out = prepare_store(keys[hit:])
            if out is not None:
                complete_store(out.keys_to_store)
                stored += len(out.keys_to_store)
                evicted += len(out.evicted_keys)
    seconds = time.perf_counter() - start
    return ReplayResult(len(key_lists), total, hits, stored, evicted, seconds)
