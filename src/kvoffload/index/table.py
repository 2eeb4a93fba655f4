"""One namespace's block table: which (engine, tier) holds each block hash, refcounted.

Contract:

* A ``BlockTable`` maps an unsigned 64-bit block hash to a bitmask of holders: bit
  ``slot * 4 + tier`` (``kvoffload.index.tiers``) is set while engine ``slot`` holds the
  block in ``tier``. One entry per distinct hash, whatever the number of holders.
* Announcements are reference counted per (holder bit, hash): ``store`` twice then
  ``remove`` once leaves the block held. Counts above one live in a side dict that is
  empty in the common case.
* Every operation takes a whole run of hashes as a ``uint64`` array and works on it with
  a constant number of numpy calls: ``store(hashes, bit)`` returns how many hashes became
  newly held; ``remove(hashes, bit)`` returns ``(released, unknown)`` (holds that ended,
  and hashes the holder did not hold: an index that joined late, or a repeated removal;
  never an error), appending the unknown ones to ``unknown_out`` if given; ``lookup``
  returns each hash's holder mask, one ``uint64`` array per 64 holder bits.
* ``drop(holder_mask)`` forgets every hold of those bits (an engine that cleared,
  restarted or left), returns the holds ended per bit; O(capacity), vectorized.
* ``strides`` records, per holder bit, how many registered-size blocks one of its blocks
  spans (1 when absent); scoring reads it, the table only stores it.
* Layout: buckets of 8 slots, each hash in one of two buckets chosen by multiplicative
  hashing (the first while it has room): a lookup reads the 8 keys of one bucket (one
  cache line), then the one mask it needs, and a second bucket only for the few hashes
  that overflowed; no probe chains, no tombstones. An empty slot has key 0, so the hash
  0 itself is kept beside the arrays. The table doubles when more than half full or when
  both buckets of a new hash are full; a slot is 8 bytes of key and 8 of mask per 16
  engines.
* Not thread-safe: the index serializes access.
* The probe runs in C (``kvoffload.index._hashfind.find``) when that optional extension
  was built, in numpy otherwise; both give the same slots.
"""

from __future__ import annotations

import sys

import numpy as np

try:
    from kvoffload.index import _hashfind
except ImportError:  # built without a C compiler: the numpy probe
    _hashfind = None

WAYS = 8  # slots per bucket: one 64-byte cache line of keys
MAX_LOAD = 0.5  # low enough that a hash's first bucket almost always has room
_M1 = np.uint64(0x9E3779B97F4A7C15)
_M2 = np.uint64(0xC2B2AE3D27D4EB4F)
_ZERO = np.uint64(0)
_BIG_ENDIAN = sys.byteorder == "big"
_M64 = (1 << 64) - 1
_COUNT_SHIFT = 16  # refcount keys are (hash << 16) | bit: up to 16,384 engines of 4 tiers


