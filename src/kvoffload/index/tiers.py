"""The four tiers the index tells apart, how wire events name them, and their weights.

Contract:

* Tiers are small ints ordered by how cheaply an engine reuses a block from them:
  ``DEVICE`` (0, the engine's own prefix cache), ``HOST`` (1, CPU memory), ``DISK`` (2,
  storage local to the engine) and ``SHARED`` (3, storage shared between engines).
  ``TIER_NAMES`` are their names in JSON (``"gpu"``, ``"cpu"``, ``"disk"``, ``"shared"``).
* ``tier_of(medium, locality)`` maps an event's ``medium``/``locality`` to a tier, or
  ``None`` for a medium the index does not know (the event is counted and skipped):
  ``None`` and ``"GPU"`` are the device (vLLM's prefix-cache events carry no medium),
  ``"CPU"`` (and SGLang's ``"CPU_PINNED"``) the host; ``"STORAGE"`` is the disk unless
  its locality is ``"REMOTE"``, which makes it shared (kvoffload's disk tier announces
  ``STORAGE``/``LOCAL``); SGLang's ``"DISK"`` and ``"EXTERNAL"`` are disk and shared.
  Case is ignored.
* ``TierWeights`` holds one weight per tier, each in ``[0, 1]``; the defaults are device
  1.0, host 0.75, disk 0.25, shared 0.5. ``TierWeights.parse("host=0.5,disk=0.1")``
  reads the CLI form and names a bad key or value.
"""

from __future__ import annotations

import math
from dataclasses import astuple, dataclass

DEVICE, HOST, DISK, SHARED = 0, 1, 2, 3
TIERS: tuple[int, ...] = (DEVICE, HOST, DISK, SHARED)
TIER_NAMES: tuple[str, ...] = ("gpu", "cpu", "disk", "shared")
BITS_PER_ENGINE = len(TIERS)  # one presence bit per tier in each engine's nibble

_BY_MEDIUM: dict[str | None, int] = {
    None: DEVICE,
    "GPU": DEVICE,
    "CPU": HOST,
    "CPU_PINNED": HOST,
    "STORAGE": DISK,
    "DISK": DISK,
    "EXTERNAL": SHARED,
}
# Resolved (medium, locality) pairs as they come off the wire, so the hot path is one lookup.
_CACHE: dict[tuple[str | None, str | None], int | None] = {}


def tier_of(medium: str | None, locality: str | None = None) -> int | None:
    """The tier an event's ``medium`` and ``locality`` name, ``None`` if unknown."""
    key = (medium, locality)
    try:
        return _CACHE[key]
    except KeyError:
        pass
    except TypeError:  # unhashable garbage from a foreign publisher
        return None
    tier = _resolve(medium, locality)
    if len(_CACHE) < 1024:  # bounded: a publisher may send any strings
        _CACHE[key] = tier
    return tier


def _resolve(medium: object, locality: object) -> int | None:
    if medium is not None and not isinstance(medium, str):
        return None
    tier = _BY_MEDIUM.get(medium if medium is None else medium.upper())
    if tier == DISK and isinstance(locality, str) and locality.upper() == "REMOTE":
        return SHARED
    return tier


@dataclass(frozen=True)
class TierWeights:
    """How much a matched block is worth, by the tier it would be loaded from."""

    device: float = 1.0
    host: float = 0.75
    disk: float = 0.25
    shared: float = 0.5

    def __post_init__(self) -> None:
        for name, value in zip(("device", "host", "disk", "shared"), astuple(self)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"tier weight {name} must be a number in [0, 1], got {value!r}")
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"tier weight {name} must be in [0, 1], got {value!r}")

    def by_tier(self) -> tuple[float, float, float, float]:
        return (self.device, self.host, self.disk, self.shared)

    @classmethod
    def parse(cls, text: str) -> TierWeights:
        """Weights from ``"host=0.5,disk=0.1"``; tiers not named keep their defaults. The
        JSON names (``gpu``, ``cpu``) are accepted as well."""
        aliases = {"gpu": "device", "cpu": "host"}
        values: dict[str, float] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            name, sep, raw = part.partition("=")
            name = aliases.get(name.strip(), name.strip())
            if not sep or name not in ("device", "host", "disk", "shared"):
                raise ValueError(
                    f"tier weight must look like host=0.75 (tiers device, host, disk, shared), got {part!r}"
                )
            try:
                values[name] = float(raw)
            except ValueError:
                raise ValueError(f"tier weight {name} must be a number, got {raw.strip()!r}") from None
        return cls(**values)
