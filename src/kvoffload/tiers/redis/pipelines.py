"""The worker's two hot batches on a ``RespStream``: values are sent from where their
payload lies (no join) and read with one copy into where it goes.

* ``set_nx(stream, items, ttl)``: one pipeline of ``SET name value NX [EX ttl]``; an item
  is ``(name, head, payload)``, the value being ``head`` (``format.head``) followed by the
  ``payload`` buffers, which go to ``sendmsg`` as they are (no join). Per item: ``b"OK"``
  (written), ``None`` (present already, left as it is), or a ``ServerError``.
* ``get_into(stream, items, digest)``: one pipeline of ``GET name``; an item is ``(name,
  key, rows)``, ``rows`` the writable buffers the payload fills in order. Per item:
  ``True`` (the payload passed every check of ``format.check_head`` and the CRC32C and is
  now in ``rows``), ``None`` (no such key), a ``CorruptValue`` (a value of another
  length, header, key, namespace or CRC), or a ``ServerError``. A value is checked where
  the stream received it (its buffer) and copied into ``rows`` only once it passed: bytes
  of a value that failed a check never reach them (one copy, as redis-benchmark's reader
  makes one too).

Socket errors, timeouts and protocol errors raise (the caller drops the connection); the
rows of items not answered ``True`` are left as they were.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import crc32c as _crc32c

from kvoffload.tiers.redis.format import HEADER_BYTES, CorruptValue, check_head
from kvoffload.tiers.redis.resp import RespStream, ServerError, bulk_head, command

_SET = b"$3\r\nSET\r\n"
_NX = b"\r\n$2\r\nNX\r\n"


def set_nx(
    stream: RespStream, items: Sequence[tuple[bytes, bytes, Sequence[Any]]], ttl: int | None = None
) -> list[Any]:
    first = b"*4\r\n" if ttl is None else b"*6\r\n"
    tail = _NX if ttl is None else _NX + command(b"EX", ttl)[4:]  # the arguments without "*2"
    buffers: list[Any] = []
    carry = b""  # the end of the previous command goes out with the start of the next
    for name, head, payload in items:
        size = len(head) + sum(memoryview(part).nbytes for part in payload)
        framing = (carry, first, _SET, bulk_head(len(name)), name, b"\r\n", bulk_head(size), head)
        buffers.append(b"".join(framing))
        buffers.extend(payload)
        carry = tail
    buffers.append(carry)
    stream.send(buffers)
    return [stream.reply() for _ in items]


def get_into(
    stream: RespStream, items: Sequence[tuple[bytes, bytes, Sequence[memoryview]]], digest: bytes
) -> list[Any]:
    stream.send([b"".join(b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(name), name) for name, _, _ in items)])
    return [_one(stream, key, rows, digest) for _, key, rows in items]


def _one(stream: RespStream, key: bytes, rows: Sequence[memoryview], digest: bytes) -> Any:
    payload = sum(row.nbytes for row in rows)
    expected = HEADER_BYTES + len(key) + payload
    value = stream.bulk(expected)  # a view valid until the next call on the stream
    if not isinstance(value, memoryview):
        if value == -1:
            return None
        if isinstance(value, ServerError):
            return value
        return CorruptValue(f"value of {value} bytes, expected {expected}")  # not read into the rows
    try:
        recorded = check_head(value, key, digest, payload, expected)
    except CorruptValue as exc:
        return exc
    if _crc32c.crc32c(value[HEADER_BYTES:]) != recorded:
        return CorruptValue("CRC32C mismatch")
    offset = HEADER_BYTES + len(key)
    for row in rows:  # only now: bytes of a value that failed a check never reach the rows
        row[:] = value[offset : offset + row.nbytes]
        offset += row.nbytes
    return True