class BlockTable:
    """hash -> holder bitmask, with refcounts of repeated announcements (see module doc)."""

    def __init__(self, buckets: int = 64) -> None:
        self._alloc(max(2, 1 << (buckets - 1).bit_length()), 1)
        self.size = 0  # live entries in the arrays (the hash 0 aside)
        self._zero = 0  # holder mask of the hash 0, which empty slots' keys stand for
        self.counts: dict[int, int] = {}  # (hash << 16 | bit) -> count, only for counts >= 2
        self.strides: dict[int, int] = {}
        self.holders = 0  # union of the holder bits stored since each was last dropped

    def __len__(self) -> int:
        return self.size + (1 if self._zero else 0)

    @property
    def capacity(self) -> int:
        return self._buckets * WAYS

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + sum(m.nbytes for m in self.masks)

    # -- operations ------------------------------------------------------------------------

    def store(self, hashes: np.ndarray, bit: int) -> int:
        """Count one more announcement of each hash by holder ``bit``; returns new holds."""
        if not len(hashes):
            return 0
        word, flag = self._flag(bit)
        self.holders |= 1 << bit
        unique, repeats = _unique(hashes)
        new_holds = 0
        if unique[0] == 0:  # sorted (or single): the hash 0 comes first
            new_holds += self._store_zero(bit, 1 if repeats is None else int(repeats[0]))
            unique = unique[1:]
            repeats = None if repeats is None else repeats[1:]
            if not len(unique):
                return new_holds
        pos = self._find(unique)
        present = pos >= 0
        had = np.zeros(len(unique), dtype=bool)
        if present.any():
            where = pos[present]
            masks = self.masks[word]
            held = (masks[where] & flag) != 0
            had[present] = held
            fresh = where[~held]
            masks[fresh] |= flag
            new_holds += len(fresh)
        absent = ~present
        if absent.any():
            count = int(absent.sum())
            payload = np.zeros((count, len(self.masks)), dtype=np.uint64)
            payload[:, word] = flag
            self._insert(unique[absent], payload)
            new_holds += count
        extra = repeats - 1 + had if repeats is not None else had.astype(np.int64)
        if extra.any():
            counts = self.counts
            for h, more in zip(unique[extra > 0].tolist(), extra[extra > 0].tolist()):
                key = (h << _COUNT_SHIFT) | bit
                counts[key] = counts.get(key, 1) + more
        return new_holds

    def remove(self, hashes: np.ndarray, bit: int, unknown_out: list[int] | None = None) -> tuple[int, int]:
        """Count one fewer announcement of each hash by ``bit``; returns (released, unknown)."""
        if not len(hashes):
            return 0, 0
        word, flag = self._flag(bit)
        unique, repeats = _unique(hashes)
        if repeats is None:
            repeats = np.ones(len(unique), dtype=np.int64)
        released = unknown = 0
        if unique[0] == 0:
            ended, missing = self._remove_zero(bit, int(repeats[0]))
            released, unknown = ended, missing
            if missing and unknown_out is not None:
                unknown_out.extend([0] * missing)
            unique, repeats = unique[1:], repeats[1:]
            if not len(unique):
                return released, unknown
        pos = self._find(unique)
        masks = self.masks[word]
        held = pos >= 0
        held[held] = (masks[pos[held]] & flag) != 0
        missing = int(repeats[~held].sum())
        unknown += missing
        if unknown_out is not None and missing:
            unknown_out.extend(np.repeat(unique[~held], repeats[~held]).tolist())
        # Announcements left beyond this removal keep the hold.
        remaining = held.astype(np.int64) - repeats  # <= -1 where more removals than one hold
        if self.counts:
            for i in np.flatnonzero(held).tolist():
                left = self._count_down(int(unique[i]), bit, int(repeats[i]))
                if left is not None:
                    remaining[i] = left
        ends = held & (remaining <= 0)
        unknown += int(np.clip(-remaining[ends], 0, None).sum())  # removals beyond the count
        where = pos[ends]
        masks[where] &= ~flag
        self._free_dead(where)
        return released + int(ends.sum()), unknown

    def drop(self, holder_mask: int) -> dict[int, int]:
        """Forget every hold of the bits in ``holder_mask``; returns ended holds per bit."""
        ended: dict[int, int] = {}
        if not self.holders & holder_mask:
            return ended
        touched = np.zeros(self.capacity, dtype=bool)
        for word, masks in enumerate(self.masks):
            bits = (holder_mask >> (64 * word)) & _M64
            if not bits:
                continue
            flags = np.uint64(bits)
            touched |= (masks & flags) != 0
            rest = bits
            while rest:
                low = rest & -rest
                count = int(np.count_nonzero(masks & np.uint64(low)))
                if count:
                    ended[64 * word + low.bit_length() - 1] = count
                rest ^= low
            masks &= ~flags
        self._free_dead(np.flatnonzero(touched))
        gone = self._zero & holder_mask
        while gone:
            low = gone & -gone
            bit = low.bit_length() - 1
            ended[bit] = ended.get(bit, 0) + 1
            gone ^= low
        self._zero &= ~holder_mask
        if self.counts:
            low16 = (1 << _COUNT_SHIFT) - 1
            for key in [k for k in self.counts if (holder_mask >> (k & low16)) & 1]:
                del self.counts[key]
        for bit in [b for b in self.strides if (holder_mask >> b) & 1]:
            del self.strides[bit]
        self.holders &= ~holder_mask
        return ended

    def lookup(self, hashes: np.ndarray, valid: np.ndarray | None = None) -> list[np.ndarray]:
        """Each hash's holder mask, one uint64 array per 64 holder bits (0: unknown).
        Hashes where ``valid`` is False count as unknown."""
        n = len(hashes)
        if not n:
            return [np.zeros(0, dtype=np.uint64) for _ in self.masks]
        out: list[np.ndarray] = [_ZERO] * len(self.masks)
        pos = self._find(hashes)
        found = pos >= 0
        for word, masks in enumerate(self.masks):
            out[word] = np.where(found, masks[pos], _ZERO)  # pos -1 reads a slot, then discarded
        if self._zero:
            zeros = np.flatnonzero(hashes == 0)
            for word, values in enumerate(out):
                values[zeros] = (self._zero >> (64 * word)) & _M64
        if valid is not None:
            for values in out:
                values[~valid] = 0
        return out

    def holds(self, bit: int) -> list[int]:
        """Hashes held by ``bit`` (for dumps)."""
        word, offset = divmod(bit, 64)
        if word >= len(self.masks):
            return []
        held = (self.masks[word] & np.uint64(1 << offset)) != 0
        keys = self.keys.reshape(-1)[held].tolist()
        return [0, *keys] if (self._zero >> bit) & 1 else keys

    # -- internals -------------------------------------------------------------------------

    def _alloc(self, buckets: int, words: int) -> None:
        self._buckets = buckets
        self._shift = np.uint64(64 - (buckets.bit_length() - 1))
        self.keys = np.zeros((buckets, WAYS), dtype=np.uint64)
        self.masks = [np.zeros(buckets * WAYS, dtype=np.uint64) for _ in range(words)]

    def _flag(self, bit: int) -> tuple[int, np.uint64]:
        word, offset = divmod(bit, 64)
        while word >= len(self.masks):
            self.masks.append(np.zeros(self.capacity, dtype=np.uint64))
        return word, np.uint64(1 << offset)

    def _rows(self, bucket: np.ndarray) -> np.ndarray:
        """The key rows of ``bucket`` (n, 8). ``take`` copies each 64-byte row at once,
        where indexing (``keys[bucket]``) goes element by element: 10 against 190 us
        for 2,048 buckets."""
        return self.keys.take(bucket, axis=0)

    def _find(self, keys: np.ndarray) -> np.ndarray:
        """Flat slot of each key, -1 where absent. The key 0 finds some empty slot (mask 0):
        callers keep it out, or (lookups) read its mask as nothing and patch it."""
        if _hashfind is None:
            return self._find_numpy(keys)
        pos = np.empty(len(keys), dtype=np.intp)
        _hashfind.find(self.keys, np.ascontiguousarray(keys, dtype=np.uint64), int(self._shift), pos)
        return pos

    def _find_numpy(self, keys: np.ndarray) -> np.ndarray:
        """``_find`` without the C extension."""
        bucket = ((keys * _M1) >> self._shift).astype(np.intp)
        rows, ways = _one_per_row(self._rows(bucket) == keys[:, None])
        pos = np.full(len(keys), -1, dtype=np.intp)
        pos[rows] = bucket[rows] * WAYS + ways
        if len(rows) < len(keys):  # a few overflowed into their second bucket
            rest = np.flatnonzero(pos < 0)
            candidates = keys[rest]
            bucket = ((candidates * _M2) >> self._shift).astype(np.intp)
            rows, ways = _one_per_row(self._rows(bucket) == candidates[:, None])
            pos[rest[rows]] = bucket[rows] * WAYS + ways
        return pos

    def _insert(self, keys: np.ndarray, payload: np.ndarray) -> None:
        """Insert nonzero keys known to be absent (and distinct), ``payload[i]`` their mask
        words. A key takes the first empty way of its first bucket, else of its second.
        Keys of one batch racing for one way are settled by writing them all and reading
        back: the one that stayed won, the others try again."""
        flat_keys = self.keys.reshape(-1)
        while len(keys):
            if self.size + len(keys) > MAX_LOAD * self.capacity:
                self._grow()
                flat_keys = self.keys.reshape(-1)
            slot = np.full(len(keys), -1, dtype=np.intp)
            rest = np.arange(len(keys))
            for multiplier in (_M1, _M2):
                bucket = ((keys[rest] * multiplier) >> self._shift).astype(np.intp)
                rows, ways = _lowest_per_row(self._rows(bucket) == 0)
                slot[rest[rows]] = bucket[rows] * WAYS + ways
                rest = rest[slot[rest] < 0]
                if not len(rest):
                    break
            if len(rest):  # both buckets full
                self._grow()
                flat_keys = self.keys.reshape(-1)
                continue
            flat_keys[slot] = keys
            won = flat_keys[slot] == keys
            placed = slot[won]
            for word, masks in enumerate(self.masks):
                masks[placed] = payload[won, word]
            self.size += len(placed)
            keys, payload = keys[~won], payload[~won]

    def _grow(self) -> None:
        flat_keys = self.keys.reshape(-1)
        live = flat_keys != 0
        keys = flat_keys[live]
        payload = np.stack([m[live] for m in self.masks], axis=1)
        self._alloc(self._buckets * 2, len(self.masks))
        self.size = 0
        self._insert(keys, payload)

    def _free_dead(self, where: np.ndarray) -> None:
        if not len(where):
            return
        alive = self.masks[0][where] != 0
        for masks in self.masks[1:]:
            alive |= masks[where] != 0
        dead = where[~alive]
        self.keys.reshape(-1)[dead] = 0
        self.size -= len(dead)

    def _count_down(self, h: int, bit: int, times: int) -> int | None:
        """Refcount of (h, bit) after ``times`` removals, ``None`` if it was one."""
        key = (h << _COUNT_SHIFT) | bit
        count = self.counts.get(key)
        if count is None:
            return None
        left = count - times
        if left >= 2:
            self.counts[key] = left
        else:
            del self.counts[key]
        return left

    def _store_zero(self, bit: int, times: int) -> int:
        flag = 1 << bit
        new = 0 if self._zero & flag else 1
        self._zero |= flag
        more = times - new
        if more:
            key = bit  # (0 << 16) | bit
            self.counts[key] = self.counts.get(key, 1) + more
        return new

    def _remove_zero(self, bit: int, times: int) -> tuple[int, int]:
        flag = 1 << bit
        if not self._zero & flag:
            return 0, times
        left = self._count_down(0, bit, times)
        left = 1 - times if left is None else left
        if left > 0:
            return 0, 0
        self._zero &= ~flag
        return 1, -left


