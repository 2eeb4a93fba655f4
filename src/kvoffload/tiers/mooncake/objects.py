"""Where a block's Mooncake object lies in memory, and its header written and checked a
batch at a time.

An object is the Redis tier's value (``kvoffload.tiers.redis.format``): header, key, then
the payload (the block's row of every host-pool tensor, in tensor order). Two layouts:

* ``OneBuffer`` (a block-interleaved ``HostBlockPool`` with ``row_prefix_bytes`` of at
  least ``SLOT_BYTES``): the header and key are written right-aligned into the block's
  prefix, so they end where its payload begins, and the object is ONE buffer of the pool,
  put and got with ``batch_put_from`` / ``batch_get_into`` (Mooncake's own multi-buffer
  calls move the same bytes slower, and a header of its own per object costs Python per
  block). Its CRC32C covers key and payload in one pass, as they lie side by side. The
  views of the pool's tensors never include a prefix, so no copy between the device and
  the pool reads or writes one (``kvoffload.transfer.host_pool``, "Row prefix").
* ``SplitBuffers`` (any other pool: tensor-major, or no prefix): the header sits in a slot
  of a small staging array of the worker (one row of ``batch`` slots per I/O thread),
  and the object is put from, and got into, the slot and the block's rows
  (``batch_put_from_multi_buffers`` / ``batch_get_into_multi_buffers``).

Both register their memory with the store, and neither copies a payload in Python: the
only bytes written here are the 60 to 100 of each header. A block's prefix holds only its
own key's header (a store writes it, a load receives it, while the job holds the block),
so two jobs reading one block write the same bytes there; a staging row belongs to one
I/O thread.

``put(row, host_ids, keys)`` writes the headers of a batch (``row``: the I/O thread's) and
returns the call's method, pointers and sizes; ``get(row, host_ids, keys)`` the same for
a load; ``check(row, host_ids, keys, got)`` checks every object of that load that
Mooncake answered (``got[j] >= 0``: its size): header, key, namespace digest, size and
CRC32C, and returns ``(j, CorruptValue)`` for each that fails.
"""

from __future__ import annotations

import struct

import numpy as np

from kvoffload.tiers.host_rows import HostRows
from kvoffload.tiers.redis.format import CRC_AT, HEADER_BYTES, CorruptValue, check_head, crc32c, head_template

MAX_KEY_BYTES = 64  # an OffloadKey: a block hash (32 bytes for sha256) and a 4-byte group
SLOT_BYTES = 128  # a header and the longest key (100 bytes), rounded to keep rows aligned
_CRC = struct.Struct(">I")  # the header's CRC32C field (the format is big-endian)

# (method, pointers, sizes) of one batched call
Call = tuple[str, list, list]


class OneBuffer:
    """Objects as one buffer each: header and key in the block's row prefix."""

    # Mooncake answers a get into a buffer larger than the object with its size.
    short_is_transfer_fail = False

    def __init__(self, host_pool, digest: bytes, register) -> None:
        if not host_pool.interleaved or host_pool.row_prefix_bytes < SLOT_BYTES:
            raise ValueError(
                f"OneBuffer needs an interleaved pool with a row prefix of {SLOT_BYTES} bytes or more"
            )
        self.digest = digest
        self.size = host_pool.block_bytes
        self.stride, self.prefix = host_pool.block_stride, host_pool.row_prefix_bytes
        region = host_pool.region
        self._memory = region.numpy() if host_pool.nbytes else np.zeros(0, np.uint8)  # keeps it alive
        self._view = memoryview(self._memory)
        self._base = self._memory.ctypes.data
        if host_pool.nbytes:
            register(self._base, host_pool.nbytes)

    def _starts(self, host_ids: list[int], keys: list[bytes]) -> tuple[list[int], list[int]]:
        """Each object's first byte in the region (its payload's, less header and key),
        and its size."""
        stride, end, size = self.stride, self.prefix - HEADER_BYTES, self.size
        heads = [HEADER_BYTES + len(key) for key in keys]
        return [b * stride + end - len(key) for b, key in zip(host_ids, keys)], [n + size for n in heads]

    def write_heads(self, host_ids: list[int], keys: list[bytes]) -> tuple[list[int], list[int]]:
        """Write each block's header and key into its prefix; each object's first byte in
        the region, and its size."""
        view, size, digest, pack = self._view, self.size, self.digest, _CRC.pack_into
        starts, sizes = self._starts(host_ids, keys)
        for at, key, n in zip(starts, keys, sizes):
            view[at : at + n - size] = head_template(key, size, digest)
            pack(view, at + CRC_AT, crc32c(view[at + HEADER_BYTES : at + n]))  # key, then payload
        return starts, sizes

    def objects(self, host_ids: list[int], keys: list[bytes]) -> list[memoryview]:
        """Each block's whole object, its header written, as a byte view of the pool: what
        a client that sends from buffers (the object tier's) puts without a copy."""
        starts, sizes = self.write_heads(host_ids, keys)
        view = self._view
        return [view[at : at + n] for at, n in zip(starts, sizes)]

    def put(self, row: int, host_ids: list[int], keys: list[bytes]) -> Call:
        starts, sizes = self.write_heads(host_ids, keys)
        base = self._base
        return "batch_put_from", [base + at for at in starts], sizes

    def get(self, row: int, host_ids: list[int], keys: list[bytes]) -> Call:
        starts, sizes = self._starts(host_ids, keys)
        base = self._base
        return "batch_get_into", [base + at for at in starts], sizes

    def check(self, row: int, host_ids: list[int], keys: list[bytes], got: list[int]):
        """``(j, CorruptValue)`` per object of the last ``get`` on ``row`` that Mooncake
        answered (``got[j] >= 0``, the bytes it wrote) but that fails a check."""
        view, size, digest = self._view, self.size, self.digest
        starts, sizes = self._starts(host_ids, keys)
        bad = []
        for j, (at, key, n, code) in enumerate(zip(starts, keys, sizes, got)):
            if code < 0:
                continue
            try:
                crc = check_head(view[at : at + n], key, digest, size, code)
                if crc32c(view[at + HEADER_BYTES : at + n]) != crc:
                    raise CorruptValue("CRC32C mismatch")
            except CorruptValue as exc:
                bad.append((j, exc))
        return bad


