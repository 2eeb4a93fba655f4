"""The scheduler-side contract of one offloading tier.

An ``OffloadingManager`` keeps the bookkeeping of one medium (host memory, disk, a remote
store): which keys are loadable, which are being written, which are pinned by loads, and
what to evict. It never moves bytes and never blocks; the worker side does the copies
described by the ``LoadStoreSpec`` objects it hands out.

Block state is one integer per key: ``-1`` being written (neither loadable nor
evictable), ``0`` idle (evictable), ``n > 0`` pinned by ``n`` loads.

Transfers between tiers: a manager that stacks tiers (``kvoffload.tiers.tiered``) also
moves blocks between them in the background (write-through, promotion). It hands those
copies out through ``take_transfers`` (each a ``TierTransfer``: a spec pair and a token);
the scheduler gives them job ids, the worker runs them, and ``complete_transfer(token,
success)`` reports each back. A single tier has none.

Events: an ``OffloadingEvent`` says which keys became loadable (``removed=False``) or were
dropped (``removed=True``) in one medium. It carries no block size: block size belongs to
a KV-cache group, and the scheduler, which knows each key's group, fills it in when it
converts events to the wire format.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvoffload.keys import OffloadKey
from kvoffload.specs import LoadStoreSpec  # re-exported: part of the contract


class LookupResult(enum.Enum):
    """Answer of ``OffloadingManager.lookup`` for one key."""

    HIT = "hit"  # loadable now
    PENDING = "pending"  # a store of this key is in flight
    MISS = "miss"  # not held
    RETRY = "retry"  # cannot tell yet; ask again next step


@dataclass(frozen=True)
class PrepareStoreOutput:
    """What ``prepare_store`` reserved.

    ``keys_to_store`` are the keys the caller must now write, in call order, into the
    slots of ``store_spec`` (same order); ``evicted_keys`` were dropped to make room.
    """

    keys_to_store: list[OffloadKey]
    store_spec: LoadStoreSpec
    evicted_keys: list[OffloadKey]


@dataclass(frozen=True)
class OffloadingEvent:
    """Keys that became loadable (``removed=False``) or were dropped in ``medium``."""

    keys: list[OffloadKey]
    medium: str
    removed: bool


@dataclass(frozen=True)
class TierTransfer:
    """A copy between two tiers that the manager needs done; ``token`` names it back."""

    token: int
    src_spec: LoadStoreSpec
    dst_spec: LoadStoreSpec


@dataclass(frozen=True)
class TierStats:
    """A snapshot of one tier. Counters (hits, misses, evictions) count since creation."""

    medium: str
    capacity: int
    used: int
    in_flight: int
    pinned: int
    hits: int
    misses: int
    evictions: int


class OffloadingManager(ABC):
    """Bookkeeping of one offloading tier. Single-threaded; never blocks."""

    medium: str = ""

    @abstractmethod
    def lookup(self, key: OffloadKey) -> LookupResult:
        """Whether ``key`` is loadable now. Never changes recency."""

    def lookup_prefix(self, keys: Iterable[OffloadKey]) -> int:
        """How many leading keys are ``HIT``s."""
        count = 0
        for key in keys:
            if self.lookup(key) is not LookupResult.HIT:
                break
            count += 1
        return count

    @abstractmethod
    def prepare_load(self, keys: Sequence[OffloadKey]) -> LoadStoreSpec:
        """Pin every key (each must be a ``HIT``) and say where they are, in key order.

        A key named twice is pinned twice. Raises ``KeyError`` naming the first key that is
        not a ``HIT``; nothing is pinned then.
        """

    @abstractmethod
    def touch(self, keys: Sequence[OffloadKey]) -> None:
        """Record a use of ``keys`` (absent keys are allowed) for the eviction policy."""

    @abstractmethod
    def complete_load(self, keys: Sequence[OffloadKey]) -> None:
        """Unpin keys pinned by ``prepare_load``. Raises if a key is not pinned."""

    @abstractmethod
    def prepare_store(self, keys: Sequence[OffloadKey]) -> PrepareStoreOutput | None:
        """Reserve slots for the keys not yet present (ready or in flight).

        Evicts idle blocks if needed, never one named in ``keys``. Atomic: returns ``None``
        and changes nothing when room cannot be made.
        """

    @abstractmethod
    def complete_store(self, keys: Sequence[OffloadKey], success: bool = True) -> None:
        """Finish stores: success makes in-flight keys loadable (one event); failure frees
        them silently. Keys not in flight are ignored."""

    @abstractmethod
    def take_events(self) -> list[OffloadingEvent]:
        """Drain the queued events, oldest first."""

    @abstractmethod
    def reset(self) -> None:
        """Drop every block."""

    @abstractmethod
    def stats(self) -> TierStats:
        """A snapshot of occupancy and counters."""

    def discard(self, keys: Sequence[OffloadKey]) -> None:
        """Drop the idle ones among ``keys`` (found unreadable or corrupt by a read that
        failed and was completed): they become misses and one ``removed=True`` event lists
        them. Keys still being written or pinned by other reads stay; absent keys are
        ignored."""
        raise NotImplementedError(f"{type(self).__name__} cannot discard blocks")

    def take_transfers(self) -> list[TierTransfer]:
        """Copies between tiers to start now (none for a single tier)."""
        return []

    def complete_transfer(self, token: int, success: bool) -> None:
        """The outcome of a ``TierTransfer``; unknown tokens raise ``KeyError``."""
        raise KeyError(f"unknown tier transfer {token}")

    def close(self) -> None:
        """Release resources held by the tier."""