def _unique(hashes: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """Sorted distinct hashes and how often each came (``None``: once each)."""
    if len(hashes) == 1:
        return hashes, None
    ordered = np.sort(hashes)
    if (ordered[1:] != ordered[:-1]).all():  # the common case: no repeats, no counting
        return ordered, None
    unique, repeats = np.unique(ordered, return_counts=True)
    return unique, repeats


def _one_per_row(match: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows with a True and its column, for an (n, 8) bool array with at most one True per
    row: a row's 8 bools are the bytes of one word, and the set byte's place is the
    word's binary exponent / 8 (cheaper than ``np.nonzero`` on two dimensions)."""
    words = match.view(np.uint64).reshape(-1)
    rows = np.flatnonzero(words)
    return rows, _byte_index(words[rows])


def _lowest_per_row(match: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows with a True and the column of their first True, for an (n, 8) bool array."""
    if _BIG_ENDIAN:
        rows = np.flatnonzero(match.any(axis=1))
        return rows, match[rows].argmax(axis=1).astype(np.intp)
    words = match.view(np.uint64).reshape(-1)
    rows = np.flatnonzero(words)
    words = words[rows]
    return rows, _byte_index(words & (~words + np.uint64(1)))  # the lowest set byte alone


def _byte_index(words: np.ndarray) -> np.ndarray:
    """Which byte of each word is its only nonzero one (bools: 0 or 1 per byte)."""
    columns = (np.frexp(words.astype(np.float64))[1] - 1) // 8
    if _BIG_ENDIAN:
        columns = WAYS - 1 - columns
    return columns.astype(np.intp)
