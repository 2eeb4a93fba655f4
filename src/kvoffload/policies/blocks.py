"""Block states and recency lists: the per-key state of the CPU tier and its policies.

``BlockStatus`` is a block's slot and state (-1 being written, 0 idle, ``n > 0`` pinned).
``Order`` keeps keys in recency order, least recent first, each with its status;
``table`` is its dict key -> status, for reading (tests and tools look there). Its methods:

* ``insert_many(keys, statuses)``: new keys at the most recent end, in call order (a key
  present keeps its place and takes the new status); ``remove(key)`` (whether it was
  there); ``pop_many(keys)`` (absent ones ignored); ``clear()``; ``keys()``; ``len()``;
* ``move_to_end_reversed(keys)``: walk ``keys`` backwards moving the present ones to the
  most recent end (so ``keys[0]`` ends most recent); returns the absent ones, in order;
* ``evictable(limit, protected)``: up to ``limit`` keys, least recent first, that are idle
  (``ref == 0``) and not in ``protected``; changes nothing;
* ``take_from(other, keys)``: each of ``keys`` that ``other`` holds, in order, moved with
  its status to this order's most recent end; ``trim(bound)``: drop the least recent keys
  until at most ``bound`` are left;
* ARC's (``ARCPolicy`` says what they do), this order being T1, the ghost lists B1 and
  B2 orders too: ``arc_touch(t2, b1, b2, keys, target, capacity)`` returns T1's target
  size adapted to the ghost hits in the order it walks the keys (backwards);
  ``arc_insert(t2, b1, b2, keys, statuses)`` enters new keys (``KeyError`` for one
  resident already), a ghost's into T2; ``arc_evict(t2, b1, b2, n, protected, target,
  capacity)`` the ``n`` victims (T1's first while it exceeds ``target``), each list's to
  its ghost list (trimmed to ``capacity``), or ``None`` changing nothing. A key is in one
  of the four lists at most (``arc_insert`` keeps it so).

The manager's batch paths over its table (a dict key -> status), each all or nothing:
``lookup_prefix(table, keys) -> (hits, missed)``: the leading keys present and not in
flight, and whether an absent key ended them; ``pin(table, keys) -> (slots, newly_pinned)``
or ``None`` (nothing changed) when one is not a HIT; ``unpin(table, keys) -> newly_idle``
or ``None`` (nothing changed) when one is not pinned; ``complete(table, keys)``: the keys
in flight made idle, each once, in order; ``reserve(table, keys, slots)``: new in-flight
statuses, entered in the table, as a list; ``absent(table, keys)``: the keys not in the
table, each once, in order; ``release(table, keys, free)``: pop the keys (each must be
there), their slots appended to the list ``free`` in order.

All of it runs in C when ``kvoffload.policies._blocks`` was built (``NATIVE``), with the
same results; this module is the same in Python otherwise (a few times slower per key).
``PYTHON_VERSIONS`` keeps the Python ones either way. A status may be in one C order at a
time. The C walks read a subclass's ``ref`` through Python and test ``protected`` with
``in``: neither may change the order being walked.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Collection, Mapping, Sequence
from itertools import filterfalse, islice, repeat
from operator import attrgetter
from typing import Any

_ref = attrgetter("ref")
_slot = attrgetter("slot")


class BlockStatus:
    """A block's slot in its tier and its state: -1 being written, 0 idle, n>0 pinned."""

    __slots__ = ("slot", "ref")

    def __init__(self, slot: int, ref: int = -1) -> None:
        self.slot = slot
        self.ref = ref

    @property
    def is_ready(self) -> bool:
        return self.ref >= 0

    def __repr__(self) -> str:
        return f"BlockStatus(slot={self.slot}, ref={self.ref})"


def evictable_keys(order: Mapping[Any, BlockStatus], limit: int, protected: Collection[Any]) -> list[Any]:
    """Up to ``limit`` keys of ``order``, first to last, that are idle (``ref == 0``) and
    not in ``protected``. Changes nothing."""
    found: list[Any] = []
    if limit <= 0:
        return found
    # The common case, the first ``limit`` keys all evictable, checked in C loops.
    head = list(islice(order, limit))
    if len(head) == limit and not any(map(_ref, map(order.__getitem__, head))):
        if isinstance(protected, (set, frozenset)):
            clear = protected.isdisjoint(head)
        else:
            clear = not any(map(protected.__contains__, head))
        if clear:
            return head
    for key, status in order.items():
        if status.ref == 0 and key not in protected:
            found.append(key)
            if len(found) == limit:
                break
    return found


