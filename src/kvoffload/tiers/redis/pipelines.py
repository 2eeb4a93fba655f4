"""The worker's two hot batches on a ``RespStream``: values are sent from where their
payload lies (no join) and read with one copy into where it goes.

* ``set_nx(stream, items, digest, ttl)``: one pipeline of ``SET name value NX [EX ttl]``;
  an item is ``(name, key, payload)``, the value being ``key``'s head (``format.head``:
  header with the CRC32C of key and payload, then the key) followed by the ``payload``
  buffers, which go to ``sendmsg`` as they are (no join). Per item: ``b"OK"`` (written),
  ``None`` (present already, left as it is), or a ``ServerError``.
* ``get_into(stream, items, digest)``: one pipeline of ``GET name``; an item is ``(name,
  key, rows)``, ``rows`` the writable buffers the payload fills in order. Per item:
  ``True`` (the payload passed every check of ``format.check_head`` and the CRC32C and is
  now in ``rows``), ``None`` (no such key), a ``CorruptValue`` (a value of another
  length, header, key, namespace or CRC), or a ``ServerError``.

Each batch runs one of two ways:

* **C** (``kvoffload.tiers.redis._pipelines``, built at install where a compiler is
  present), on a stream that can hand its socket off (a plain socket, not TLS): the batch
  is sent and answered on one release of the GIL. A load's replies are planned before they
  come: each expected as ``$<value length>`` with its header and key in a small scratch
  buffer and its payload received by the kernel straight into ``rows``, then checked there
  (header, key, namespace digest with one comparison either side of the CRC field; CRC32C
  as the bytes arrive). The first reply that is not what was planned (a null, an error, a
  value of another length) ends the plan: the bytes from it on are handed back to the
  stream and the rest of the batch is read as below. A value of the expected length that
  fails a check has been received into its rows: they hold garbage, the item is not
  ``True``, and the caller must fail the load (the rows of a failed load are unspecified;
  nothing makes them loadable). A store's CRC32Cs are written into each value's header
  just before it is sent, and its one-line replies read there too; a reply it does not
  expect is left to the stream.
* **Python** (TLS, or the C module not built): the stores' values go out with
  ``RespStream.send``; each ``GET`` reply is read into the stream's buffer, checked there
  and copied into ``rows`` only once it passed (the rows of a bad value are left as they
  were). It takes the GIL back per socket call, which costs up to the switch interval each
  time while an engine's Python loop is busy.

Socket errors, timeouts and protocol errors raise (the caller drops the connection); the
rows of items not answered ``True`` hold unspecified bytes.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from kvoffload.tiers.redis.format import (
    CRC_AT,
    HEADER_BYTES,
    CorruptValue,
    check_head,
    crc32c,
    head,
    head_template,
)
from kvoffload.tiers.redis.resp import ProtocolError, RespStream, ServerError, bulk_head, command

try:  # both batches in C, without the GIL (built at install when a compiler is present)
    from kvoffload.tiers.redis import _pipelines
except ImportError:  # pragma: no cover - depends on the build
    _pipelines = None

_SET = b"$3\r\nSET\r\n"
_NX = b"\r\n$2\r\nNX\r\n"


def set_nx(
    stream: RespStream,
    items: Sequence[tuple[bytes, bytes, Sequence[Any]]],
    digest: bytes,
    ttl: int | None = None,
) -> list[Any]:
    first = b"*4\r\n" if ttl is None else b"*6\r\n"
    tail = _NX if ttl is None else _NX + command(b"EX", ttl)[4:]  # the arguments without "*2"
    native = stream.can_hand_off and _pipelines is not None
    buffers: list[Any] = []
    checksums: list[tuple[int, int, int, int]] = []  # C fills in each header's CRC32C
    carry = b""  # the end of the previous command goes out with the start of the next
    for name, key, payload in items:
        nbytes = sum(memoryview(part).nbytes for part in payload)
        value_head = head_template(key, nbytes, digest) if native else head(key, payload, digest)
        size = len(value_head) + nbytes
        lead = (carry, first, _SET, bulk_head(len(name)), name, b"\r\n", bulk_head(size))
        framing = b"".join((*lead, value_head))
        if native:
            framing = bytearray(framing)
            checksums.append((len(buffers), len(framing) - len(value_head) + CRC_AT, len(key), len(payload)))
        buffers.append(framing)
        buffers.extend(payload)
        carry = tail
    buffers.append(carry)
    if not native:
        stream.send(buffers)
        return [stream.reply() for _ in items]
    fd, timeout, buffered = stream.hand_off(1 << 62)
    lines, unread = _pipelines.set_nx(fd, timeout, buffers, buffered, len(items), checksums)
    stream.unread(unread)
    replies: list[Any] = [_ONE_LINE.get(line) or _one_line(line) for line in lines]
    return replies + [stream.reply() for _ in items[len(lines) :]]


_ONE_LINE = {b"+OK": b"OK"}


def _one_line(line: bytes) -> Any:
    """What ``RespStream.reply`` gives for a one-line reply ``_pipelines.set_nx`` read."""
    if line[:1] == b"+":
        return line[1:]
    if line[:1] == b"-":
        return ServerError(line[1:].decode(errors="replace"))
    return None  # $-1 or _: a null


def get_into(
    stream: RespStream, items: Sequence[tuple[bytes, bytes, Sequence[memoryview]]], digest: bytes
) -> list[Any]:
    request = b"".join(b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(name), name) for name, _, _ in items)
    if not (stream.can_hand_off and items and _pipelines is not None):
        stream.send([request])
        return [_one(stream, key, rows, digest) for _, key, rows in items]
    results = _received(stream, items, digest, request)  # sends the request too
    return results + [_one(stream, key, rows, digest) for _, key, rows in items[len(results) :]]


def _received(
    stream: RespStream,
    items: Sequence[tuple[bytes, bytes, Sequence[memoryview]]],
    digest: bytes,
    request: bytes,
) -> list[Any]:
    """The replies to ``request`` (which it sends first), planned (``_planned_heads``),
    received into the rows and checked by ``_pipelines.get_into``: the whole batch on one
    release of the GIL. The results of the items before the first reply that was not as
    planned (all of them if none); the stream is left at that reply."""
    plan, total = [], 2
    for (_, key, rows), (expected, lead, payload) in zip(items, _planned_heads(items, digest)):
        plan.append((expected, lead, key, rows if isinstance(rows, list) else list(rows)))
        total += len(expected) + payload
    fd, timeout, buffered = stream.hand_off(total)
    try:
        answers, unread = _pipelines.get_into(fd, timeout, request, buffered, plan)
    except ValueError as exc:
        raise ProtocolError(str(exc)) from None
    stream.unread(unread)
    results: list[Any] = []
    for answer, (_, _, key, rows) in zip(answers, plan):
        if answer is True:
            results.append(True)
        elif answer is False:
            results.append(CorruptValue("CRC32C mismatch"))
        else:  # the head of a value of the planned length, not as planned
            results.append(_why_bad(answer, key, digest, sum([row.nbytes for row in rows])))
    return results


def _planned_heads(
    items: Sequence[tuple[bytes, bytes, Sequence[memoryview]]], digest: bytes
) -> Iterator[tuple[bytes, int, int]]:
    """Per item of a ``GET`` batch: the bytes planned before its payload (the previous
    value's CRLF but for the first, ``$<length>\\r\\n``, its header with a zero CRC field,
    its key), how many of them are that lead, and the payload's length."""
    lead_format = b"$%d\r\n"
    for _, key, rows in items:
        payload = sum([row.nbytes for row in rows])
        lead = lead_format % (HEADER_BYTES + len(key) + payload)
        lead_format = b"\r\n$%d\r\n"  # after the first: the previous value's CRLF first
        yield lead + head_template(key, payload, digest), len(lead), payload


def _why_bad(head: Any, key: bytes, digest: bytes, payload: int) -> CorruptValue:
    """Why a value of the planned length whose ``head`` (header and key) is not the
    planned one is not ``key``'s block."""
    try:
        check_head(head, key, digest, payload, len(head) + payload)
    except CorruptValue as exc:
        return exc
    return CorruptValue("bad header")  # not reached: check_head checks every field but the CRC


def _one(stream: RespStream, key: bytes, rows: Sequence[memoryview], digest: bytes) -> Any:
    """The next ``GET`` reply, read into the stream's buffer, checked there and copied into
    ``rows`` only once it passed."""
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
    if crc32c(value[HEADER_BYTES:]) != recorded:
        return CorruptValue("CRC32C mismatch")
    offset = HEADER_BYTES + len(key)
    for row in rows:  # only now: bytes of a value that failed a check never reach the rows
        row[:] = value[offset : offset + row.nbytes]
        offset += row.nbytes
    return True
