"""Positional vectored I/O that completes short transfers.

``pwritev_all(fd, buffers, offset, length=-1)`` writes every byte of ``buffers`` at
``offset``; ``preadv_all(fd, buffers, offset, length=-1)`` reads until ``buffers`` are
full or the file ends and returns the bytes read. Both make one ``pwritev``/``preadv``
call when it moves everything (``length``, the buffers' total when the caller knows it,
spares a byte view of each buffer), and otherwise go on in groups of at most ``IOV_MAX``
buffers from where the kernel stopped. ``skip(views, done)`` is ``views`` less their
first ``done`` bytes. ``OSError`` propagates.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024


def _groups(views: list[memoryview]):
    """``views`` cut into runs of at most ``IOV_MAX`` buffers, with each run's length."""
    for start in range(0, len(views), IOV_MAX):
        group = views[start : start + IOV_MAX]
        yield group, sum(len(v) for v in group)


def pwritev_all(fd: int, buffers: Sequence, offset: int, length: int = -1) -> None:
    """Write ``buffers`` at ``offset``; ``length`` (their total bytes, when the caller
    knows it) lets one ``pwritev`` of the buffers as given do it without first making a
    byte view of each."""
    if length >= 0 and len(buffers) <= IOV_MAX:
        written = os.pwritev(fd, buffers, offset)
        if written == length:
            return
        buffers = skip([memoryview(b).cast("B") for b in buffers], written)
        offset += written
    for group, length in _groups([memoryview(b).cast("B") for b in buffers]):
        end = offset + length
        while group:
            written = os.pwritev(fd, group, offset)
            offset += written
            group = skip(group, written)
        offset = end


def skip(views: list[memoryview], done: int) -> list[memoryview]:
    """``views`` less their first ``done`` bytes."""
    while views and done >= len(views[0]):
        done -= len(views.pop(0))
    if views and done:
        views[0] = views[0][done:]
    return views


def preadv_all(fd: int, buffers: Sequence, offset: int, length: int = -1) -> int:
    """Read until ``buffers`` are full or end of file; the bytes read. ``length`` as for
    ``_pwritev_all``."""
    total = 0
    if length >= 0 and len(buffers) <= IOV_MAX:
        total = os.preadv(fd, buffers, offset)
        if total == length or total == 0:
            return total
        buffers = skip([memoryview(b).cast("B") for b in buffers], total)
        offset += total
    for group, length in _groups([memoryview(b).cast("B") for b in buffers]):
        end = offset + length
        while group:
            got = os.preadv(fd, group, offset)
            if got == 0:
                return total
            total += got
            offset += got
            group = skip(group, got)
        offset = end
    return total
