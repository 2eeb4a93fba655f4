"""The eviction-policy interface used by the tier managers.

A policy orders the resident keys of one tier and decides which to evict; the manager
owns slots, states and events. The manager tells the policy about every key it inserts
(``insert``, state ``-1`` while the store is in flight) and every key it drops without
eviction (``remove``); the policy reads each block's ``ref`` to skip blocks that cannot be
evicted: in flight (``-1``) or pinned (``> 0``).

``evict(n, protected)`` is all-or-nothing: it returns ``n`` evictable keys not in
``protected`` (and forgets them), or ``None`` and changes nothing. ``protected`` is only
tested with ``in``: the manager passes the keys of the store and, while sessions retain
blocks, the retained ones (``kvoffload.retention``), which a policy passes over as over
pinned blocks, keeping their place. It returns at once
(``[]`` for ``n <= 0``, ``None`` when it tracks fewer than ``n`` keys) without looking at a
block; ``CPUOffloadingManager`` counts its idle blocks and does not ask when it has fewer
than ``n``.

Request lifecycle: the manager passes on ``on_new_request`` and ``on_request_finished``
(``kvoffload.manager`` says when they fire and what they hold); both do nothing by
default, and a policy must ignore keys and requests it does not know (``clear`` forgets
everything, and hooks name keys that may have been evicted).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Mapping, Sequence, Set

from kvoffload.keys import OffloadKey
from kvoffload.manager import RequestContext
from kvoffload.policies.blocks import BlockStatus, evictable_keys
from kvoffload.validation import non_negative_int

__all__ = ["BlockStatus", "CachePolicy", "evictable_keys", "first_evictable"]


class CachePolicy(ABC):
    """Eviction order of one tier's resident keys."""

    name: str = ""
    # False for policies whose ``admit`` may decline keys; the manager skips the call
    # otherwise, keeping the hot path free of it.
    admits_all: bool = True

    def __init__(self, capacity: int) -> None:
        self.capacity = non_negative_int("capacity", capacity)

    @abstractmethod
    def insert(self, key: OffloadKey, status: BlockStatus) -> None:
        """A new resident key (its store is in flight)."""

    def insert_many(self, keys: Sequence[OffloadKey], statuses: Sequence[BlockStatus]) -> None:
        """``insert`` for each pair, in order; policies may override it for speed."""
        for key, status in zip(keys, statuses):
            self.insert(key, status)

    @abstractmethod
    def remove(self, key: OffloadKey) -> None:
        """Forget a resident key dropped without eviction (a failed store)."""

    @abstractmethod
    def touch(self, keys: Sequence[OffloadKey]) -> None:
        """A use of ``keys``, in request order; keys not resident are allowed."""

    @abstractmethod
    def evict(self, n: int, protected: Collection[OffloadKey]) -> list[OffloadKey] | None:
        """Choose and forget ``n`` evictable keys outside ``protected``, or ``None``."""

    @abstractmethod
    def clear(self) -> None:
        """Forget everything, history included."""

    def admit(self, key: OffloadKey) -> bool:
        """Whether ``key`` should be stored at all (only asked when ``admits_all`` is false)."""
        return True

    def on_new_request(self, request: RequestContext) -> None:
        """A request starts; the default does nothing."""

    def on_request_finished(
        self,
        request: RequestContext,
        key_groups: Sequence[Sequence[OffloadKey]],
        inserted: Set[OffloadKey],
        reused: Set[OffloadKey],
    ) -> None:
        """A request ended; the default does nothing."""


def first_evictable(
    order: Mapping[OffloadKey, BlockStatus], protected: Collection[OffloadKey]
) -> OffloadKey | None:
    """The first idle key of ``order`` not in ``protected``, or ``None``."""
    for key, status in order.items():
        if status.ref == 0 and key not in protected:
            return key
    return None