class SplitBuffers:
    """Objects as a header slot of this worker's staging array and the block's rows."""

    # Mooncake answers a multi-buffer get into buffers larger than the object with -800,
    # as it answers a lost segment holder: the caller asks the object's size.
    short_is_transfer_fail = True

    def __init__(self, host_pool, digest: bytes, register, threads: int, batch: int) -> None:
        self.digest = digest
        self._host = HostRows(host_pool)
        self.size = self._host.block_bytes
        tensors = list(host_pool.tensors)
        self._base = min(t.data_ptr() for t in tensors) if self._host.num_blocks else 0
        self._widths = [w for _, _, w in self._host.segments]
        region = getattr(host_pool, "region", None)
        if region is not None and region.numel():
            register(region.data_ptr(), region.numel())
        elif self._host.num_blocks:
            end = max(t.data_ptr() + (t.shape[0] - 1) * t.stride(0) + t.shape[1] for t in tensors)
            register(self._base, end - self._base)
        self._staging = np.zeros((threads, batch, SLOT_BYTES), dtype=np.uint8)
        register(self._staging.ctypes.data, self._staging.nbytes)

    def _call(self, method: str, row: int, host_ids: list[int], keys: list[bytes]) -> Call:
        slot0 = self._staging[row].ctypes.data
        base, segments, widths = self._base, self._host.segments, self._widths
        ptrs = [
            [slot0 + j * SLOT_BYTES, *(base + o + b * s for o, s, _ in segments)]
            for j, b in enumerate(host_ids)
        ]
        return method, ptrs, [[HEADER_BYTES + len(key), *widths] for key in keys]

    def put(self, row: int, host_ids: list[int], keys: list[bytes]) -> Call:
        slots, size, digest, block = self._staging[row], self.size, self.digest, self._host.block
        for j, (b, key) in enumerate(zip(host_ids, keys)):
            crc = crc32c(key)
            for view in block(b):
                crc = crc32c(view, crc)
            h = head_template(key, size, digest)
            slots[j, : len(h)] = np.frombuffer(h, dtype=np.uint8)
            _CRC.pack_into(slots[j], CRC_AT, crc)
        return self._call("batch_put_from_multi_buffers", row, host_ids, keys)

    def get(self, row: int, host_ids: list[int], keys: list[bytes]) -> Call:
        return self._call("batch_get_into_multi_buffers", row, host_ids, keys)

    def check(self, row: int, host_ids: list[int], keys: list[bytes], got: list[int]):
        """As ``OneBuffer.check``."""
        slots, size, digest, block = self._staging[row], self.size, self.digest, self._host.block
        bad = []
        for j, (b, key, code) in enumerate(zip(host_ids, keys, got)):
            if code < 0:
                continue
            try:
                crc = check_head(slots[j, : HEADER_BYTES + len(key)], key, digest, size, code)
                got_crc = crc32c(key)
                for view in block(b):
                    got_crc = crc32c(view, got_crc)
                if got_crc != crc:
                    raise CorruptValue("CRC32C mismatch")
            except CorruptValue as exc:
                bad.append((j, exc))
        return bad


def layout_for(host_pool, digest: bytes, register, threads: int, batch: int) -> OneBuffer | SplitBuffers:
    """``OneBuffer`` where the pool has room for headers before its payloads, else
    ``SplitBuffers``."""
    if getattr(host_pool, "interleaved", False) and getattr(host_pool, "row_prefix_bytes", 0) >= SLOT_BYTES:
        return OneBuffer(host_pool, digest, register)
    return SplitBuffers(host_pool, digest, register, threads, batch)
