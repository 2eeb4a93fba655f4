"""Seeded fault injection in the transfer path, for tests and drills.

``FaultInjectingWorker`` wraps the ``OffloadingWorker`` an engine talks to (the
``WorkerRouter`` of ``kvoffload.tiers.factory.build_worker``) and makes chosen loads
(``CPU -> GPU``) and stores (``GPU -> CPU``) fail. Jobs of other routes (between tiers)
pass through untouched. Which jobs fail is decided at ``submit``, in submission order:

* ``fail_loads`` / ``fail_stores``: positions (0-based) among the loads / stores submitted
  through this worker, and
* ``load_failure_rate`` / ``store_failure_rate``: each other load / store fails with this
  probability, drawn from a ``random.Random(seed)`` per direction, so the same submission
  order fails the same jobs.

A failed job is the dangerous kind of failure: its copy *runs*, from the wrong source
blocks (the job's own source blocks rotated by one, or for a one-block job a block of
the same medium an earlier job named), and only then is the job reported failed. Its
destination then holds plausible but wrong KV, as after a copy that broke part-way: a
failed load whose device blocks the engine used anyway, or a failed store whose host
slots became loadable anyway, changes the engine's output. When no other block is known
yet, nothing is copied and the job fails at once.

``stats()`` counts the loads and stores submitted and those failed on purpose
(``FaultStats``); ``injected`` holds the failed job ids by direction.

``FaultConfig.parse(value, name)`` validates the mapping form used in configuration::

    {"seed": 1, "load_failure_rate": 0.1, "store_failure_rate": 0.1,
     "fail_loads": [0, 5], "fail_stores": []}

Every error is a ``ValueError`` naming the key and the bad value. Torch-free.
"""

from __future__ import annotations

import math
import random
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

from kvoffload.counters import Counters
from kvoffload.specs import MEDIUM_CPU, MEDIUM_DEVICE, CPULoadStoreSpec, DeviceLoadStoreSpec, LoadStoreSpec
from kvoffload.worker import OffloadingWorker, Route, TransferResult

LOAD = "load"
STORE = "store"
_DIRECTIONS: dict[Route, str] = {(MEDIUM_CPU, MEDIUM_DEVICE): LOAD, (MEDIUM_DEVICE, MEDIUM_CPU): STORE}
_KEYS = ("seed", "load_failure_rate", "store_failure_rate", "fail_loads", "fail_stores")
INJECTED_ERROR = "injected fault"


@dataclass(frozen=True)
class FaultConfig:
    """Which loads and stores fail (see the module docstring)."""

    seed: int = 0
    load_failure_rate: float = 0.0
    store_failure_rate: float = 0.0
    fail_loads: frozenset[int] = frozenset()
    fail_stores: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        _check_seed("seed", self.seed)
        for name in ("load_failure_rate", "store_failure_rate"):
            _check_rate(name, getattr(self, name))
        for name in ("fail_loads", "fail_stores"):
            object.__setattr__(self, name, _check_positions(name, getattr(self, name)))

    @classmethod
    def parse(cls, value: object, name: str = "fault_injection") -> FaultConfig:
        """A ``FaultConfig`` from its mapping form; errors name ``name[key]`` and the value."""
        if not isinstance(value, Mapping):
            raise ValueError(f"{name} must be a mapping of {list(_KEYS)}, got {value!r}")
        unknown = sorted(str(k) for k in set(value) - set(_KEYS))
        if unknown:
            raise ValueError(f"unknown {name} key(s) {unknown}; known: {list(_KEYS)}")
        seed = value.get("seed", 0)
        _check_seed(f"{name}['seed']", seed)
        rates = {}
        for key in ("load_failure_rate", "store_failure_rate"):
            rates[key] = _check_rate(f"{name}[{key!r}]", value.get(key, 0.0))
        positions = {}
        for key in ("fail_loads", "fail_stores"):
            positions[key] = _check_positions(f"{name}[{key!r}]", value.get(key, ()))
        return cls(seed, **rates, **positions)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_seed(name: str, value: object) -> int:
    if not _is_int(value):
        raise ValueError(f"{name} must be an int, got {value!r}")
    return value  # type: ignore[return-value]


def _check_rate(name: str, value: object) -> float:
    if (
        not isinstance(value, (int, float))
        or isinstance(value, bool)
        or not math.isfinite(value)
        or not 0 <= value <= 1
    ):
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")
    return float(value)


def _check_positions(name: str, value: object) -> frozenset[int]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise ValueError(f"{name} must be a list of job positions (ints >= 0), got {value!r}")
    items = list(value)
    for item in items:
        if not _is_int(item) or item < 0:
            raise ValueError(f"{name} must hold job positions (ints >= 0), got {item!r}")
    return frozenset(items)