class Order:
    """Keys in recency order over an ``OrderedDict`` (the module docstring has the contract)."""

    def __init__(self) -> None:
        self.table: OrderedDict[Any, BlockStatus] = OrderedDict()

    def __len__(self) -> int:
        return len(self.table)

    def insert_many(self, keys: Sequence[Any], statuses: Sequence[BlockStatus]) -> None:
        if len(keys) != len(statuses):
            raise ValueError(f"{len(keys)} keys but {len(statuses)} statuses")
        self.table.update(zip(keys, statuses))

    def move_to_end_reversed(self, keys: Sequence[Any]) -> list[Any]:
        table = self.table
        deque(map(table.move_to_end, filter(table.__contains__, reversed(keys))), maxlen=0)
        return list(filterfalse(table.__contains__, keys))

    def evictable(self, limit: int, protected: Collection[Any]) -> list[Any]:
        return evictable_keys(self.table, limit, protected)

    def pop_many(self, keys: Sequence[Any]) -> None:
        deque(map(self.table.pop, keys, repeat(None)), maxlen=0)

    def remove(self, key: Any) -> bool:
        return self.table.pop(key, None) is not None

    def take_from(self, other: Order, keys: Sequence[Any]) -> None:
        table, source = self.table, other.table
        for key in keys:
            if key in source:
                table[key] = source.pop(key)
                table.move_to_end(key)

    def trim(self, bound: int) -> None:
        excess = len(self.table) - bound
        if excess > 0:  # the oldest ``excess`` keys, in a C loop
            deque(map(self.table.popitem, repeat(False, excess)), maxlen=0)

    def arc_touch(
        self, t2: Order, b1: Order, b2: Order, keys: Sequence[Any], target: float, capacity: float
    ) -> float:
        t1_table, t2_table = self.table, t2.table
        for key in reversed(keys):
            status = t1_table.get(key)
            if status is not None:
                if status.ref >= 0:
                    t2_table[key] = t1_table.pop(key)
                else:
                    t1_table.move_to_end(key)
            elif key in t2_table:
                t2_table.move_to_end(key)
            elif key in b1.table:
                target = min(target + max(1.0, len(b2) / len(b1)), capacity)
            elif key in b2.table:
                target = max(target - max(1.0, len(b1) / len(b2)), 0.0)
        return target

    def arc_insert(
        self, t2: Order, b1: Order, b2: Order, keys: Sequence[Any], statuses: Sequence[BlockStatus]
    ) -> None:
        if len(keys) != len(statuses):
            raise ValueError(f"{len(keys)} keys but {len(statuses)} statuses")
        for key, status in zip(keys, statuses):
            if key in self.table or key in t2.table:
                raise KeyError(f"{key!r} is resident already")
            ghost = b1.remove(key) or b2.remove(key)  # seen before: T2
            (t2 if ghost else self).table[key] = status

    def arc_evict(
        self,
        t2: Order,
        b1: Order,
        b2: Order,
        n: int,
        protected: Collection[Any],
        target: float,
        capacity: int,
    ) -> list[Any] | None:
        excess = len(self) - target  # each victim from T1 shrinks it by one
        from_t1 = self.evictable(min(n, math.ceil(excess)) if excess > 0 else 0, protected)
        from_t2 = t2.evictable(n - len(from_t1), protected)
        if len(from_t1) + len(from_t2) < n:
            from_t1 = self.evictable(n - len(from_t2), protected)
            if len(from_t1) + len(from_t2) < n:
                return None
        for ghosts, source, keys in ((b1, self, from_t1), (b2, t2, from_t2)):
            ghosts.take_from(source, keys)
            ghosts.trim(capacity)
        return from_t1 + from_t2

    def clear(self) -> None:
        self.table.clear()

    def keys(self) -> list[Any]:
        return list(self.table)


def lookup_prefix(table: Mapping[Any, BlockStatus], keys: Sequence[Any]) -> tuple[int, bool]:
    statuses = list(map(table.get, keys))
    end = statuses.index(None) if None in statuses else len(statuses)
    refs = list(map(_ref, statuses[:end]))
    if refs and min(refs) < 0:  # a store in flight ends the prefix
        return refs.index(min(refs)), False
    return end, end < len(statuses)


def pin(table: Mapping[Any, BlockStatus], keys: Sequence[Any]) -> tuple[list[int], int] | None:
    statuses = list(map(table.get, keys))
    if None in statuses or (statuses and min(map(_ref, statuses)) < 0):
        return None
    newly = 0
    for status in statuses:  # a key named twice is pinned twice
        newly += status.ref == 0
        status.ref += 1
    return list(map(_slot, statuses)), newly


def unpin(table: Mapping[Any, BlockStatus], keys: Sequence[Any]) -> int | None:
    done: list[BlockStatus] = []
    for key in keys:
        status = table.get(key)
        if status is None or status.ref <= 0:
            for status in done:  # all or nothing
                status.ref += 1
            return None
        status.ref -= 1
        done.append(status)
    return sum(status.ref == 0 for status in set(done))


def complete(table: Mapping[Any, BlockStatus], keys: Sequence[Any]) -> list[Any]:
    done = []
    for key in keys:
        status = table.get(key)
        if status is not None and status.ref == -1:
            status.ref = 0
            done.append(key)
    return done


def reserve(table: dict[Any, BlockStatus], keys: Sequence[Any], slots: Sequence[int]) -> list[BlockStatus]:
    if len(keys) != len(slots):
        raise ValueError(f"{len(keys)} keys but {len(slots)} slots")
    statuses = list(map(BlockStatus, slots))
    table.update(zip(keys, statuses))
    return statuses


def absent(table: Mapping[Any, BlockStatus], keys: Sequence[Any]) -> list[Any]:
    return list(filterfalse(table.__contains__, dict.fromkeys(keys)))


def release(table: dict[Any, BlockStatus], keys: Sequence[Any], free: list[int]) -> None:
    free += map(_slot, map(table.pop, keys))


# The Python versions, kept where the C ones replace them (tests compare the two).
PYTHON_VERSIONS = {
    "BlockStatus": BlockStatus,
    "Order": Order,
    "lookup_prefix": lookup_prefix,
    "pin": pin,
    "unpin": unpin,
    "complete": complete,
    "reserve": reserve,
    "absent": absent,
    "release": release,
}

try:
    from kvoffload.policies._blocks import (  # type: ignore[no-redef] # noqa: F401
        BlockStatus,
        Order,
        absent,
        complete,
        lookup_prefix,
        pin,
        release,
        reserve,
        unpin,
    )

    NATIVE = True
except ImportError:  # not built: the Python versions above
    NATIVE = False
