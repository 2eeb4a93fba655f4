"""Least-recently-used eviction.

``touch`` walks its keys in reverse, so the first block of a prefix ends up most recently
used and a prefix's tail is evicted before its head (a tail is useless without its head).
New keys enter as most recently used.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence

from kvoffload.keys import OffloadKey
from kvoffload.policies.base import BlockStatus, CachePolicy, evictable_keys


class LRUPolicy(CachePolicy):
    name = "lru"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._order: OrderedDict[OffloadKey, BlockStatus] = OrderedDict()

    def insert(self, key: OffloadKey, status: BlockStatus) -> None:
        self._order[key] = status

    def insert_many(self, keys: Sequence[OffloadKey], statuses: Sequence[BlockStatus]) -> None:
        self._order.update(zip(keys, statuses))

    def remove(self, key: OffloadKey) -> None:
        self._order.pop(key, None)

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        order = self._order
        move = order.move_to_end
        for key in reversed(keys):
            if key in order:
                move(key)

    def evict(self, n: int, protected: Collection[OffloadKey]) -> list[OffloadKey] | None:
        order = self._order
        victims = evictable_keys(order, n, protected)
        if len(victims) < n:
            return None
        for key in victims:
            del order[key]
        return victims

    def clear(self) -> None:
        self._order.clear()
