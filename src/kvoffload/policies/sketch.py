"""A count-min frequency sketch with periodic aging, as TinyLFU uses it (Einziger et al.).

``FrequencySketch(capacity)`` estimates how often each key was seen recently in a fixed
amount of memory: four rows of small saturating counters (at most 15), each row indexed
by an independent hash; the estimate is the smallest of a key's four counters, so it may
over-count (collisions) but never under-counts since the last aging. Aging keeps the
history recent: after ``sample_factor * capacity`` increments every counter is halved, so
a key that stops being used loses its weight geometrically.

Hashing is deterministic (no use of Python's per-process ``hash`` of bytes), so replays
are reproducible across runs. ``counts()`` is the rows of counters as bytes (for tests).

Where ``kvoffload.policies._blocks`` was built, ``FrequencySketch`` is a subclass of its C
``Sketch`` (the same counts, hashing and aging); ``PYTHON_VERSIONS`` keeps this one.
"""

from __future__ import annotations

from collections.abc import Hashable

from kvoffload.policies.blocks import NATIVE
from kvoffload.validation import non_negative_int, positive_int

_MASK64 = (1 << 64) - 1
_MERSENNE61 = (1 << 61) - 1
# Odd 64-bit multipliers, one per row (multiplicative hashing takes the top bits).
_ROW_SEEDS = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93)
_MAX_COUNT = 15
_HALVE = bytes(v >> 1 for v in range(256))


def _fold(key: Hashable) -> int:
    """A deterministic integer from a key (bytes or int), all of its bits mixed in."""
    if isinstance(key, (bytes, bytearray)):
        value = int.from_bytes(key, "little")
    elif isinstance(key, int):
        value = key
    else:
        raise TypeError(f"FrequencySketch keys must be bytes or int, got {type(key).__name__}")
    return (value % _MERSENNE61) + 1


def _shape(capacity: int, sample_factor: int, width_factor: int) -> tuple[int, int]:
    """(bits of a row's width, increments between agings), the arguments checked."""
    non_negative_int("capacity", capacity)
    positive_int("sample_factor", sample_factor)
    positive_int("width_factor", width_factor)
    bits = max(4, (max(capacity * width_factor, 1) - 1).bit_length())
    return bits, sample_factor * max(capacity, 1)


class FrequencySketch:
    """Approximate recent access counts of keys; memory is fixed by ``capacity``."""

    def __init__(self, capacity: int, sample_factor: int = 10, width_factor: int = 1) -> None:
        bits, self.sample_size = _shape(capacity, sample_factor, width_factor)
        self.width = 1 << bits
        self._shift = 64 - bits
        self._table = bytearray(len(_ROW_SEEDS) * self.width)
        self._additions = 0

    def _slots(self, key: Hashable) -> list[int]:
        value = _fold(key)
        shift, width = self._shift, self.width
        return [row * width + (((value * seed) & _MASK64) >> shift) for row, seed in enumerate(_ROW_SEEDS)]

    def increment(self, key: Hashable) -> None:
        """Count one use of ``key``; ages the whole sketch every ``sample_size`` uses."""
        table = self._table
        slots = self._slots(key)
        low = min(table[slot] for slot in slots)
        if low < _MAX_COUNT:
            # Conservative update: raise only the counters at the minimum, since the others
            # already over-count because of collisions.
            for slot in slots:
                if table[slot] == low:
                    table[slot] = low + 1
        self._additions += 1
        if self._additions >= self.sample_size:
            self.age()

    def estimate(self, key: Hashable) -> int:
        """The recent use count of ``key`` (an upper bound, at most 15)."""
        table = self._table
        return min(table[slot] for slot in self._slots(key))

    def age(self) -> None:
        """Halve every counter (and the count of uses since the last aging)."""
        self._table = bytearray(self._table.translate(_HALVE))
        self._additions //= 2

    def clear(self) -> None:
        self._table = bytearray(len(self._table))
        self._additions = 0

    def counts(self) -> bytes:
        """The counters, row after row."""
        return bytes(self._table)


# The Python version, kept where the C one replaces it (tests compare the two).
PYTHON_VERSIONS = {"FrequencySketch": FrequencySketch}

if NATIVE:
    from kvoffload.policies._blocks import Sketch

    class FrequencySketch(Sketch):  # type: ignore[no-redef]
        """Approximate recent access counts of keys; memory is fixed by ``capacity`` (in C)."""

        __slots__ = ()

        def __init__(self, capacity: int, sample_factor: int = 10, width_factor: int = 1) -> None:
            super().__init__(*_shape(capacity, sample_factor, width_factor))
