"""Buffers the C extensions read as 32- or 64-bit integers, handed over at an odd address
(a view one byte into a ``bytearray``): a load from a misaligned address is undefined in
C, which UndefinedBehaviorSanitizer reports (``make test-sanitize``) and x86-64 happens to
tolerate. Found by the sanitizer build: ``_hashfind.find`` read the caller's hashes and
wrote its answers misaligned, and ``_slotfind``'s ``Finder`` and ``Links`` took any
buffer. The caller's arrays are now read and written byte-wise (the same instruction on
x86-64), and an index's own arrays must be aligned (``ValueError`` otherwise).
"""

from __future__ import annotations

import numpy as np
import pytest


def native(module: str):
    try:
        return __import__(f"kvoffload.{module}", fromlist=["x"])
    except ImportError:
        pytest.skip(f"kvoffload.{module} was not built (no C compiler at install)")


def misaligned(array: np.ndarray) -> memoryview:
    """``array``'s bytes at an odd address."""
    raw = bytearray(array.nbytes + 1)
    view = memoryview(raw)[1:]
    view[:] = array.tobytes()
    return view


def test_find_reads_and_writes_the_callers_arrays_wherever_they_lie():
    hashfind = native("index._hashfind")
    table = np.zeros((8, 8), dtype=np.uint64)
    table[5, 3] = 12345
    hashes = np.array([12345, 1, 2, 12345], dtype=np.uint64)
    out = np.empty(4, dtype=np.intp)
    assert hashfind.find(table, hashes, 61, out) == 2
    odd = misaligned(np.full(4, -7, dtype=np.intp))
    assert hashfind.find(table, misaligned(hashes), 61, odd) == 2
    assert np.frombuffer(odd.tobytes(), dtype=np.intp).tolist() == out.tolist()
    with pytest.raises(ValueError, match="aligned"):
        hashfind.find(misaligned(table), hashes, 61, out)


def test_an_index_of_misaligned_arrays_is_refused():
    slotfind = native("tiers.fs._slotfind")
    table, tags = np.zeros(8, dtype=np.int64), np.zeros(8, dtype=np.uint8)
    keys, lens = bytearray(4 * 36), np.zeros(4, dtype=np.uint8)
    slotfind.Finder(table, tags, keys, lens, 36)
    with pytest.raises(ValueError, match="aligned"):
        slotfind.Finder(misaligned(table), tags, keys, lens, 36)
    links = np.full(5, 4, dtype=np.int32)
    slotfind.Links(links, links.copy())
    with pytest.raises(ValueError, match="aligned"):
        slotfind.Links(misaligned(links), links.copy())
    with pytest.raises(ValueError, match="aligned"):
        slotfind.Links(links, links.copy()).evict(misaligned(np.zeros(4, dtype=np.int32)), 1, set())
