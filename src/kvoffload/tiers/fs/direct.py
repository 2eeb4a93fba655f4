"""``PayloadReader``: reads payloads from the page cache when they are there, else past it.

A cold load through the page cache costs a copy from the cache into the host pool on top
of the device read; ``O_DIRECT`` moves the bytes from the device straight into the pool.
A warm load is the other way round: the page cache serves it at memory speed, and
``O_DIRECT`` would go back to the device. So each read first asks the kernel how much of
its range is cached (``cachestat(2)``, Linux 6.5+; it reads nothing), and reads through a
second descriptor of the same file opened with ``O_DIRECT`` when less than half of the
range is cached and none of it is dirty or under writeback (a direct read would first
have to write those back). ``preadv2(RWF_NOWAIT)`` is no substitute for the question: on
a miss it starts the readahead of the range it then declines to wait for.

Contract: ``read(buffers, offset, length)`` fills ``buffers`` (byte views, ``length``
bytes in all, at file ``offset``) and returns the bytes read (fewer only at end of file).
``descriptor(offset, length)`` only makes the choice, for a caller that reads the range
itself (``block_io``'s native reads), and ``refused(fd)`` takes a direct descriptor the
file system would not read through back to the page cache.
The caller promises, by building the reader with ``direct=True``, that every buffer's
address and length is a multiple of ``DIRECT_ALIGN``; the reader goes past the page cache
only where the file offset is one too. Without ``cachestat`` or ``O_DIRECT`` (older
kernels, tmpfs, some network file systems) it reads through the page cache, as it does
with ``direct=False``. Both paths return the same bytes: the kernel keeps them coherent.
Thread-safe (positional reads only).
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading

from kvoffload.tiers.fs.vectored import IOV_MAX, preadv_all

DIRECT_ALIGN = 4096  # covers 512-byte and 4 KiB logical blocks
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096  # cachestat counts pages
_CACHESTAT = 451  # the syscall number on every architecture (added after the unification)


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Stat(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_uint64)
        for name in ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")
    ]


def _libc_syscall():
    try:
        call = ctypes.CDLL(None, use_errno=True).syscall  # ctypes drops the GIL for the call
    except (OSError, AttributeError):
        return None
    call.restype = ctypes.c_long
    call.argtypes = [ctypes.c_long, ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
    return call


_syscall = _libc_syscall()


def cache_state(fd: int, offset: int, length: int) -> tuple[int, int] | None:
    """``(cached, dirty_or_writeback)`` pages of ``fd``'s range, or ``None`` where the kernel
    cannot tell (no ``cachestat``)."""
    if _syscall is None:
        return None
    span, stat = _Range(offset, length), _Stat()
    if _syscall(_CACHESTAT, fd, ctypes.addressof(span), ctypes.addressof(stat), 0) != 0:
        return None
    return int(stat.nr_cache), int(stat.nr_dirty + stat.nr_writeback)


class PayloadReader:
    """Reads of one data file: through the page cache, or past it when it holds little."""

    def __init__(self, path: str, cached_fd: int, direct: bool) -> None:
        """``cached_fd``: the file open for buffered I/O (not owned); ``direct``: the
        caller's buffers are aligned (see the contract); ``False`` reads through the page
        cache only."""
        self._cached_fd = cached_fd
        self.direct_fd = -1
        if direct and hasattr(os, "O_DIRECT") and cache_state(cached_fd, 0, DIRECT_ALIGN) is not None:
            try:
                self.direct_fd = os.open(path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
            except OSError:  # EINVAL: this file system has no O_DIRECT
                self.direct_fd = -1
        self._lock = threading.Lock()
        self.direct_reads = 0  # reads that went past the page cache

    def read(self, buffers: list, offset: int, length: int) -> int:
        fd = self.descriptor(offset, length) if len(buffers) <= IOV_MAX else self._cached_fd
        if fd == self.direct_fd:
            try:
                return preadv_all(fd, buffers, offset, length)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self.refused(fd)
        return preadv_all(self._cached_fd, buffers, offset, length)

    def descriptor(self, offset: int, length: int) -> int:
        """The descriptor to read ``length`` bytes at ``offset`` through (the direct one is
        counted in ``direct_reads``): the caller reads the range's buffers at the file offsets
        they map to, and hands a direct descriptor that fails with ``EINVAL`` to ``refused``."""
        fd = self.direct_fd
        if fd >= 0 and not offset % DIRECT_ALIGN:
            state = cache_state(self._cached_fd, offset, length)
            if state is not None and state[1] == 0 and state[0] * 2 * _PAGE < length:
                with self._lock:
                    self.direct_reads += 1
                return fd
        return self._cached_fd

    def refused(self, fd: int) -> int:
        """The file system took the direct open of ``fd`` but not a read: read through the page
        cache from now on. The descriptor to read with instead."""
        if fd == self.direct_fd:
            self._disable()
        return self._cached_fd

    def _disable(self) -> None:
        fd, self.direct_fd = self.direct_fd, -1
        if fd >= 0:
            os.close(fd)

    def close(self) -> None:
        self._disable()
