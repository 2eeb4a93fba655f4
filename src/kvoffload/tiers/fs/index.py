"""``SlotIndex``: a compact key -> slot map for millions of blocks.

A Python ``dict[bytes, int]`` costs about 150 bytes per block (the key object, the int,
the table entry). This index keeps, per slot, the key bytes in one fixed-width buffer
(``max_key_bytes``) and the key's length (1 byte), and finds slots through an
open-addressing table of ``int64`` entries, each ``tag << 32 | (slot + 1)`` (0 = empty),
where ``tag`` is 31 bits of the key's hash, and beside it one ``uint8`` per table entry,
8 other bits of the hash (0 = empty; never 0 otherwise). The table is at most half full
(linear probing, backward-shift deletion: no tombstones). That is
``max_key_bytes + 1 + 18..36`` bytes per slot (55..73 for 36-byte keys), allocated up front
for ``num_slots`` (pages of ``numpy.zeros`` cost nothing until touched).

The C probe walks the byte array (an eighth of the table's size, so a miss usually costs
one cache line that stays cached) and reads a table entry only where its 8 bits match;
the Python probe walks the table. Only an entry whose 31-bit tag matches costs a key
comparison (in place: no copy). The scheduler asks for every key it looks up or touches,
so the probe and the writes run in C when ``kvoffload.tiers.fs._slotfind`` was built
(``NATIVE``; see pyproject.toml): ``find`` is then a C method over the same arrays, about
as cheap as a ``dict`` lookup, and a batch of inserts or removals one C call. Without it,
``find`` is a closure walking the table in Python (several times slower) and the writes
are Python (``insert_many`` vectorised with numpy); both build the same arrays.

Contract: ``find(key)`` -> slot or -1 (compares the full key, never a hash alone);
``split(keys)`` -> (slots of the present keys, absent keys), each in the order given;
``insert(key, slot)`` (and ``insert_many``) for a key not present and a slot not in use;
``remove(slot)`` (and ``remove_many``) for a slot in use; ``key_of(slot)`` (and
``keys_of``). Hashes come
from Python's ``hash`` of the key (cached on bytes objects; C's ``PyObject_Hash`` is the
same value): process-local, which is fine for an index rebuilt in every process.
Single-threaded, like the manager that owns it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from kvoffload.validation import non_negative_int, positive_int

try:
    from kvoffload.tiers.fs import _slotfind
except ImportError:  # built without a C compiler
    _slotfind = None

NATIVE = _slotfind is not None

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


def _splitter(find: Callable[[bytes], int]) -> Callable[[Sequence[bytes]], tuple[list[int], list[bytes]]]:
    def split(keys: Sequence[bytes]) -> tuple[list[int], list[bytes]]:
        slots: list[int] = []
        absent: list[bytes] = []
        for key in keys:
            slot = find(key)
            if slot >= 0:
                slots.append(slot)
            else:
                absent.append(key)
        return slots, absent

    return split


def _byte_tag(h: int) -> int:
    """The 8 bits of hash ``h`` kept beside its table entry (the C probe's ``byte_tag``)."""
    return (h >> 56) & 0xFF or 1


class SlotIndex:
    """Keys of up to ``max_key_bytes`` bytes mapped to slots ``0 .. num_slots-1``."""

    def __init__(self, num_slots: int, max_key_bytes: int, native: bool | None = None) -> None:
        """``native``: probe in C (default: when built; ``True`` without it is an error)."""
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
        self._tag_array = np.zeros(size, dtype=np.uint8)
        self._tags = memoryview(self._tag_array)
        self._len_array = np.zeros(num_slots, dtype=np.uint8)
        self._lens = memoryview(self._len_array)
        self._keys = bytearray(num_slots * max_key_bytes)
        self.size = 0
        if native is None:
            native = NATIVE
        elif native and not NATIVE:
            raise ValueError("native=True, but kvoffload.tiers.fs._slotfind was not built")
        self.native = bool(native)
        self.finder = None  # the C probe object, for kvoffload.tiers.fs.order's C moves
        if native:
            self.finder = finder = _slotfind.Finder(
                self._table_array, self._tag_array, self._keys, self._len_array, max_key_bytes
            )
            self.find: Callable[[bytes], int] = finder.find
            self.split: Callable[[Sequence[bytes]], tuple[list[int], list[bytes]]] = finder.split
        else:
            self.find = _finder(self._table, self._mask, self._keys, self._lens, max_key_bytes)
            self.split = _splitter(self.find)

    @property
    def nbytes(self) -> int:
        """Bytes allocated for the index (whether touched yet or not)."""
        return self._table_array.nbytes + self._tag_array.nbytes + self._len_array.nbytes + len(self._keys)

    def key_of(self, slot: int) -> bytes:
        start = slot * self.max_key_bytes
        return bytes(self._keys[start : start + self._lens[slot]])

    def check_key(self, key: object) -> bytes:
        """``key`` if the index can hold it; ``ValueError`` naming it otherwise."""
        if not isinstance(key, bytes) or not 0 < len(key) <= self.max_key_bytes:
            raise ValueError(f"a key must be 1..{self.max_key_bytes} bytes, got {key!r}")
        return key

    def keys_of(self, slots: Sequence[int]) -> list[bytes]:
        """``key_of`` of every slot (one C call where built)."""
        if self.finder is not None:
            return self.finder.keys_of(slots)
        return [self.key_of(slot) for slot in slots]

    def check_keys(self, keys: Sequence[object]) -> None:
        """``check_key`` of every key (C loops where all are ``bytes``)."""
        if keys and (
            set(map(type, keys)) != {bytes}
            or min(map(len, keys)) == 0  # type: ignore[arg-type]
            or max(map(len, keys)) > self.max_key_bytes  # type: ignore[arg-type]
        ):
            for key in keys:
                self.check_key(key)

    def insert(self, key: bytes, slot: int) -> None:
        if self.finder is not None:
            self.finder.insert((key,), (slot,))
            self.size += 1
            return
        h = hash(key)
        start = slot * self.max_key_bytes
        self._keys[start : start + len(key)] = key
        self._lens[slot] = len(key)
        mask, table = self._mask, self._table
        i = h & mask
        while table[i]:
            i = (i + 1) & mask
        table[i] = (h & _TAG) << 32 | (slot + 1)
        self._tags[i] = _byte_tag(h)
        self.size += 1

    def insert_many(self, keys: list[bytes], slots) -> None:
        """``insert`` of every pair at once (one C call; in Python, vectorised probing)."""
        n = len(keys)
        if self.finder is not None:
            self.finder.insert(keys, slots)
            self.size += n
            return
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
        tags = ((hashes >> 56) & 0xFF).astype(np.uint8)
        tags[tags == 0] = 1
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
            self._tag_array[spots] = tags[winners]
            placed = np.zeros(n, dtype=bool)
            placed[winners] = True
            pending = pending[~placed[pending]]
            position[pending] = (position[pending] + 1) & mask  # everything it passed is taken
        self.size += n

    def remove(self, slot: int) -> None:
        if self.finder is not None:
            self.finder.remove((slot,))
            self.size -= 1
            return
        mask, table, tags = self._mask, self._table, self._tags
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
            tags[i] = tags[j]
            i = j
        table[i] = 0
        tags[i] = 0
        self._lens[slot] = 0
        self.size -= 1

    def remove_many(self, slots: Sequence[int]) -> None:
        """``remove`` of every slot (one C call where built)."""
        if self.finder is not None:
            self.finder.remove(slots)
            self.size -= len(slots)
            return
        for slot in slots:
            self.remove(slot)

    def clear(self) -> None:
        self._table_array.fill(0)
        self._tag_array.fill(0)
        self._len_array.fill(0)
        self.size = 0