@dataclass
class FaultStats(Counters):
    loads: int = 0  # loads submitted
    stores: int = 0  # stores submitted
    failed_loads: int = 0  # loads failed on purpose
    failed_stores: int = 0  # stores failed on purpose


@dataclass
class _Direction:
    rate: float
    positions: frozenset[int]
    rng: random.Random
    submitted: int = 0

    def fails(self) -> bool:
        position, self.submitted = self.submitted, self.submitted + 1
        # The draw is made for every job, so positions do not shift the random choices.
        drawn = self.rng.random() < self.rate
        return position in self.positions or drawn


@dataclass
class _Decoys:
    """Block ids of each medium seen in earlier jobs: wrong, in-range sources."""

    ids: dict[str, list[int]] = field(default_factory=dict)

    def remember(self, spec: LoadStoreSpec) -> None:
        if isinstance(spec, (CPULoadStoreSpec, DeviceLoadStoreSpec)) and len(spec.block_ids):
            self.ids[spec.medium] = [int(b) for b in spec.block_ids[:8]]

    def other_than(self, medium: str, block_id: int) -> int | None:
        return next((b for b in self.ids.get(medium, ()) if b != block_id), None)


class FaultInjectingWorker(OffloadingWorker):
    """``inner`` with chosen loads and stores failing after a misdirected copy."""

    def __init__(self, inner: OffloadingWorker, config: FaultConfig) -> None:
        self.inner = inner
        self.config = config
        self.routes = inner.routes
        seed = config.seed
        self._directions = {
            LOAD: _Direction(config.load_failure_rate, config.fail_loads, random.Random(f"{seed}:load")),
            STORE: _Direction(config.store_failure_rate, config.fail_stores, random.Random(f"{seed}:store")),
        }
        self._lock = threading.Lock()
        self._decoys = _Decoys()
        self._failing: dict[int, str] = {}  # job id -> direction, copying before it fails
        self._failed_now: list[TransferResult] = []  # failed without a copy
        self._stats = FaultStats()
        self.injected: dict[str, list[int]] = {LOAD: [], STORE: []}

    def submit(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        direction = _DIRECTIONS.get((src_spec.medium, dst_spec.medium))
        if direction is None:
            return self.inner.submit(job_id, src_spec, dst_spec)
        with self._lock:
            fails = self._directions[direction].fails()
            decoy_src = _misdirect(src_spec, self._decoys) if fails else None
            self._decoys.remember(src_spec)
            if direction == LOAD:
                self._stats.loads += 1
            else:
                self._stats.stores += 1
        if not fails:
            return self.inner.submit(job_id, src_spec, dst_spec)
        if decoy_src is not None:
            queued = self.inner.submit(job_id, decoy_src, dst_spec)
            with self._lock:
                self._count_injected(job_id, direction)
                if queued:
                    self._failing[job_id] = direction
                else:
                    self._failed_now.append(_failure(job_id, direction))
            return True
        with self._lock:
            self._count_injected(job_id, direction)
            self._failed_now.append(_failure(job_id, direction))
        return True

    def _count_injected(self, job_id: int, direction: str) -> None:
        self.injected[direction].append(job_id)
        if direction == LOAD:
            self._stats.failed_loads += 1
        else:
            self._stats.failed_stores += 1

    def poll(self) -> list[TransferResult]:
        results = self.inner.poll()
        with self._lock:
            out, self._failed_now = self._failed_now, []
            for result in results:
                direction = self._failing.pop(result.job_id, None)
                if direction is not None:
                    result = _failure(result.job_id, direction, result.seconds)
                out.append(result)
        return out

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> None:
        self.inner.wait(job_ids, timeout)  # jobs failed without a copy count as finished

    def close(self) -> None:
        self.inner.close()

    def stats(self) -> FaultStats:
        with self._lock:
            return self._stats.snapshot()


def _failure(job_id: int, direction: str, seconds: float = 0.0) -> TransferResult:
    return TransferResult(job_id, False, 0, seconds, direction, INJECTED_ERROR)


def _misdirect(spec: LoadStoreSpec, decoys: _Decoys) -> LoadStoreSpec | None:
    """``spec`` with every block id replaced by another block of its medium, or ``None``."""
    if not isinstance(spec, (CPULoadStoreSpec, DeviceLoadStoreSpec)):
        return None
    ids = np.asarray(spec.block_ids, dtype=np.int64)
    if len(ids) == 0:
        return None
    if len(np.unique(ids)) > 1:
        wrong = np.roll(ids, 1)  # not every block moves if ids repeat; most do
    else:
        other = decoys.other_than(spec.medium, int(ids[0]))
        if other is None:
            return None
        wrong = np.full_like(ids, other)
    if isinstance(spec, CPULoadStoreSpec):
        return CPULoadStoreSpec(wrong)
    return DeviceLoadStoreSpec(wrong, spec.group_sizes, spec.block_indices)
