"""``SlotIndex``: a compact key -> slot map for millions of blocks.

A Python ``dict[bytes, int]`` costs about 150 bytes per block (the key object, the int,
the table entry). This index keeps, per slot, the key bytes in one fixed-width buffer
(``max_key_bytes``) and the key's length (1 byte), and finds slots through an
open-addressing table of ``int64`` entries, each ``tag << 32 | (slot + 1)`` (0 = empty),
where ``tag`` is 31 bits of the key's hash. The table is at most half full (linear
probing, backward-shift deletion: no tombstones). That is ``max_key_bytes + 1 + 16..32``
bytes per slot (53..69 for 36-byte keys), allocated up front for ``num_slots`` (pages of
``numpy.zeros`` cost nothing until touched).

One probe reads one table entry; only an entry whose tag matches costs a key comparison
(in place, ``bytearray.startswith``: no copy). ``find`` is a closure over the arrays, the
cheapest call Python offers, since the scheduler calls it for every lookup.

Contract: ``find(key)`` -> slot or -1 (compares the full key, never a hash alone);
``insert(key, slot)`` for a key not present and a slot not in use; ``remove(slot)`` for a
slot in use; ``key_of(slot)``. Hashes come from Python's ``hash`` of the key (cached on
bytes objects): process-local, which is fine for an index rebuilt in every process.
Single-threaded, like the manager that owns it.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kvoffload.validation import non_negative_int, positive_int

_TAG = 0x7FFFFFFF  # 31 bits of the hash: the entry stays a positive int64
_SLOT = 0xFFFFFFFF
MAX_SLOTS = 1 << 30


def _finder(
    table: memoryview, mask: int, keys: bytearray, lens: memoryview, width: int
) -> Callable[[bytes], int]:
    startswith = keys.startswith

    def find(key: bytes) -> int:
        h = hash(key)
        i = h & mask
        entry = table[i]
        tag = h & _TAG
        while entry:
            if entry >> 32 == tag:
                slot = (entry & _SLOT) - 1
                if startswith(key, slot * width) and lens[slot] == len(key):
                    return slot
            i = (i + 1) & mask
            entry = table[i]
        return -1

    return find


class SlotIndex:
    """Keys of up to ``max_key_bytes`` bytes mapped to slots ``0 .. num_slots-1``."""

    def __init__(self, num_slots: int, max_key_bytes: int) -> None:
        self.num_slots = non_negative_int("num_slots", num_slots)
        if num_slots > MAX_SLOTS:
            raise ValueError(f"num_slots must be at most {MAX_SLOTS}, got {num_slots}")
        self.max_key_bytes = positive_int("max_key_bytes", max_key_bytes)
        size = 8
        while size < 2 * num_slots:
            size *= 2
        self._mask = size - 1
        self._table_array = np.zeros(size, dtype=np.int64)
        self._table = memoryview(self._table_array)
        self._len_array = np.zeros(num_slots, dtype=np.uint8)
        self._lens = memoryview(self._len_array)
        self._keys = bytearray(num_slots * max_key_bytes)
        self.size = 0
        self.find = _finder(self._table, self._mask, self._keys, self._lens, max_key_bytes)

    @property
    def nbytes(self) -> int:
        """Bytes allocated for the index (whether touched yet or not)."""
        return self._table_array.nbytes + self._len_array.nbytes + len(self._keys)

    def key_of(self, slot: int) -> bytes:
        start = slot * self.max_key_bytes
        return bytes(self._keys[start : start + self._lens[slot]])

    def check_key(self, key: object) -> bytes:
        """``key`` if the index can hold it; ``ValueError`` naming it otherwise."""
        if not isinstance(key, bytes) or not 0 < len(key) <= self.max_key_bytes:
            raise ValueError(f"a key must be 1..{self.max_key_bytes} bytes, got {key!r}")
        return key

    def insert(self, key: bytes, slot: int) -> None:
        h = hash(key)
        start = slot * self.max_key_bytes
        self._keys[start : start + len(key)] = key
        self._lens[slot] = len(key)
        mask, table = self._mask, self._table
        i = h & mask
        while table[i]:
            i = (i + 1) & mask
        table[i] = (h & _TAG) << 32 | (slot + 1)
        self.size += 1

    def insert_many(self, keys: list[bytes], slots) -> None:
        """``insert`` of every pair at once (vectorised probing; the rebuild's bulk path)."""
        n = len(keys)
        if n < 32:
            for key, slot in zip(keys, slots):
                self.insert(key, int(slot))
            return
        slots = np.asarray(slots, dtype=np.int64)
        width = self.max_key_bytes
        lens = np.fromiter(map(len, keys), dtype=np.int64, count=n)
        rows = np.frombuffer(self._keys, dtype=np.uint8).reshape(self.num_slots, width)
        if (lens == lens[0]).all():
            rows[slots, : lens[0]] = np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(n, int(lens[0]))
        else:
            for key, slot in zip(keys, slots.tolist()):
                self._keys[slot * width : slot * width + len(key)] = key
        self._len_array[slots] = lens
        hashes = np.fromiter(map(hash, keys), dtype=np.int64, count=n)
        entries = (hashes & _TAG) << 32 | (slots + 1)
        table, mask = self._table_array, self._mask
        position = hashes & mask
        pending = np.arange(n)
        while pending.size:
            where = position[pending]
            free = table[where] == 0
            # one winner per free position (the first pending item aiming at it)
            spots, first = np.unique(where[free], return_index=True)
            winners = pending[free][first]
            table[spots] = entries[winners]
            placed = np.zeros(n, dtype=bool)
            placed[winners] = True
            pending = pending[~placed[pending]]
            position[pending] = (position[pending] + 1) & mask  # everything it passed is taken
        self.size += n

    def remove(self, slot: int) -> None:
        mask, table = self._mask, self._table
        i = hash(self.key_of(slot)) & mask
        while table[i] & _SLOT != slot + 1:
            if not table[i]:
                raise KeyError(f"slot {slot} is not in the index")
            i = (i + 1) & mask
        # Backward-shift deletion: pull later entries of the probe run into the hole
        # unless their home position lies cyclically in (hole, their position].
        j = i
        while True:
            j = (j + 1) & mask
            entry = table[j]
            if not entry:
                break
            home = (entry >> 32) & mask
            if (j > i and i < home <= j) or (j < i and (home > i or home <= j)):
                continue
            table[i] = entry
            i = j
        table[i] = 0
        self._lens[slot] = 0
        self.size -= 1

    def clear(self) -> None:
        self._table_array.fill(0)
        self._len_array.fill(0)
        self.size = 0
