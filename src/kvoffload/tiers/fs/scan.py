"""Rebuilding a tier's index from a namespace directory (done once, at start-up).

``scan_namespace(ns_dir, geometry, num_slots, digest, max_key_bytes, verify=False)`` reads
the header file in one pass and returns the intact blocks of slots ``0 .. num_slots-1``,
oldest write first (so an LRU order rebuilt from them puts the newest last):

* a record counts when its magic, format version, record CRC, namespace digest, key
  length (``<= max_key_bytes``) and payload length (the geometry's) are right, and its
  slot lies wholly inside ``slots.dat`` (a truncated data file drops the blocks it cut);
* non-empty records that fail any of this are *torn* (counted, left out);
* a key held by several slots keeps its newest write (the others are ``duplicates``);
* ``verify=True`` also reads every kept payload and checks its CRC (a full read of the
  tier: for audits, not for every start); mismatches count as torn.

``scan_ranks(namespaces, ...)`` scans the namespaces of every rank's share of the blocks
(tensor parallelism: one namespace per worker, slots handed out by one manager) and keeps
a block only where every rank holds it intact in the same slot; the others count as
``partial``.

It opens files read-only, never writes, and tolerates missing files (an empty tier).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
from crc32c import crc32c

from kvoffload.tiers.fs.format import (
    BODY_BYTES,
    DATA_FILE,
    DIGEST_BYTES,
    FORMAT_VERSION,
    HEADER_FILE,
    MAGIC,
    OFF_DIGEST,
    OFF_KEY,
    OFF_KEY_LEN,
    OFF_PAYLOAD_LEN,
    OFF_VERSION,
    OFF_WRITTEN_NS,
    RECORD_BYTES,
    Geometry,
    checksum,
    parse_record,
)


@dataclass
class ScanResult:
    """Intact blocks (``slots[i]`` holds ``keys[i]``), oldest write first, and what was
    left out."""

    slots: list[int] = field(default_factory=list)
    keys: list[bytes] = field(default_factory=list)
    torn: int = 0
    duplicates: int = 0
    partial: int = 0  # blocks some rank's share lacked (scan_ranks)


def scan_namespace(
    ns_dir: str | os.PathLike,
    geometry: Geometry,
    num_slots: int,
    digest: bytes,
    max_key_bytes: int,
    verify: bool = False,
) -> ScanResult:
    result = ScanResult()
    try:
        with open(os.path.join(ns_dir, HEADER_FILE), "rb") as f:
            raw = f.read(num_slots * RECORD_BYTES)
    except FileNotFoundError:
        return result
    try:
        data_size = os.stat(os.path.join(ns_dir, DATA_FILE)).st_size
    except FileNotFoundError:
        data_size = 0
    count = len(raw) // RECORD_BYTES
    if not count:
        return result
    records = np.frombuffer(raw, dtype=np.uint8, count=count * RECORD_BYTES).reshape(count, RECORD_BYTES)
    nonempty = records.any(axis=1)
    header = records[:, :OFF_PAYLOAD_LEN]
    magic_ok = (header[:, :4] == np.frombuffer(MAGIC, dtype=np.uint8)).all(axis=1)
    version = records[:, OFF_VERSION : OFF_VERSION + 2].copy().view("<u2")[:, 0]
    key_len = records[:, OFF_KEY_LEN : OFF_KEY_LEN + 2].copy().view("<u2")[:, 0]
    payload_len = records[:, OFF_PAYLOAD_LEN : OFF_PAYLOAD_LEN + 8].copy().view("<u8")[:, 0]
    written = records[:, OFF_WRITTEN_NS : OFF_WRITTEN_NS + 8].copy().view("<u8")[:, 0]
    digest_ok = (records[:, OFF_DIGEST : OFF_DIGEST + DIGEST_BYTES] == np.frombuffer(digest, np.uint8)).all(1)
    slots = np.arange(count, dtype=np.int64)
    fits = slots * geometry.slot_stride + geometry.payload_bytes <= data_size
    candidate = (
        magic_ok
        & (version == FORMAT_VERSION)
        & (key_len > 0)
        & (key_len <= max_key_bytes)
        & (payload_len == geometry.payload_bytes)
        & digest_ok
        & fits
    )
    # The record CRC, one record at a time (the only per-record Python work).
    candidates = np.flatnonzero(candidate)
    stored = records[candidates, BODY_BYTES:RECORD_BYTES].copy().view("<u4")[:, 0]
    starts = (candidates * RECORD_BYTES).tolist()
    computed = np.fromiter(
        (crc32c(raw[at : at + BODY_BYTES]) for at in starts), dtype=np.uint32, count=len(starts)
    )
    good = candidates[computed == stored]
    result.torn = int(nonempty.sum()) - len(good)
    if not len(good):
        return result
    good = good[np.argsort(written[good], kind="stable")]  # oldest write first
    lengths = key_len[good].tolist()
    keys = [raw[at : at + n] for at, n in zip((good * RECORD_BYTES + OFF_KEY).tolist(), lengths)]
    slots = good.tolist()
    newest = dict(zip(keys, slots))
    if len(newest) != len(keys):  # a key in several slots: keep its newest write, in write order
        newest = {}
        for key, slot in zip(keys, slots):
            if key in newest:
                result.duplicates += 1
                del newest[key]
            newest[key] = slot
    if verify:
        newest = _verified(ns_dir, geometry, raw, newest, result)
    result.keys = list(newest)
    result.slots = list(newest.values())
    return result


def scan_ranks(
    namespaces: list[tuple[str | os.PathLike, bytes]],
    geometry: Geometry,
    num_slots: int,
    max_key_bytes: int,
    verify: bool = False,
) -> ScanResult:
    """``scan_namespace`` of each ``(ns_dir, digest)``, rank 0 first, joined: the blocks
    every rank holds in the same slot, in rank 0's order; counts summed."""
    scans = [scan_namespace(p, geometry, num_slots, d, max_key_bytes, verify) for p, d in namespaces]
    result = scans[0]
    seen = set(result.keys)
    for other in scans[1:]:
        result.torn += other.torn
        result.duplicates += other.duplicates
        seen.update(other.keys)
        held = dict(zip(other.keys, other.slots))
        kept = [(key, slot) for key, slot in zip(result.keys, result.slots) if held.get(key) == slot]
        result.keys = [key for key, _ in kept]
        result.slots = [slot for _, slot in kept]
    result.partial = len(seen) - len(result.keys)
    return result


def _verified(ns_dir, geometry: Geometry, raw: bytes, blocks: dict[bytes, int], result: ScanResult):
    kept: dict[bytes, int] = {}
    buf = bytearray(geometry.payload_bytes)
    fd = os.open(os.path.join(ns_dir, DATA_FILE), os.O_RDONLY)
    try:
        for key, slot in blocks.items():
            record = parse_record(raw[slot * RECORD_BYTES : (slot + 1) * RECORD_BYTES])
            n = os.preadv(fd, [buf], geometry.data_offset(slot))
            if n == len(buf) and checksum([buf]) == record.payload_crc:
                kept[key] = slot
            else:
                result.torn += 1
    finally:
        os.close(fd)
    return kept
