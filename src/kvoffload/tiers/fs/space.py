"""``SlotSpace``: the data file's disk space, reserved ahead of the writes that need it.

A write into a hole of a sparse file makes the file system allocate its blocks inside
the write; ``bench/profile_disk_io.py`` measured such writes 25-60% slower (thread CPU
per byte) than writes into space already reserved. ``SlotSpace(fd, slot_stride,
num_slots)`` reserves the data file in chunks of whole slots (about ``chunk_bytes``)
with ``fallocate(2)`` (mode 0: the blocks are allocated and read as zeros; the file size
grows to the chunk's end, never past ``num_slots * slot_stride``, so the tier's bound
holds) the first time this process writes into a chunk. Reserving an already allocated
range allocates nothing, so a restarted process re-reserving its chunks costs no space.

* ``unreserved_bytes(slots)``: the bytes that writing ``slots`` would reserve now, which
  the free-space floor checks before a store.
* ``reserve(first, count)``: make slots ``first .. first + count - 1`` reserved;
  thread-safe. A chunk that the file system has no room for whole (``ENOSPC``,
  ``EDQUOT``) falls back to the slots themselves; when they do not fit either, that
  ``OSError`` propagates (the store fails as its write would have). Where ``fallocate``
  is not supported (``EOPNOTSUPP``, not Linux), nothing is reserved, chunks are one slot
  each and only serve the floor's accounting: writes allocate as before.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import threading

import numpy as np

CHUNK_BYTES = 64 << 20
_NO_ROOM = (errno.ENOSPC, errno.EDQUOT)
_UNSUPPORTED = (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)
_FALLOC_FL_KEEP_SIZE = 1


def _libc_fallocate():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = libc.fallocate
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    fn.restype = ctypes.c_int
    return fn


_fallocate = _libc_fallocate()  # ctypes releases the GIL around the call


def fallocate(fd: int, offset: int, length: int, mode: int = 0) -> None:
    """``fallocate(2)``; ``OSError`` with its errno (``EOPNOTSUPP`` where there is none)."""
    if _fallocate is None:
        raise OSError(errno.EOPNOTSUPP, "fallocate is not available on this platform")
    if _fallocate(fd, mode, offset, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


class SlotSpace:
    """Reserves the data file's space chunk by chunk, ahead of the first write into it."""

    def __init__(self, fd: int, slot_stride: int, num_slots: int, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.fd = fd
        self.slot_stride = slot_stride
        self.num_slots = num_slots
        self.enabled = self._supported()
        self.chunk_slots = max(1, chunk_bytes // slot_stride) if self.enabled else 1
        self._reserved = np.zeros(-(-num_slots // self.chunk_slots), dtype=bool)
        self._lock = threading.Lock()

    def _supported(self) -> bool:
        try:  # one block at the file's start, size unchanged: slot 0 is the first one used
            fallocate(self.fd, 0, min(4096, self.slot_stride), _FALLOC_FL_KEEP_SIZE)
        except OSError as exc:
            return exc.errno not in _UNSUPPORTED
        return True

    def _chunk_slots(self, chunk: int) -> tuple[int, int]:
        first = chunk * self.chunk_slots
        return first, min(self.num_slots, first + self.chunk_slots)

    def unreserved_bytes(self, slots) -> int:
        chunks = np.unique(np.asarray(slots, dtype=np.int64) // self.chunk_slots)
        todo = chunks[~self._reserved[chunks]]
        return sum((end - first) * self.slot_stride for first, end in map(self._chunk_slots, todo.tolist()))

    def reserve(self, first: int, count: int) -> None:
        lo, hi = first // self.chunk_slots, (first + count - 1) // self.chunk_slots
        if self._reserved[lo : hi + 1].all():
            return
        with self._lock:
            for chunk in range(lo, hi + 1):
                if not self._reserved[chunk]:
                    self._reserve_chunk(chunk, first, first + count)

    def _reserve_chunk(self, chunk: int, first: int, end: int) -> None:
        start, stop = self._chunk_slots(chunk)
        if self.enabled:
            stride = self.slot_stride
            try:
                fallocate(self.fd, start * stride, (stop - start) * stride)
            except OSError as exc:
                if exc.errno in _UNSUPPORTED:
                    self.enabled = False
                elif exc.errno not in _NO_ROOM:
                    raise
                else:  # no room for the whole chunk: the slots being written, or fail as the write would
                    lo, hi = max(start, first), min(stop, end)
                    fallocate(self.fd, lo * stride, (hi - lo) * stride)
                    return  # the chunk stays unreserved: its other slots still count for the floor
        self._reserved[chunk] = True
