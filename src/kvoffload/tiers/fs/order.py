"""Eviction order of the disk tier's slots.

The tier's ``cache_policy`` goes through the policy registry (``resolve_policy``). How the
order is kept depends on what it resolves to:

* ``SlotLRU`` (for ``LRUPolicy``, the registry's ``"lru"``): the same order as
  ``LRUPolicy`` (see there: new keys enter most recent in call order; ``touch`` walks its
  keys in reverse, so a prefix's tail goes before its head; while requests run, absent
  touched keys are reserved for their request's run, bounded as ``LRUPolicy``'s are; a
  finished request is re-ranked deepest least recent; eviction takes the least recent
  idle blocks) kept as a doubly linked list in two ``int32`` arrays indexed by slot: 8
  bytes per block, no Python object per block. A test runs both side by side. Where the
  index probes in C (``SlotIndex.native``), a touch, a re-ranking or an eviction is one C
  call too (``_slotfind.Links``: probe and move every key; walk to the idle ones), so a
  touch that misses the tier costs what ``LRUPolicy``'s own steps cost.
* ``PolicyOrder`` (any other ``CachePolicy``): the policy itself, fed one small status
  object per block whose ``ref`` reads the manager's state array. It costs what the
  policy costs per key (a few hundred bytes), so it misses the 100-bytes-per-block index
  target; the benchmark measures both.

Both answer ``evict(n, protected_keys, protected_slots)`` with the slots of ``n`` idle
blocks outside the protected ones (forgotten by the order), or ``None`` changing nothing.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from functools import partial
from itertools import islice, repeat

import numpy as np

from kvoffload.keys import OffloadKey
from kvoffload.manager import RequestContext, prefix_order
from kvoffload.policies import CachePolicy, LRUPolicy
from kvoffload.tiers.fs.index import SlotIndex, _slotfind


class SlotLRU:
    """``LRUPolicy``'s order over slots: an int32 doubly linked list (sentinel at index
    ``num_slots``), plus ``LRUPolicy``'s bounded reservations and request re-ranking."""

    admits_all = True

    def __init__(self, num_slots: int, index: SlotIndex, state: memoryview) -> None:
        self._state = state
        self._sentinel = num_slots
        self._prev_array = np.full(num_slots + 1, num_slots, dtype=np.int32)
        self._next_array = np.full(num_slots + 1, num_slots, dtype=np.int32)
        self._prev = memoryview(self._prev_array)
        self._next = memoryview(self._next_array)
        self._evict_native = None
        if index.finder is not None:
            links = _slotfind.Links(self._prev_array, self._next_array)
            self._to_end = partial(links.move_to_end, index.finder)
            self._evict_native = partial(links.evict, state)
        else:
            self._to_end = self._to_end_python
            self._split = index.split
        self._running: set[str] = set()  # announced requests not finished yet
        # absent key -> every key of the touch that named it (its request's run)
        self._reserved: dict[OffloadKey, tuple[OffloadKey, ...]] = {}
        self._reserve_limit = max(num_slots, 1024)

    @property
    def nbytes(self) -> int:
        return self._prev_array.nbytes + self._next_array.nbytes

    def admit(self, key: OffloadKey) -> bool:
        return True

    def _append(self, slot: int) -> None:
        prev, nxt, s = self._prev, self._next, self._sentinel
        last = prev[s]
        nxt[last] = slot
        prev[slot] = last
        nxt[slot] = s
        prev[s] = slot

    def _unlink(self, slot: int) -> None:
        prev, nxt = self._prev, self._next
        p, n = prev[slot], nxt[slot]
        nxt[p] = n
        prev[n] = p

    def _to_end_python(self, keys: Sequence[OffloadKey]) -> list[OffloadKey]:
        """Move the resident ones of ``keys``, walked in reverse, to the most recent end;
        return the absent ones in order (``_slotfind.Links.move_to_end`` in Python)."""
        slots, absent = self._split(keys)
        prev, nxt, s = self._prev, self._next, self._sentinel
        for slot in reversed(slots):
            p, n = prev[slot], nxt[slot]
            nxt[p] = n
            prev[n] = p
            last = prev[s]
            nxt[last] = slot
            prev[slot] = last
            nxt[slot] = s
            prev[s] = slot
        return absent

    def insert(self, keys: Sequence[OffloadKey], slots: Sequence[int]) -> None:
        if len(slots) < 16:
            for slot in slots:
                self._append(slot)
        else:  # the chain linked at the most recent end in one go
            chain = np.asarray(slots, dtype=np.int32)
            prev, nxt, s = self._prev_array, self._next_array, self._sentinel
            last = int(prev[s])
            nxt[last] = chain[0]
            prev[chain[0]] = last
            nxt[chain[:-1]] = chain[1:]
            prev[chain[1:]] = chain[:-1]
            nxt[chain[-1]] = s
            prev[s] = chain[-1]
        reserved = self._reserved
        if not reserved:
            return
        runs = {id(run): run for run in map(reserved.pop, keys, repeat(None)) if run is not None}
        for run in runs.values():
            self._to_end(run)

    def remove(self, key: OffloadKey, slot: int) -> None:
        self._unlink(slot)

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        absent = self._to_end(keys)
        if absent and self._running:
            reserved = self._reserved
            reserved.update(dict.fromkeys(absent, tuple(keys)))
            if len(reserved) > self._reserve_limit:  # forget the oldest half at once
                for key in list(islice(reserved, len(reserved) - self._reserve_limit // 2)):
                    del reserved[key]

    def on_new_request(self, request: RequestContext) -> None:
        self._running.add(request.request_id)

    def on_request_finished(self, request: RequestContext, key_groups, inserted, reused) -> None:
        self._running.discard(request.request_id)
        self._to_end(prefix_order(request, key_groups))

    def evict(
        self, n: int, protected_keys: Collection[OffloadKey], protected_slots: Collection[int]
    ) -> list[int] | None:
        if self._evict_native is not None:
            return self._evict_native(n, protected_slots)
        nxt, state, s = self._next, self._state, self._sentinel
        victims: list[int] = []
        if n <= 0:
            return victims
        slot = nxt[s]
        while slot != s:
            if state[slot] == 0 and slot not in protected_slots:
                victims.append(slot)
                if len(victims) == n:
                    break
            slot = nxt[slot]
        if len(victims) < n:
            return None
        for slot in victims:
            self._unlink(slot)
        return victims

    def clear(self) -> None:
        self._prev_array.fill(self._sentinel)
        self._next_array.fill(self._sentinel)
        self._running.clear()
        self._reserved.clear()


class _SlotStatus:
    """What a ``CachePolicy`` reads of a block: ``ref``, live from the state array."""

    __slots__ = ("slot", "_state")

    def __init__(self, slot: int, state: memoryview) -> None:
        self.slot = slot
        self._state = state

    @property
    def ref(self) -> int:
        return self._state[self.slot]


class PolicyOrder:
    """Any registered ``CachePolicy`` ordering the disk tier's keys."""

    def __init__(self, policy: CachePolicy, index: SlotIndex, state: memoryview) -> None:
        self.policy = policy
        self._index = index
        self._state = state
        self.admits_all = policy.admits_all

    nbytes = 0  # the policy's own per-key structures; measured, not computed

    def admit(self, key: OffloadKey) -> bool:
        return self.policy.admit(key)

    def insert(self, keys: Sequence[OffloadKey], slots: Sequence[int]) -> None:
        state = self._state
        self.policy.insert_many(keys, [_SlotStatus(slot, state) for slot in slots])

    def remove(self, key: OffloadKey, slot: int) -> None:
        self.policy.remove(key)

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        self.policy.touch(keys)

    def evict(
        self, n: int, protected_keys: Collection[OffloadKey], protected_slots: Collection[int]
    ) -> list[int] | None:
        victims = self.policy.evict(n, protected_keys)
        if victims is None:
            return None
        return [self._index.find(key) for key in victims]

    def on_new_request(self, request: RequestContext) -> None:
        self.policy.on_new_request(request)

    def on_request_finished(self, request: RequestContext, key_groups, inserted, reused) -> None:
        self.policy.on_request_finished(request, key_groups, inserted, reused)

    def clear(self) -> None:
        self.policy.clear()


def make_order(policy_cls: type[CachePolicy], num_slots: int, index: SlotIndex, state: memoryview):
    """``SlotLRU`` for ``LRUPolicy`` itself, ``PolicyOrder`` for every other policy."""
    if policy_cls is LRUPolicy:
        return SlotLRU(num_slots, index, state)
    return PolicyOrder(policy_cls(num_slots), index, state)
