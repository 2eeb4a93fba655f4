"""Replay through an engine's own prefix cache (the device tier) and a host tier behind it.

Protocol, per request (extends ``kvoffload.sim.replay``'s):

1. the device tier serves the longest prefix it holds (``d`` blocks);
2. the host tier is asked for the keys after it, until the first non-hit (``h`` blocks);
3. the host tier's policy is touched with *all* the request's keys (a device hit is a use
   too), the ``h`` blocks are loaded (prepare and complete);
4. the blocks computed by prefill (after ``d + h``) are stored to the host tier;
5. the device tier then holds the whole request, head most recent.

The device tier is modelled by a ``CPUOffloadingManager`` with LRU — a fixed number of
blocks evicted least-recently-used first, tails before heads, as an engine's prefix cache
does — so no cache logic is written twice. A request with more new blocks than the device
holds leaves the device tier unchanged. Without a device tier (``device_blocks == 0``) the
replay is exactly ``replay_keys``. The device tier never depends on the host tier, so
``device_prefixes`` can compute its hits once for every host policy and capacity.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvoffload.cpu import CPUOffloadingManager
from kvoffload.keys import OffloadKey
from kvoffload.manager import OffloadingManager
from kvoffload.validation import non_negative_int


@dataclass(frozen=True)
class TieredResult:
    """Block counts of one replay; ``*_tokens`` count prompt tokens in those blocks."""

    requests: int
    keys: int
    device_hits: int
    host_hits: int
    stored: int
    evicted: int
    device_tokens: int
    host_tokens: int
    prompt_tokens: int
    seconds: float

    @property
    def device_hit_ratio(self) -> float:
        return self.device_hits / self.keys if self.keys else 0.0

    @property
    def host_hit_ratio(self) -> float:
        return self.host_hits / self.keys if self.keys else 0.0

    @property
    def hit_ratio(self) -> float:
        return (self.device_hits + self.host_hits) / self.keys if self.keys else 0.0

    @property
    def requests_per_second(self) -> float:
        return self.requests / self.seconds if self.seconds > 0 else float("inf")


def device_prefixes(key_lists: Sequence[Sequence[OffloadKey]], device_blocks: int) -> list[int]:
    """How many leading blocks of each request an LRU device cache of ``device_blocks`` serves."""
    non_negative_int("device_blocks", device_blocks)
    if device_blocks == 0:
        return [0] * len(key_lists)
    device = CPUOffloadingManager(device_blocks, "lru")
    out = []
    for keys in key_lists:
        served = device.lookup_prefix(keys)
        device.touch(keys)
        stored = device.prepare_store(keys[served:])
        if stored is not None:
            device.complete_store(stored.keys_to_store)
        out.append(served)
    return out


def block_tokens(input_length: int, blocks: int, block_size: int) -> int:
    """Prompt tokens in the first ``blocks`` blocks of a prompt of ``input_length`` tokens."""
    return min(blocks * block_size, max(input_length, 0))


def replay_tiered(
    host: OffloadingManager,
    key_lists: Sequence[Sequence[OffloadKey]],
    served: Sequence[int],
    input_lengths: Sequence[int],
    block_size: int,
) -> TieredResult:
    """Drive ``host`` behind a device tier whose per-request hits are ``served``."""
    if not len(key_lists) == len(served) == len(input_lengths):
        raise ValueError("key_lists, served and input_lengths must have one entry per request")
    keys_total = device_hits = host_hits = stored = evicted = 0
    device_tokens = host_tokens = prompt_tokens = 0
    lookup_prefix, touch = host.lookup_prefix, host.touch
    prepare_load, complete_load = host.prepare_load, host.complete_load
    prepare_store, complete_store = host.prepare_store, host.complete_store
    start = time.perf_counter()
    for keys, d, length in zip(key_lists, served, input_lengths):
        n = len(keys)
        keys_total += n
        prompt_tokens += length
        rest = keys[d:] if d else keys
        h = lookup_prefix(rest)
        touch(keys)
        if h:
            prefix = rest[:h]
            prepare_load(prefix)
            complete_load(prefix)
        if d + h < n:
            out = prepare_store(rest[h:])
            if out is not None:
                complete_store(out.keys_to_store)
                stored += len(out.keys_to_store)
                evicted += len(out.evicted_keys)
        device_hits += d
        host_hits += h
        dt = block_tokens(length, d, block_size)
        device_tokens += dt
        host_tokens += block_tokens(length, d + h, block_size) - dt
    seconds = time.perf_counter() - start
    return TieredResult(
        len(key_lists),
        keys_total,
        device_hits,
        host_hits,
        stored,
        evicted,
        device_tokens,
        host_tokens,
        prompt_tokens,
        seconds,
    )
