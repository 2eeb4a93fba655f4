"""Least-recently-used eviction, in prefix order where it knows the request.

``touch`` (a request's match) walks its keys in reverse, so the first block of a prefix
ends up most recently used and a prefix's tail is evicted before its head (a tail is
useless without its head). New keys enter as most recently used, in call order.

With the request hooks (``on_new_request`` / ``on_request_finished``, which the scheduler
always calls) it also keeps each request's blocks deepest least recent:

* while a request runs, the absent keys its touch named are reserved for it; when a
  store brings them in, the request's resident keys are walked in reverse once more, so
  its new blocks sit *below* the prefix it reused and no eviction takes that prefix
  before the suffix stored after it (otherwise the suffix would be above it). Keys of the
  same store that its touch did not name (blocks it generated) stay below that run;
* when it finishes, every key of the request is re-ranked at the most recent end,
  deepest least recent, by token position across KV-cache groups (as vLLM 0.32's LRU does
  at the end of a request). Until then a block stored on its own without a reservation
  (one generated while decoding) sits above its request's prefix.

Reservations are bounded (``max(capacity, 1024)`` keys; past that the older half is
dropped at once) and dropped when their key is stored. Without the hooks (a replay that
never announces requests) no reservation is made and the order is plain LRU over touches
and stores.

The order is a ``kvoffload.policies.blocks.Order`` (a C linked list through the block
statuses where ``kvoffload.policies._blocks`` was built): each step is one call into it.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence, Set
from itertools import islice, repeat

from kvoffload.keys import OffloadKey
from kvoffload.manager import RequestContext, prefix_order
from kvoffload.policies.base import BlockStatus, CachePolicy
from kvoffload.policies.blocks import Order


class LRUPolicy(CachePolicy):
    name = "lru"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._order = Order()  # least recently used first (a C list where built)
        self._resident = self._order.table  # key -> BlockStatus, for readers
        self._running: set[str] = set()  # announced requests not finished yet
        # absent key -> every key of the touch that named it (its request's run)
        self._reserved: dict[OffloadKey, tuple[OffloadKey, ...]] = {}
        self._reserve_limit = max(capacity, 1024)

    def insert(self, key: OffloadKey, status: BlockStatus) -> None:
        self.insert_many((key,), (status,))

    def insert_many(self, keys: Sequence[OffloadKey], statuses: Sequence[BlockStatus]) -> None:
        order = self._order
        order.insert_many(keys, statuses)
        reserved = self._reserved
        if not reserved:
            return
        runs = list(filter(None, map(reserved.pop, keys, repeat(None))))
        for run in dict(zip(map(id, runs), runs)).values():  # each run once, in C loops
            order.move_to_end_reversed(run)  # its resident keys, deepest first, to the recent end

    def remove(self, key: OffloadKey) -> None:
        self._order.remove(key)

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        absent = self._order.move_to_end_reversed(keys)  # deepest first
        if absent and self._running:
            reserved = self._reserved
            reserved.update(dict.fromkeys(absent, tuple(keys)))
            if len(reserved) > self._reserve_limit:  # forget the oldest half at once
                for key in list(islice(reserved, len(reserved) - self._reserve_limit // 2)):
                    del reserved[key]

    def on_new_request(self, request: RequestContext) -> None:
        self._running.add(request.request_id)

    def on_request_finished(
        self,
        request: RequestContext,
        key_groups: Sequence[Sequence[OffloadKey]],
        inserted: Set[OffloadKey],
        reused: Set[OffloadKey],
    ) -> None:
        self._running.discard(request.request_id)
        self._order.move_to_end_reversed(prefix_order(request, key_groups))

    def evict(self, n: int, protected: Collection[OffloadKey]) -> list[OffloadKey] | None:
        if n <= 0:
            return []
        order = self._order
        if n > len(order):
            return None
        victims = order.evictable(n, protected)
        if len(victims) < n:
            return None
        order.pop_many(victims)
        return victims

    def clear(self) -> None:
        self._order.clear()
        self._running.clear()
        self._reserved.clear()
