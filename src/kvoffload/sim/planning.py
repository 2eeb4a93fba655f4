"""Capacity planning: what does a host tier of a given size buy on a given traffic?

``plan`` replays one trace for every (policy, capacity) pair with the tiered protocol of
``kvoffload.sim.tiered`` and turns block counts into tokens, bytes and time with a simple
``CostModel``:

* a hit token skips prefill, which runs at ``prefill_tokens_per_s``;
* a host hit costs its blocks' bytes (``block_size * kv_bytes_per_token`` each) over the
  host-to-device link at ``bandwidth_bytes_per_s`` (device hits move nothing);
* stores to the host run in the background and cost no request time (their bytes are
  reported, not charged);
* with a disk tier (``kvoffload.sim.disk_plan``), a disk hit is first read from disk into
  host memory at ``disk_bandwidth_bytes_per_s``, then crosses the link like a host hit;
  writes to disk run in the background, like stores.

Capacities are given as text: ``"5%"`` or ``"0.05"`` (a fraction of the trace's unique
blocks, in (0, 1]), ``"2000"`` (blocks) or ``"8GiB"`` / ``"500MB"`` (bytes, divided by
the bytes of one block). The policy name ``"belady"`` is the offline optimum
(``kvoffload.sim.belady``) run on the keys the device tier leaves to the host tier.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvoffload.cpu import CPUOffloadingManager
from kvoffload.policies import resolve_policy
from kvoffload.sim.belady import belady_hits
from kvoffload.sim.replay import to_key_lists
from kvoffload.sim.tiered import block_tokens, device_prefixes, replay_tiered
from kvoffload.sim.trace import Trace

BELADY = "belady"
_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]+)\s*$")


@dataclass(frozen=True)
class CostModel:
    """Prefill speed, host-to-device bandwidth, KV size of the model being served, and the
    read bandwidths of a disk tier, of a shared remote tier and of an object-storage tier,
    and the object tier's time to first byte (each used only when its tier is modelled)."""

    prefill_tokens_per_s: float = 8000.0
    bandwidth_bytes_per_s: float = 25e9
    kv_bytes_per_token: int = 131072  # Llama-3-8B in bf16: 2 (K,V) x 32 layers x 8 heads x 128 x 2 B
    disk_bandwidth_bytes_per_s: float = 5e9
    remote_bandwidth_bytes_per_s: float = 3e9  # a shared tier over the network (~25 Gbit/s)
    object_bandwidth_bytes_per_s: float = 1e9  # one engine's GETs from an S3 service
    object_latency_s: float = 0.03  # an S3 GET's time to first byte (once per request: GETs run at once)

    def __post_init__(self) -> None:
        for name in (
            "prefill_tokens_per_s",
            "bandwidth_bytes_per_s",
            "kv_bytes_per_token",
            "disk_bandwidth_bytes_per_s",
            "remote_bandwidth_bytes_per_s",
            "object_bandwidth_bytes_per_s",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        latency = self.object_latency_s
        if isinstance(latency, bool) or not isinstance(latency, (int, float)) or not latency >= 0:
            raise ValueError(f"object_latency_s must be a number >= 0, got {latency!r}")


def parse_bytes(text: str) -> int:
    """``"8GiB"`` -> 8589934592; units B, KB, MB, GB, TB (powers of 10) and KiB…TiB."""
    match = _SIZE.match(text)
    unit = match and _UNITS.get(match.group(2).lower())
    if not unit:
        raise ValueError(f"not a size: {text!r} (expected e.g. '512MiB' or '8GB')")
    return int(float(match.group(1)) * unit)


def parse_capacity(text: str, unique_blocks: int, block_bytes: int) -> int:
    """The number of host blocks that a capacity spec (see the module doc) stands for."""
    spec = text.strip()
    try:
        if spec.endswith("%"):
            fraction = float(spec[:-1]) / 100.0
        elif re.fullmatch(r"[0-9]+", spec):
            return int(spec)
        elif re.fullmatch(r"[0-9]*\.[0-9]+|[0-9]+\.[0-9]*", spec):
            fraction = float(spec)
        else:
            blocks = parse_bytes(spec) // block_bytes
            if blocks <= 0:
                raise ValueError(f"capacity {text!r} holds no block of {block_bytes} bytes")
            return blocks
    except ValueError as exc:
        raise ValueError(f"bad capacity {text!r}: {exc}") from None
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"bad capacity {text!r}: a fraction of the unique blocks must be in (0, 1]")
    return max(1, int(unique_blocks * fraction))


