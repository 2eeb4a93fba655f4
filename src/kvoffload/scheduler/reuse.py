"""The reuse filter: store a block only once enough requests have asked for it.

A block asked for once and never again (a one-shot prompt, the unique tail of a
conversation) costs a copy and, once the tier is full, evicts a block that might have
been reused. ``ReuseFilter(threshold)`` lets a block be stored only after ``threshold``
requests asked for it; ``threshold=1`` stores everything and keeps no memory at all.

A request asks for a key when it first names it: the scheduler counts the blocks a
request touches at its first match and, once, each block it generated. The counts live in
a bounded memory of the ``memory`` keys counted most recently; a key forgotten starts
again from zero.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from kvoffload.keys import OffloadKey
from kvoffload.validation import positive_int

DEFAULT_MEMORY = 1 << 16


class ReuseFilter:
    """How many requests asked for each recently asked-for key; which may be stored."""

    def __init__(self, threshold: int = 1, memory: int = DEFAULT_MEMORY) -> None:
        self.threshold = positive_int("store_threshold", threshold)
        self.memory = positive_int("store_threshold memory", memory)
        self._counts: OrderedDict[OffloadKey, int] = OrderedDict()

    @property
    def active(self) -> bool:
        return self.threshold > 1

    def count(self, keys: Iterable[OffloadKey]) -> None:
        """One more request asked for each of ``keys``."""
        if not self.active:
            return
        counts = self._counts
        for key in keys:
            counts[key] = counts.pop(key, 0) + 1
        while len(counts) > self.memory:
            counts.popitem(last=False)

    def allows(self, key: OffloadKey) -> bool:
        """Whether ``key`` was asked for at least ``threshold`` times (as far as remembered)."""
        return self.threshold == 1 or self._counts.get(key, 0) >= self.threshold

    def __len__(self) -> int:
        return len(self._counts)
