"""The shared tier's values and key names: one Redis key per block.

A value is a fixed header, the block's own key, then the payload (the block's bytes on
the host: its row of every host-pool tensor, in tensor order)::

    magic "KVR1" | version u16 | key length u16 | CRC32C u32 | payload length u64 | digest 16 B

all big-endian. The CRC32C covers the key and the payload; the digest names the
namespace (``namespace_digest``). ``decode`` (or ``check_head`` and the CRC, for a value
read in pieces) accepts a value only if the magic, version, lengths, key, digest and CRC
all match what the reader expects: anything else is a ``CorruptValue`` (a miss that is
deleted and counted, never KV for the engine). ``head`` gives the header and key alone,
so a writer can send the payload from where it lies.

Names: ``<prefix>:<namespace>:<key hex>``. The namespace (``redis_namespace``) hashes
everything that changes the bytes (``TierContext.identity``: model, dtype, layout, block
size, group specs, hash seed, rank) with this format's version, so engines with another
layout never read each other's blocks; ``prefix`` (configurable) keeps kvoffload's keys
apart from the rest of a shared server. No hash tags: a cluster spreads blocks by key.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Mapping, Sequence
from typing import Any

import crc32c as _crc32c

from kvoffload.tiers.identity import canonical_identity

MAGIC = b"KVR1"
FORMAT_VERSION = 1
DIGEST_BYTES = 16
_HEADER = struct.Struct(">4sHHIQ16s")
HEADER_BYTES = _HEADER.size
CRC_AT = 8  # the CRC32C field's offset in the header (after magic, version and key length)
# Below this many bytes a CRC32C keeps the GIL (about 50 us at most): a thread that gives
# the GIL up waits to take it back behind any busy Python thread (up to the interpreter's
# switch interval, 5 ms), which costs far more than the CRC itself; above it, I/O threads
# may checksum in parallel.
CRC_KEEPS_GIL_BELOW = 1 << 20


class CorruptValue(Exception):
    """A stored value that is not the expected block; the message says which check failed."""


def crc32c(data: Any, crc: int = 0) -> int:
    """CRC32C of ``data`` continuing ``crc``; keeps the GIL below ``CRC_KEEPS_GIL_BELOW`` bytes."""
    return _crc32c.crc32c(data, crc, gil_release_mode=int(memoryview(data).nbytes >= CRC_KEEPS_GIL_BELOW))


def redis_namespace(identity: Mapping[str, Any]) -> str:
    """``kvr-`` + 32 hex digits of the identity (JSON-serialisable) and the format version."""
    if not isinstance(identity, Mapping) or not identity:
        raise ValueError(f"namespace identity must be a non-empty mapping, got {identity!r}")
    text = canonical_identity({"format": f"kvoffload-redis:{FORMAT_VERSION}", **identity})
    return "kvr-" + hashlib.sha256(text.encode()).hexdigest()[:32]


def namespace_digest(namespace: str) -> bytes:
    return hashlib.sha256(b"kvoffload-redis-digest:" + namespace.encode()).digest()[:DIGEST_BYTES]


class KeyNames:
    """Redis key names of one namespace: ``name(key)`` and its inverse ``key_of(name)``."""

    def __init__(self, prefix: str, namespace: str) -> None:
        self.base = f"{prefix}:{namespace}:".encode()
        self.digest = namespace_digest(namespace)

    def name(self, key: bytes) -> bytes:
        return self.base + key.hex().encode()

    def names(self, keys: Sequence[bytes]) -> list[bytes]:
        base = self.base
        return [base + key.hex().encode() for key in keys]

    def key_of(self, name: bytes) -> bytes | None:
        """The block key a name holds, or ``None`` if it is not of this namespace."""
        if not name.startswith(self.base):
            return None
        try:
            return bytes.fromhex(name[len(self.base) :].decode())
        except ValueError:
            return None


def value_bytes(payload_bytes: int, key_bytes: int = 36) -> int:
    """Bytes one stored value takes (header, key, payload)."""
    return HEADER_BYTES + key_bytes + payload_bytes


def head(key: bytes, payload: Sequence[Any], digest: bytes) -> bytes:
    """The header and key that precede ``payload`` (its buffers in order) in ``key``'s value:
    a value is ``head(...)`` followed by the payload's bytes, which need not be joined."""
    crc = crc32c(key)
    size = 0
    for part in payload:
        crc = crc32c(part, crc)
        size += memoryview(part).nbytes
    return _HEADER.pack(MAGIC, FORMAT_VERSION, len(key), crc, size, digest) + key


def head_template(key: bytes, payload_bytes: int, digest: bytes) -> bytes:
    """What ``head`` gives for ``key``'s block of ``payload_bytes`` in this namespace, but
    with zeros for the CRC32C (4 bytes at ``CRC_AT``): a value's head that equals it either
    side of the CRC passes every check of ``check_head``."""
    return _HEADER.pack(MAGIC, FORMAT_VERSION, len(key), 0, payload_bytes, digest) + key


def encode(key: bytes, payload: Sequence[Any], digest: bytes) -> bytes:
    """The value of ``key`` whose payload is the concatenation of ``payload``'s buffers."""
    return b"".join((head(key, payload, digest), *payload))


def check_head(value_head: Any, key: bytes, digest: bytes, payload_bytes: int, value_bytes: int) -> int:
    """The CRC32C that ``value_head`` (a value's first ``HEADER_BYTES + len(key)`` bytes, or
    more) records, if the value of ``value_bytes`` bytes is ``key``'s block of this namespace
    with a payload of ``payload_bytes``; ``CorruptValue`` naming the failed check otherwise.
    The caller compares the CRC with the one of the key and payload it holds."""
    if value_bytes < HEADER_BYTES or len(value_head) < HEADER_BYTES:
        raise CorruptValue(f"value of {value_bytes} bytes is shorter than the header")
    magic, version, key_len, crc, size, value_digest = _HEADER.unpack_from(value_head)
    if magic != MAGIC or version != FORMAT_VERSION:
        raise CorruptValue(f"bad magic/version {magic!r}/{version}")
    if value_digest != digest:
        raise CorruptValue("namespace digest differs")
    if size != payload_bytes or value_bytes != HEADER_BYTES + key_len + size:
        got = value_bytes - HEADER_BYTES - key_len
        raise CorruptValue(f"payload of {got} bytes, expected {payload_bytes}")
    if key_len != len(key) or memoryview(value_head)[HEADER_BYTES : HEADER_BYTES + key_len] != key:
        raise CorruptValue("the value holds another key")
    return crc


def decode(value: bytes, key: bytes, digest: bytes, payload_bytes: int) -> memoryview:
    """The payload of ``value`` if it is ``key``'s block of this namespace; ``CorruptValue``
    naming the failed check otherwise."""
    crc = check_head(value, key, digest, payload_bytes, len(value))
    view = memoryview(value)
    if crc32c(view[HEADER_BYTES:]) != crc:
        raise CorruptValue("CRC32C mismatch")
    return view[HEADER_BYTES + len(key) :]
