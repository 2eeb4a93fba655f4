"""Routers of a simulated fleet: which of N replicas serves each request.

Contract:

* ``ROUTINGS`` names the routers; ``make_router(name, replicas, ...)`` builds one and
  raises ``ValueError`` naming an unknown name or a bad argument.
* Load: ``LoadWindow(replicas, window)``. The load of a replica is the prefill tokens it
  computed (prompt tokens its device and host tiers did not serve) for the requests routed
  to it among the fleet's last ``window`` requests. ``imbalance()`` is max/mean of the
  loads, 1.0 while every load is 0. Counting requests, not milliseconds, keeps the load
  defined for traces without timestamps and independent of a guessed service rate.
* ``Router.choose(hashes, loads) -> replica`` with ``hashes`` the request's chained block
  hashes (``uint64``) and ``loads`` the ``LoadWindow``; afterwards ``guarded`` tells
  whether the load-balance guard decided and ``predicted`` is the index's cumulative
  (device, device + host) prefix, in blocks, for the replica chosen (``None`` for routers
  without an index).
  ``Router.observe(replica, device_events, host_events)`` hands over the
  ``OffloadingEvent`` s the replica's tiers queued while serving; only routers with
  ``wants_events`` read them.
* ``round_robin``: the i-th request goes to replica ``i mod N``. ``random``: uniform,
  from ``random.Random(seed)``. ``least_load``: the least loaded replica (ties: lowest
  index). ``kv_aware``: the replica whose tiers hold the longest tier-weighted prefix, as
  scored by a real ``kvoffload.index.BlockIndex`` fed with every replica's KV events
  (device tier as medium ``GPU``, host tier as ``CPU``; ties: least loaded, then lowest
  index), unless the guard fires: with ``imbalance() > balance_threshold`` the request
  goes to the least loaded replica instead, whatever it holds.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Sequence

import numpy as np

from kvoffload.events.types import MEDIUM_CPU, MEDIUM_GPU, BlockRemoved, BlockStored
from kvoffload.index.core import BlockIndex
from kvoffload.index.state import SourceState
from kvoffload.index.tiers import TierWeights
from kvoffload.manager import OffloadingEvent
from kvoffload.validation import positive_int

ROUTINGS: tuple[str, ...] = ("round_robin", "random", "least_load", "kv_aware")
DEFAULT_BALANCE_THRESHOLD = 2.0
SIM_MODEL = "sim"  # the model name the simulated replicas register in the index


def validate_routings(names: Sequence[str]) -> list[str]:
    """The names, lower-cased, each checked to be one of ``ROUTINGS``."""
    out = []
    for name in names:
        if name.lower() not in ROUTINGS:
            raise ValueError(f"unknown routing {name!r}; known: {', '.join(ROUTINGS)}")
        out.append(name.lower())
    return out


def check_threshold(value: object) -> float:
    """``value`` if it is a number >= 1 (max/mean is never below 1; ``inf`` turns the
    guard off)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 1.0:
        raise ValueError(f"balance_threshold must be a number >= 1 (max/mean load), got {value!r}")
    return float(value)


class LoadWindow:
    """Prefill tokens computed per replica over the fleet's last ``window`` requests."""

    def __init__(self, replicas: int, window: int) -> None:
        positive_int("replicas", replicas)
        self.window = positive_int("load_window", window)
        self.loads = [0] * replicas
        self._recent: deque[tuple[int, int]] = deque()

    def add(self, replica: int, tokens: int) -> None:
        recent = self._recent
        recent.append((replica, tokens))
        self.loads[replica] += tokens
        if len(recent) > self.window:
            old, gone = recent.popleft()
            self.loads[old] -= gone

    def imbalance(self) -> float:
        total = sum(self.loads)
        return max(self.loads) * len(self.loads) / total if total else 1.0

    def least_loaded(self) -> int:
        loads = self.loads
        return loads.index(min(loads))