@dataclass(frozen=True)
class PlanRow:
    """One (policy, capacity) result."""

    policy: str
    capacity: str
    blocks: int
    fraction: float  # of the trace's unique blocks
    requests: int
    device_hit_ratio: float
    host_hit_ratio: float
    hit_ratio: float
    device_tokens_saved: int
    host_tokens_saved: int
    bytes_loaded: int
    bytes_stored: int
    prefill_s_saved: float
    replay_s: float

    @property
    def requests_per_second(self) -> float:
        return self.requests / self.replay_s if self.replay_s > 0 else float("inf")


def validate_policies(names: Sequence[str]) -> list[str]:
    """The names, each checked to be ``"belady"`` or a resolvable eviction policy."""
    for name in names:
        if name.lower() != BELADY:
            resolve_policy(name)
    return list(names)


def plan(
    trace: Trace,
    policies: Sequence[str],
    capacities: Sequence[str],
    device_blocks: int = 0,
    cost: CostModel = CostModel(),
    progress: Callable[[str], None] | None = None,
    on_tier: Callable[[str, str, CPUOffloadingManager], None] | None = None,
) -> list[PlanRow]:
    """Replay ``trace`` for every policy at every capacity; rows in (policy, capacity) order.
    ``on_tier(policy, capacity, tier)`` hears of each row's host tier before its replay."""
    policies = validate_policies(policies)
    unique = trace.unique_blocks()
    block_bytes = trace.block_size * cost.kv_bytes_per_token
    sizes = [(spec, parse_capacity(spec, unique, block_bytes)) for spec in capacities]
    key_lists = to_key_lists(trace.requests)
    lengths = [r.input_length for r in trace.requests]
    served = device_prefixes(key_lists, device_blocks)
    rows = []
    for name in policies:
        for spec, blocks in sizes:
            if progress:
                progress(f"{name} @ {spec}")
            if name.lower() == BELADY:
                rows.append(_belady_row(trace, key_lists, served, lengths, spec, blocks, unique, cost))
                continue
            tier = CPUOffloadingManager(blocks, name)
            if on_tier:
                on_tier(name, spec, tier)
            result = replay_tiered(tier, key_lists, served, lengths, trace.block_size)
            rows.append(
                _row(
                    name,
                    spec,
                    blocks,
                    unique,
                    result.requests,
                    result.keys,
                    result.device_hits,
                    result.host_hits,
                    result.stored,
                    result.device_tokens,
                    result.host_tokens,
                    result.seconds,
                    trace.block_size,
                    cost,
                )
            )
    return rows


def _belady_row(trace, key_lists, served, lengths, spec, blocks, unique, cost) -> PlanRow:
    start = time.perf_counter()
    rest = [keys[d:] for keys, d in zip(key_lists, served)]
    hits, stored, _ = belady_hits(rest, blocks)
    bs = trace.block_size
    device_tokens = sum(block_tokens(n, d, bs) for n, d in zip(lengths, served))
    host_tokens = sum(block_tokens(n, d + h, bs) for n, d, h in zip(lengths, served, hits)) - device_tokens
    seconds = time.perf_counter() - start
    keys = sum(len(k) for k in key_lists)
    return _row(
        BELADY,
        spec,
        blocks,
        unique,
        len(key_lists),
        keys,
        sum(served),
        sum(hits),
        stored,
        device_tokens,
        host_tokens,
        seconds,
        bs,
        cost,
    )


def _row(
    name,
    spec,
    blocks,
    unique,
    requests,
    keys,
    device_hits,
    host_hits,
    stored,
    device_tokens,
    host_tokens,
    seconds,
    block_size,
    cost: CostModel,
) -> PlanRow:
    block_bytes = block_size * cost.kv_bytes_per_token
    loaded = host_hits * block_bytes
    saved = (device_tokens + host_tokens) / cost.prefill_tokens_per_s - loaded / cost.bandwidth_bytes_per_s
    return PlanRow(
        policy=name,
        capacity=spec,
        blocks=blocks,
        fraction=blocks / unique if unique else 0.0,
        requests=requests,
        device_hit_ratio=device_hits / keys if keys else 0.0,
        host_hit_ratio=host_hits / keys if keys else 0.0,
        hit_ratio=(device_hits + host_hits) / keys if keys else 0.0,
        device_tokens_saved=device_tokens,
        host_tokens_saved=host_tokens,
        bytes_loaded=loaded,
        bytes_stored=stored * block_bytes,
        prefill_s_saved=saved,
        replay_s=seconds,
    )
