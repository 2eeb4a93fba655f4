"""The on-disk format of the local-disk tier: files, slot geometry, header records.

A namespace directory (``<root_dir>/<namespace>/``, see ``kvoffload.tiers.fs.namespace``)
holds one tier's blocks in two sparse files, grown on demand and addressed by slot:

* ``slots.dat``: slot ``s``'s payload at offset ``s * slot_stride``. The payload is the
  bytes of one host block: the row of that host block id in every host-pool tensor,
  concatenated in tensor order. ``slot_stride`` is the payload rounded up to ``ALIGN``
  (4 KiB) so that a slot write never read-modify-writes a page it shares with another slot.
* ``headers.dat``: slot ``s``'s header record (``RECORD_BYTES``) at ``s * RECORD_BYTES``.
  A record holds the format version, the payload length and its CRC32C, the writer's
  clock (``written_ns``, newest wins when two slots hold one key), the namespace digest
  and the block's key, and a CRC32C of the record itself. An all-zero record is an empty
  slot.

A block is *intact* when its record is valid (magic, version, record CRC, digest, length)
and its payload's CRC32C matches. Writers follow ``kvoffload.tiers.fs.block_io``: zero the
record, write the payload, then write the record, so a process killed at any point leaves
either the old intact block, an empty slot, or the new intact block; never a valid record
over a torn payload (a lost page after a power cut is still caught by the payload CRC on
every read).

Capacity: a stored block costs ``slot_stride + RECORD_BYTES`` bytes of disk, so a tier
given ``bytes_to_use`` holds ``bytes_to_use // stored_block_bytes`` slots. Torch-free.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import crc32c as _crc32c

from kvoffload.validation import positive_int

FORMAT_VERSION = 1
MAGIC = b"KVOB"
ALIGN = 4096
RECORD_BYTES = 128
MAX_KEY_BYTES = 64
DIGEST_BYTES = 16

DATA_FILE = "slots.dat"
HEADER_FILE = "headers.dat"
LOCK_FILE = "lock"
INFO_FILE = "namespace.json"

# magic, version, key_len, payload_len, payload_crc, flags, written_ns, digest, key, padding
_BODY = struct.Struct(f"<4sHHQIIQ{DIGEST_BYTES}s{MAX_KEY_BYTES}s12x")
_CRC = struct.Struct("<I")
assert _BODY.size + _CRC.size == RECORD_BYTES
BODY_BYTES = _BODY.size
EMPTY_RECORD = bytes(RECORD_BYTES)

# Field offsets inside a record, for vectorised scans (kvoffload.tiers.fs.scan).
OFF_VERSION = 4
OFF_KEY_LEN = 6
OFF_PAYLOAD_LEN = 8
OFF_WRITTEN_NS = 24
OFF_DIGEST = 32
OFF_KEY = OFF_DIGEST + DIGEST_BYTES


def checksum(buffers, value: int = 0) -> int:
    """CRC32C (the ``crc32c`` package) over ``buffers`` (bytes-like objects) in order,
    continuing from ``value``. The GIL is released for every buffer, small ones too (the
    package's default keeps it below 32 KiB): the I/O threads checksum pages of a few KiB
    side by side (``bench/bench_disk.py``: cold loads 1.3-1.5x faster with 4 threads)."""
    for buf in buffers:
        value = _crc32c.crc32c(buf, value, gil_release_mode=1)
    return value


def record_crc(body) -> int:
    return _crc32c.crc32c(body)


@dataclass(frozen=True)
class Geometry:
    """Where slot ``s`` lives for blocks of ``payload_bytes``."""

    payload_bytes: int

    def __post_init__(self) -> None:
        positive_int("payload_bytes", self.payload_bytes)

    @property
    def slot_stride(self) -> int:
        return -(-self.payload_bytes // ALIGN) * ALIGN

    @property
    def stored_block_bytes(self) -> int:
        """Disk bytes one block takes: its slot and its header record."""
        return self.slot_stride + RECORD_BYTES

    def num_slots(self, bytes_to_use: int) -> int:
        """Slots that fit in ``bytes_to_use``; ``ValueError`` naming it when none does."""
        positive_int("bytes_to_use", bytes_to_use)
        count = bytes_to_use // self.stored_block_bytes
        if count == 0:
            raise ValueError(
                f"bytes_to_use={bytes_to_use} holds no block ({self.stored_block_bytes} bytes each: "
                f"{self.payload_bytes} payload padded to {self.slot_stride}, "
                f"plus a {RECORD_BYTES}-byte header)"
            )
        return count

    def data_offset(self, slot: int) -> int:
        return slot * self.slot_stride


@dataclass(frozen=True)
class Record:
    """A parsed, self-consistent header record."""

    key: bytes
    payload_len: int
    payload_crc: int
    written_ns: int
    digest: bytes


class RecordError(ValueError):
    """A header record that is empty, torn or foreign; the message says which."""


def pack_record(key: bytes, payload_len: int, payload_crc: int, written_ns: int, digest: bytes) -> bytes:
    """The ``RECORD_BYTES`` header of a block."""
    if not 0 < len(key) <= MAX_KEY_BYTES:
        raise ValueError(f"key must be 1..{MAX_KEY_BYTES} bytes, got {len(key)} bytes: {key!r}")
    if len(digest) != DIGEST_BYTES:
        raise ValueError(f"namespace digest must be {DIGEST_BYTES} bytes, got {len(digest)}")
    body = _BODY.pack(MAGIC, FORMAT_VERSION, len(key), payload_len, payload_crc, 0, written_ns, digest, key)
    return body + _CRC.pack(record_crc(body))


def parse_record(raw: bytes) -> Record:
    """The record in ``raw``; ``RecordError`` saying why it is not a valid one."""
    if len(raw) < RECORD_BYTES:
        raise RecordError(f"header record truncated ({len(raw)} of {RECORD_BYTES} bytes)")
    body = raw[:BODY_BYTES]
    magic, version, key_len, payload_len, payload_crc, _flags, written_ns, digest, key = _BODY.unpack(body)
    if magic != MAGIC:
        if raw[:RECORD_BYTES] == EMPTY_RECORD:
            raise RecordError("empty slot (no header record)")
        raise RecordError(f"bad header magic {magic!r}")
    (stored_crc,) = _CRC.unpack_from(raw, BODY_BYTES)
    if record_crc(body) != stored_crc:
        raise RecordError("header record checksum mismatch")
    if version != FORMAT_VERSION:
        raise RecordError(f"format version {version}, expected {FORMAT_VERSION}")
    if not 0 < key_len <= MAX_KEY_BYTES:
        raise RecordError(f"bad key length {key_len}")
    return Record(key[:key_len], payload_len, payload_crc, written_ns, digest)