class Router:
    """Base: no guard, no index, events ignored."""

    wants_events = False

    def __init__(self, replicas: int) -> None:
        self.replicas = positive_int("replicas", replicas)
        self.guarded = False
        self.predicted: tuple[int, int] | None = None

    def choose(self, hashes: np.ndarray, loads: LoadWindow) -> int:
        raise NotImplementedError

    def observe(
        self, replica: int, device_events: list[OffloadingEvent], host_events: list[OffloadingEvent]
    ) -> None:
        pass


class RoundRobin(Router):
    def __init__(self, replicas: int) -> None:
        super().__init__(replicas)
        self._next = 0

    def choose(self, hashes: np.ndarray, loads: LoadWindow) -> int:
        replica = self._next
        self._next = (replica + 1) % self.replicas
        return replica


class RandomRouter(Router):
    def __init__(self, replicas: int, seed: int) -> None:
        super().__init__(replicas)
        self._rng = random.Random(seed)

    def choose(self, hashes: np.ndarray, loads: LoadWindow) -> int:
        return self._rng.randrange(self.replicas)


class LeastLoad(Router):
    def choose(self, hashes: np.ndarray, loads: LoadWindow) -> int:
        return loads.least_loaded()


class KVAware(Router):
    """Cache affinity by the index's tier-weighted prefix, under the load-balance guard."""

    wants_events = True

    def __init__(
        self, replicas: int, balance_threshold: float, block_size: int, weights: TierWeights | None = None
    ) -> None:
        super().__init__(replicas)
        self.balance_threshold = check_threshold(balance_threshold)
        self.block_size = positive_int("block_size", block_size)
        self.index = BlockIndex(weights=weights, hash_seed=None)
        self.engines = [self.index.add_engine(SIM_MODEL, "", r, 0, block_size) for r in range(replicas)]
        for engine in self.engines:
            self.index.set_state(engine, SourceState.EXACT)  # fed every event, in order

    def choose(self, hashes: np.ndarray, loads: LoadWindow) -> int:
        result = self.index.query_hashes(SIM_MODEL, "", hashes)
        if loads.imbalance() > self.balance_threshold:
            replica = loads.least_loaded()
            self.guarded = True
        else:
            load = loads.loads
            replica = min(range(self.replicas), key=lambda r: (-result.matches[r].weighted, load[r], r))
            self.guarded = False
        levels = result.matches[replica].levels
        self.predicted = (levels[0], levels[1])
        return replica

    def observe(
        self, replica: int, device_events: list[OffloadingEvent], host_events: list[OffloadingEvent]
    ) -> None:
        wire = [self._wire(e, MEDIUM_GPU) for e in device_events]
        wire += [self._wire(e, MEDIUM_CPU) for e in host_events]
        if wire:
            self.index.apply(self.engines[replica], wire)

    def _wire(self, event: OffloadingEvent, medium: str) -> BlockStored | BlockRemoved:
        # A trace block's key is its id as 8 big-endian bytes (kvoffload.sim.replay.block_key),
        # so the id is the u64 hash routers see.
        hashes = [int.from_bytes(key[:8], "big") for key in event.keys]
        if event.removed:
            return BlockRemoved(hashes, medium)
        return BlockStored(hashes, None, [], self.block_size, None, medium, None)


def make_router(
    name: str,
    replicas: int,
    *,
    block_size: int,
    seed: int = 0,
    balance_threshold: float = DEFAULT_BALANCE_THRESHOLD,
    weights: TierWeights | None = None,
) -> Router:
    """The router called ``name`` (one of ``ROUTINGS``) for ``replicas`` replicas."""
    (key,) = validate_routings([name])
    if key == "round_robin":
        return RoundRobin(replicas)
    if key == "random":
        return RandomRouter(replicas, seed)
    if key == "least_load":
        return LeastLoad(replicas)
    return KVAware(replicas, balance_threshold, block_size, weights)
