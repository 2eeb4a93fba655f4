"""Belady's offline optimum with bypass: the ceiling of any online eviction policy.

Offline only — it reads the whole future, so it lives in the simulator, not among the
``CachePolicy`` classes. It replays key lists with the same protocol as
``kvoffload.sim.replay`` (count leading hits, then store the rest) in a cache of
``capacity`` blocks where each key may be stored or bypassed:

* every cached key is ranked by its next use (the index of the next request naming it);
  ties are broken toward the key's later position in its request, so that a chain's tail
  goes before its head;
* a missing key is stored only when the cache has room or when the cached key with the
  furthest next use is used later than the candidate (that key is then evicted); a key
  never used again is never stored.

For prefix-chained keys (a key always follows the same parent, so a parent's next use is
never later than its child's) the cache stays closed under prefixes, every cached key of a
request is part of its hit prefix, and the hit count equals the key-level optimum: no
online policy driven by the same protocol at the same capacity can hit more.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Hashable, Sequence

from kvoffload.sim.replay import ReplayResult
from kvoffload.validation import non_negative_int

_NEVER = 1 << 62


def next_uses(key_lists: Sequence[Sequence[Hashable]]) -> list[list[int]]:
    """For each request and position, the index of the next request naming that key."""
    following: dict[Hashable, int] = {}
    out: list[list[int]] = [[] for _ in key_lists]
    for index in range(len(key_lists) - 1, -1, -1):
        keys = key_lists[index]
        out[index] = [following.get(key, _NEVER) for key in keys]
        for key in keys:
            following[key] = index
    return out


def replay_belady(key_lists: Sequence[Sequence[Hashable]], capacity: int) -> ReplayResult:
    """Replay ``key_lists`` through an offline-optimal cache of ``capacity`` blocks."""
    start = time.perf_counter()
    hits, stored, evicted = belady_hits(key_lists, capacity)
    total = sum(len(keys) for keys in key_lists)
    return ReplayResult(len(key_lists), total, sum(hits), stored, evicted, time.perf_counter() - start)


def belady_hits(key_lists: Sequence[Sequence[Hashable]], capacity: int) -> tuple[list[int], int, int]:
    """Per-request hit-prefix lengths, keys stored and keys evicted of the offline optimum."""
    non_negative_int("capacity", capacity)
    future = next_uses(key_lists)
    # cached key -> its current rank; the heap holds (-next_use, -position, key) entries,
    # stale ones (rank no longer current) are skipped when they surface.
    rank: dict[Hashable, tuple[int, int]] = {}
    heap: list[tuple[int, int, Hashable]] = []
    push, pop = heapq.heappush, heapq.heappop
    per_request: list[int] = []
    stored = evicted = 0
    for keys, nexts in zip(key_lists, future):
        hit = 0
        for key in keys:
            if key not in rank:
                break
            hit += 1
        per_request.append(hit)
        seen_here: set[Hashable] = set()
        for pos, (key, nxt) in enumerate(zip(keys, nexts)):
            if key in seen_here:  # a key named twice keeps its first ranking
                continue
            seen_here.add(key)
            if key in rank:
                rank[key] = (nxt, pos)
                push(heap, (-nxt, -pos, key))
                continue
            if nxt == _NEVER or capacity == 0:
                continue
            if len(rank) >= capacity:
                while True:
                    neg_next, neg_pos, victim = heap[0]
                    if rank.get(victim) == (-neg_next, -neg_pos):
                        break
                    pop(heap)
                if (-neg_next, -neg_pos) <= (nxt, pos):
                    continue  # bypass: the candidate is needed no sooner than any cached key
                pop(heap)
                del rank[victim]
                evicted += 1
            rank[key] = (nxt, pos)
            push(heap, (-nxt, -pos, key))
            stored += 1
    return per_request, stored, evicted
