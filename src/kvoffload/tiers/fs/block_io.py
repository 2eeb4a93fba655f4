"""Writing and reading one block of the disk tier: the crash-safe protocol.

``BlockFiles(ns_dir, geometry, digest)`` opens ``slots.dat`` and ``headers.dat`` of a
namespace (created if missing; sparse, grown on demand) and moves one block at a time
between them and caller-owned buffers (the host pool's rows), without a copy:

* ``write(slot, key, buffers)``: zero the slot's header record; ``pwritev`` the payload
  at the slot; CRC32C over ``buffers`` (after the write, while they are still in the CPU
  cache: ``bench/profile_disk_io.py``); write the new record (with ``fsync=True``, each
  step is made durable before the next). A process killed anywhere in between leaves
  an empty slot, never a valid record over a torn payload. The caller must not change
  ``buffers`` during the call (the CRC and the file must see the same bytes).
  ``write_run`` does the same for consecutive slots with three writes in all (and more
  ``pwritev`` calls only past ``IOV_MAX`` buffers or after a short write): the workers
  batch a job's runs of consecutive slots.
* ``read(slot, key, buffers)``: read and check the record (magic, version, record CRC,
  namespace digest, the expected key, payload length), ``preadv`` the payload straight
  into ``buffers`` (from the page cache where it holds them, else with ``O_DIRECT`` when
  the caller's buffers are aligned: ``kvoffload.tiers.fs.direct``), check its CRC. Any
  mismatch raises ``CorruptBlock`` naming the key and the reason; the caller must then
  treat ``buffers`` as garbage. ``read_run``: the same for consecutive slots: with the
  ``_runread`` extension, one call without the GIL (the records in one read, then each
  payload read and checked while it is in the CPU cache; ``native_reads()`` says whether
  it was built), else one record read and one ``preadv`` (per ``IOV_MAX``), then the CRCs.
* ``consecutive_runs(slots, limit)``: a job's slots cut into the runs those calls take.
* ``invalidate(slot)``: zero the record (the block is gone; its bytes are overwritten
  when the slot is reused).

``OSError`` (``ENOSPC``, ``EIO``, ``EROFS``, ...) propagates to the caller, which counts it.
Thread-safe for distinct slots (positional I/O on shared descriptors).
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from collections.abc import Sequence

from kvoffload.private import open_private
from kvoffload.tiers.fs.direct import PayloadReader
from kvoffload.tiers.fs.format import (
    DATA_FILE,
    EMPTY_RECORD,
    FORMAT_VERSION,
    HEADER_FILE,
    RECORD_BYTES,
    Geometry,
    Record,
    RecordError,
    checksum,
    pack_record,
    parse_record,
)
from kvoffload.tiers.fs.vectored import pwritev_all

try:  # the payload reads and checks without the GIL (optional: else the same in Python)
    from kvoffload.tiers.fs import _runread
except ImportError:  # pragma: no cover - built without a C compiler
    _runread = None

_SHORT, _OS_ERROR, _RECORD = 1, 3, 4  # _runread.read_run's statuses


class CorruptBlock(Exception):
    """A block that cannot be served: its record or payload does not check out."""

    def __init__(self, key: bytes, slot: int, reason: str) -> None:
        super().__init__(f"key {key.hex()} in slot {slot}: {reason}")
        self.key = key
        self.slot = slot
        self.reason = reason


class BlockFiles:
    """The two files of one namespace, open for positional reads and writes."""

    def __init__(
        self, ns_dir: str, geometry: Geometry, digest: bytes, fsync: bool = False, direct_reads: bool = False
    ) -> None:
        """``direct_reads``: the caller promises read buffers aligned for ``O_DIRECT``
        (``kvoffload.tiers.fs.direct``); what the page cache does not hold is then read past it."""
        self.geometry = geometry
        self.digest = digest
        self.fsync = fsync
        gap = geometry.slot_stride - geometry.payload_bytes
        self._zeros = memoryview(bytes(gap))  # written into the padding between slots of a run
        # 0600 whatever the umask (kvoffload.private): the blocks are prompts
        self.data_fd = open_private(os.path.join(ns_dir, DATA_FILE), os.O_RDWR)
        try:
            self.header_fd = open_private(os.path.join(ns_dir, HEADER_FILE), os.O_RDWR)
        except OSError:
            os.close(self.data_fd)
            raise
        path = os.path.join(ns_dir, DATA_FILE)
        self.reader = PayloadReader(path, self.data_fd, direct_reads and not gap)

    def write(self, slot: int, key: bytes, buffers: Sequence) -> None:
        self.write_run(slot, [key], [buffers])

    def write_run(self, first: int, keys: Sequence[bytes], blocks: Sequence[Sequence]) -> None:
        """Write ``blocks[i]`` (its buffers) under ``keys[i]`` to slot ``first + i``: the
        records of the run zeroed in one write, the payloads in as few ``pwritev`` calls
        as ``IOV_MAX`` allows (padding written as zeros), then the records in one write."""
        record_at = first * RECORD_BYTES
        os.pwrite(self.header_fd, bytes(RECORD_BYTES * len(keys)), record_at)
        if self.fsync:
            os.fdatasync(self.header_fd)
        geometry = self.geometry
        length = (len(blocks) - 1) * geometry.slot_stride + geometry.payload_bytes
        pwritev_all(self.data_fd, self._with_padding(blocks), geometry.data_offset(first), length)
        if self.fsync:
            os.fdatasync(self.data_fd)
        crcs = [checksum(buffers) for buffers in blocks]
        now = time.time_ns()
        payload = geometry.payload_bytes
        records = b"".join(pack_record(key, payload, crc, now, self.digest) for key, crc in zip(keys, crcs))
        os.pwrite(self.header_fd, records, record_at)
        if self.fsync:
            os.fdatasync(self.header_fd)

    def _with_padding(self, blocks: Sequence[Sequence], scratch: memoryview | None = None) -> list:
        pad = self._zeros if scratch is None else scratch
        if not len(pad):
            return [buf for buffers in blocks for buf in buffers]
        out = []
        for buffers in blocks[:-1]:
            out.extend(buffers)
            out.append(pad)
        out.extend(blocks[-1])
        return out

    def read(self, slot: int, key: bytes, buffers: Sequence) -> None:
        self.read_run(slot, [key], [buffers])

    def read_run(self, first: int, keys: Sequence[bytes], blocks: Sequence[Sequence]) -> None:
        """Read slots ``first ..`` into ``blocks[i]`` (its buffers) and check each against
        ``keys[i]``. ``CorruptBlock`` names the first block that does not check out
        (``blocks`` are then garbage; those before it were read and checked).

        With ``_runread`` built, one call without the GIL per run: the records in one read,
        then each block's payload read and its CRC computed while it is in the CPU cache.
        Else the records in one read and the payloads, up to the first bad record, in as
        few ``preadv`` calls as ``IOV_MAX`` allows, checked after; either way the blocks are
        judged in order, so both name the same block."""
        if _runread is not None:
            self._read_native(first, keys, blocks)
            return
        raw = os.pread(self.header_fd, RECORD_BYTES * len(keys), first * RECORD_BYTES)
        records, bad = [], None
        for i, key in enumerate(keys):
            try:
                records.append(self._record(raw[i * RECORD_BYTES : (i + 1) * RECORD_BYTES], key, first + i))
            except CorruptBlock as exc:
                bad = exc  # the blocks before it are read and checked first, as in C
                break
        if records:
            self._read_checked(first, keys, blocks, records)
        if bad is not None:
            raise bad

    def _read_checked(self, first: int, keys: Sequence[bytes], blocks: Sequence[Sequence], records) -> None:
        """Read the first ``len(records)`` blocks of the run (their records valid) and
        check them in order."""
        n = len(records)
        blocks = blocks[:n]
        gap = self.geometry.slot_stride - self.geometry.payload_bytes
        scratch = memoryview(bytearray(gap)) if gap and n > 1 else None
        length = (n - 1) * self.geometry.slot_stride + self.geometry.payload_bytes
        got = self.reader.read(self._with_padding(blocks, scratch), self.geometry.data_offset(first), length)
        payload = self.geometry.payload_bytes
        for i, (key, record) in enumerate(zip(keys, records)):
            have = min(payload, max(0, got - i * self.geometry.slot_stride))
            if have != payload:
                raise CorruptBlock(key, first + i, f"truncated: read {have} of {payload} payload bytes")
            crc = checksum(blocks[i])
            if crc != record.payload_crc:
                raise CorruptBlock(key, first + i, _mismatch(record.payload_crc, crc))

    def _record(self, raw: bytes, key: bytes, slot: int) -> Record:
        """The record ``raw`` of ``slot`` if it is valid for ``key``, else ``CorruptBlock`` saying why."""
        try:
            record = parse_record(raw)
        except RecordError as exc:
            raise CorruptBlock(key, slot, str(exc)) from None
        if record.digest != self.digest:
            raise CorruptBlock(key, slot, "written under another namespace")
        if record.key != key:
            raise CorruptBlock(key, slot, f"slot holds key {record.key.hex()} instead")
        if record.payload_len != self.geometry.payload_bytes:
            expected = self.geometry.payload_bytes
            raise CorruptBlock(key, slot, f"payload of {record.payload_len} bytes, expected {expected}")
        return record

    def _read_native(self, first: int, keys: Sequence[bytes], blocks: Sequence[Sequence]) -> None:
        geometry = self.geometry
        stride, offset, payload = geometry.slot_stride, geometry.data_offset(first), geometry.payload_bytes
        fd = self.reader.descriptor(offset, (len(keys) - 1) * stride + payload)
        done = 0
        while True:
            n, status, value = _runread.read_run(
                self.header_fd, fd, first + done, keys[done:], blocks[done:], self.digest, FORMAT_VERSION,
                payload, offset + done * stride, stride,
            )  # fmt: skip
            done += n
            if status == 0:
                return
            if status == _OS_ERROR and value == errno.EINVAL and fd == self.reader.direct_fd:
                fd = self.reader.refused(fd)  # go on through the page cache
                continue
            if status == _OS_ERROR:
                raise OSError(value, os.strerror(value))
            key, slot = keys[done], first + done
            if status == _SHORT:
                raise CorruptBlock(key, slot, f"truncated: read {value} of {payload} payload bytes")
            # the record again, in Python: CorruptBlock saying why when it is the bad part
            stored = self._record(os.pread(self.header_fd, RECORD_BYTES, slot * RECORD_BYTES), key, slot)
            if status == _RECORD:  # valid now: rewritten since the run read it
                raise CorruptBlock(key, slot, "header record changed while it was read")
            raise CorruptBlock(key, slot, _mismatch(stored.payload_crc, value))

    def prefetch_records(self, first: int, last: int) -> None:
        """Start reading the records of slots ``first..last`` into the page cache, so that
        the reads of a job's runs do not each wait on the device for their records. A hint:
        an error is ignored (the runs read their records anyway)."""
        if hasattr(os, "posix_fadvise"):
            length = (last - first + 1) * RECORD_BYTES
            with contextlib.suppress(OSError):
                os.posix_fadvise(self.header_fd, first * RECORD_BYTES, length, os.POSIX_FADV_WILLNEED)

    def invalidate(self, slot: int) -> None:
        os.pwrite(self.header_fd, EMPTY_RECORD, slot * RECORD_BYTES)

    def close(self) -> None:
        self.reader.close()
        for fd in (self.data_fd, self.header_fd):
            if fd >= 0:
                os.close(fd)
        self.data_fd = self.header_fd = -1


def native_reads() -> bool:
    """Whether ``read_run`` reads and checks in C (``_runread`` was built)."""
    return _runread is not None


def _mismatch(stored: int, read: int) -> str:
    return f"checksum mismatch (stored {stored:#010x}, read {read:#010x})"


def consecutive_runs(slots: list[int], limit: int) -> list[range]:
    """Indices into ``slots`` cut where the slots stop being consecutive, and every
    ``limit`` blocks: the runs a worker moves with one ``write_run``/``read_run`` each."""
    runs = []
    start = 0
    for i in range(1, len(slots)):
        if slots[i] != slots[i - 1] + 1 or i - start == limit:
            runs.append(range(start, i))
            start = i
    if len(slots) > start:
        runs.append(range(start, len(slots)))
    return runs
