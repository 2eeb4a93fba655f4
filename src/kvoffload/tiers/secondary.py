"""Secondary tier types: what a ``secondary_tiers`` entry names and how it is built.

Configuration has vLLM 0.32's shape: ``secondary_tiers: [{"type": "fs", "root_dir": ...,
"bytes_to_use": ...}, ...]``. ``type`` is a registered name (``"fs"``) or, for a tier
outside kvoffload, ``"package.module:ClassName"`` naming a ``SecondaryTierType`` subclass.

A ``SecondaryTierType`` does three things, each from the validated options it parsed:

* ``parse(options)`` -> an instance holding the validated settings (``ValueError`` naming
  the key and the bad value; unknown keys are errors). It has no side effects: folders,
  servers and secrets are touched when the tier is built (a table of ``kvoffload.settings``
  declares a built-in tier's keys);
* ``build_manager(context)`` -> the scheduler-side ``OffloadingManager`` (index in memory);
* ``build_worker(context, host_pool)`` -> the worker-side ``OffloadingWorker`` moving blocks
  between the host pool and the tier.

``TierContext`` tells a tier what it stores: the payload bytes of one offloaded block and
the identity of those bytes (model, dtype, KV layout, block size, group specs, hash seed;
JSON-serialisable), from which a tier derives the namespace that keeps engines with other
layouts apart (e.g. ``kvoffload.tiers.fs.namespace.fs_namespace``).
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvoffload.manager import OffloadingManager
from kvoffload.worker import OffloadingWorker

if TYPE_CHECKING:
    from kvoffload.transfer.host_pool import HostBlockPool

# name -> "module:Class", imported on use so that a tier's dependencies load only when used
_BUILTIN = {
    "fs": "kvoffload.tiers.fs.tier:FSTierType",
    "redis": "kvoffload.tiers.redis.tier:RedisTierType",
    "mooncake": "kvoffload.tiers.mooncake.tier:MooncakeTierType",
    "s3": "kvoffload.tiers.s3.tier:S3TierType",
}


@dataclass(frozen=True)
class TierContext:
    """What a secondary tier stores: ``block_bytes`` of payload per offloaded block, whose
    meaning ``identity`` describes (JSON-serialisable). ``world_size`` workers (tensor or
    pipeline parallel ranks) each hold their own ``block_bytes`` of every block; ``rank``
    is the worker's (0 on the scheduler side). A tier keeps each rank's share apart
    (``rank_identity``), counts its byte budget over all of them, and its manager holds
    a block only when every rank's share is stored."""

    block_bytes: int
    identity: Mapping[str, Any] = field(default_factory=dict)
    rank: int = 0
    world_size: int = 1

    def __post_init__(self) -> None:
        if not (isinstance(self.world_size, int) and self.world_size >= 1):
            raise ValueError(f"world_size must be a positive int, got {self.world_size!r}")
        if not (isinstance(self.rank, int) and 0 <= self.rank < self.world_size):
            raise ValueError(f"rank must be in [0, {self.world_size}), got {self.rank!r}")

    def rank_identity(self, rank: int | None = None) -> dict[str, Any]:
        """The identity of one rank's share (default: this worker's)."""
        return {**self.identity, "rank": self.rank if rank is None else rank}

    def rank_identities(self) -> list[dict[str, Any]]:
        """Every rank's, rank 0 first."""
        return [self.rank_identity(r) for r in range(self.world_size)]


class SecondaryTierType(ABC):
    """One configured secondary tier (see the module docstring)."""

    type_name: str = ""

    @classmethod
    @abstractmethod
    def parse(cls, options: Mapping[str, Any]) -> SecondaryTierType:
        """Validate ``options`` (the entry without ``type``), touching nothing outside."""

    @abstractmethod
    def build_manager(self, context: TierContext, eviction_policy: str) -> OffloadingManager:
        """The scheduler-side manager of this tier."""

    @abstractmethod
    def build_worker(self, context: TierContext, host_pool: HostBlockPool) -> OffloadingWorker:
        """The worker that moves blocks between ``host_pool`` and this tier."""


def tier_type(name: str) -> type[SecondaryTierType]:
    """The tier class for a registered name or a ``package.module:ClassName`` path."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"secondary tier type must be a name or 'module:Class', got {name!r}")
    path = _BUILTIN.get(name, name)
    if ":" not in path:
        raise ValueError(
            f"unknown secondary tier type {name!r}; known: {', '.join(sorted(_BUILTIN))} "
            "(or give 'package.module:ClassName')"
        )
    module_name, _, attr = path.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot import secondary tier type {name!r}: {exc}") from exc
    if not (isinstance(cls, type) and issubclass(cls, SecondaryTierType)):
        raise ValueError(f"secondary tier type {name!r} is not a SecondaryTierType subclass")
    return cls


def parse_secondary_tiers(entries: Any) -> tuple[SecondaryTierType, ...]:
    """Validate a ``secondary_tiers`` list; errors name the entry, the key and the value."""
    if not isinstance(entries, (list, tuple)):
        raise ValueError(f"secondary_tiers must be a list of tier settings, got {entries!r}")
    tiers = []
    for i, entry in enumerate(entries):
        where = f"secondary_tiers[{i}]"
        if not isinstance(entry, Mapping):
            raise ValueError(f"{where} must be a dict with a 'type', got {entry!r}")
        if "type" not in entry:
            raise ValueError(f"{where} has no 'type' (e.g. 'fs')")
        options = {k: v for k, v in entry.items() if k != "type"}
        try:
            tiers.append(tier_type(entry["type"]).parse(options))
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
    return tuple(tiers)
