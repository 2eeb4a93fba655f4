"""Admission rules for secondary tiers: which blocks written through from the CPU tier a
lower tier (disk) takes. A rule is a callable ``rule(key) -> bool`` given to
``TieredOffloadingManager(admit=[rule, ...])``, one per secondary tier (``None`` = every block).

``SeenTwice(capacity)`` is Dynamo KVBM's "only blocks seen at least twice go to disk". What
counts as *seen*: one call of the rule, i.e. one offer of the block to the tier. The tiered
manager offers a block each time a store of it completes in the CPU tier, so a block is
seen once per time it was computed by prefill and stored to host memory. The first offer is
declined; a later offer (the block missed in every tier, was recomputed and stored again) is
admitted. Counting lookups instead would change little here: a block is stored only when
it missed, and every earlier reference of it either stored it or hit a copy stored before.

The memory of keys seen is bounded: at most ``capacity`` keys, the least recently seen
forgotten first (a forgotten key counts as never seen). Every call refreshes the key.
"""

from __future__ import annotations

from collections import OrderedDict

from kvoffload.keys import OffloadKey
from kvoffload.validation import positive_int


class SeenTwice:
    """Admit a key iff it was seen (offered) before and not forgotten since."""

    def __init__(self, capacity: int) -> None:
        self.capacity = positive_int("capacity", capacity)
        self._seen: OrderedDict[OffloadKey, None] = OrderedDict()
        self.admitted = 0
        self.declined = 0

    def __call__(self, key: OffloadKey) -> bool:
        seen = self._seen
        if key in seen:
            seen.move_to_end(key)
            self.admitted += 1
            return True
        seen[key] = None
        if len(seen) > self.capacity:
            seen.popitem(last=False)
        self.declined += 1
        return False

    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is remembered; unlike a call it records nothing."""
        return key in self._seen

    def __len__(self) -> int:
        return len(self._seen)

    def clear(self) -> None:
        self._seen.clear()

    def __repr__(self) -> str:
        return f"SeenTwice(capacity={self.capacity}, remembered={len(self._seen)})"
