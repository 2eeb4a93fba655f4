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

A lane (``lanes``) queues a batch planned here (``planned_set_nx``, ``planned_get``) into C,
which sends it the moment the batch before it is answered; what C could not answer is
finished here (``set_replies``, ``get_replies``).

Socket errors, timeouts and protocol errors raise (the caller drops the connection); the
rows of items not answered ``True`` hold unspecified bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
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


def planned_set_nx(
    items: Sequence[tuple[bytes, bytes, Sequence[Any]]], digest: bytes, ttl: int | None, native: bool
) -> tuple[list[Any], list[tuple[int, int, int, int]]]:
    """The buffers of a ``SET NX`` batch and, ``native``, the checksums C fills in (else
    each header carries its CRC32C already)."""
    first = b"*4\r\n" if ttl is None else b"*6\r\n"
    tail = _NX if ttl is None else _NX + command(b"EX", ttl)[4:]  # the arguments without "*2"
    buffers: list[Any] = []
    checksums: list[tuple[int, int, int, int]] = []  # C fills in each header's CRC32C
    carry = b""  # the end of the previous command goes out with the start of the next
    # native: the framing of one shape (name, key and payload lengths) made once
    shapes: dict[tuple[int, int, int], tuple[bytes, bytes]] = {}
    for name, key, payload in items:
        nbytes = sum([memoryview(part).nbytes for part in payload])
        if native:  # the framing before the name, and after it up to the key (a zero CRC field)
            shape = (len(name), len(key), nbytes)
            parts = shapes.get(shape)
            if parts is None:
                header = head_template(key, nbytes, digest)[:HEADER_BYTES]
                lead = first + _SET + bulk_head(len(name))
                parts = shapes[shape] = (lead, b"\r\n" + bulk_head(HEADER_BYTES + len(key) + nbytes) + header)
            framing = bytearray(b"".join((carry, parts[0], name, parts[1], key)))
            crc_at = len(framing) - len(key) - HEADER_BYTES + CRC_AT
            checksums.append((len(buffers), crc_at, len(key), len(payload)))
        else:
            value_head = head(key, payload, digest)
            size = len(value_head) + nbytes
            framing = b"".join(
                (carry, first, _SET, bulk_head(len(name)), name, b"\r\n", bulk_head(size), value_head)
            )
        buffers.append(framing)
        buffers.extend(payload)
        carry = tail
    buffers.append(carry)
    return buffers, checksums


def set_nx(
    stream: RespStream,
    items: Sequence[tuple[bytes, bytes, Sequence[Any]]],
    digest: bytes,
    ttl: int | None = None,
) -> list[Any]:
    native = stream.can_hand_off and _pipelines is not None
    buffers, checksums = planned_set_nx(items, digest, ttl, native)
    if not native:
        stream.send(buffers)
        return [stream.reply() for _ in items]
    fd, timeout, buffered = stream.hand_off(1 << 62)
    lines, unread = _pipelines.set_nx(fd, timeout, buffers, buffered, len(items), checksums)
    return set_replies(stream, lines, unread, len(items))


def set_replies(stream: RespStream | None, lines: list[bytes], unread: bytes, count: int) -> list[Any]:
    """The replies of a ``SET NX`` batch of ``count`` whose first ``lines`` C read; the rest
    (from ``unread`` on) read on ``stream`` (``None``: C read them all)."""
    replies: list[Any] = [_ONE_LINE.get(line) or _one_line(line) for line in lines]
    if len(replies) == count:
        return replies
    assert stream is not None, "a batch C did not answer in full needs its stream"
    stream.unread(unread)
    return replies + [stream.reply() for _ in range(count - len(replies))]


_ONE_LINE = {b"+OK": b"OK"}


def _one_line(line: bytes) -> Any:
    """What ``RespStream.reply`` gives for a one-line reply ``_pipelines.set_nx`` read."""
    if line[:1] == b"+":
        return line[1:]
    if line[:1] == b"-":
        return ServerError(line[1:].decode(errors="replace"))
    return None  # $-1 or _: a null


def planned_get(
    items: Sequence[tuple[bytes, bytes, Sequence[memoryview]]], digest: bytes
) -> tuple[bytes, list]:
    """The request of a ``GET`` batch and its plan for C (``_planned``)."""
    return _request(items), _planned(items, digest)[0]


def _request(items: Sequence[tuple[bytes, bytes, Any]]) -> bytes:
    return b"".join(b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(name), name) for name, _, _ in items)


def get_into(
    stream: RespStream, items: Sequence[tuple[bytes, bytes, Sequence[memoryview]]], digest: bytes
) -> list[Any]:
    if not (stream.can_hand_off and items and _pipelines is not None):
        stream.send([_request(items)])
        return [_one(stream, key, rows, digest) for _, key, rows in items]
    plan, total = _planned(items, digest)
    fd, timeout, buffered = stream.hand_off(total)
    try:
        answers, unread = _pipelines.get_into(fd, timeout, _request(items), buffered, plan)
    except ValueError as exc:
        raise ProtocolError(str(exc)) from None
    return get_replies(stream, answers, unread, plan, digest)


def get_replies(
    stream: RespStream | None, answers: list[Any], unread: bytes, plan: list, digest: bytes
) -> list[Any]:
    """Per item of a ``GET`` batch planned as ``plan``, whose first ``answers`` C gave: the
    results (as ``get_into``'s); the rest, from ``unread`` on, read on ``stream`` (``None``:
    C answered every item)."""
    if len(answers) == len(plan) and all(answer is True for answer in answers):
        return answers
    results: list[Any] = []
    for answer, (_, _, key, rows) in zip(answers, plan):
        if answer is True:
            results.append(True)
        elif answer is False:
            results.append(CorruptValue("CRC32C mismatch"))
        else:  # the head of a value of the planned length, not as planned
            results.append(_why_bad(answer, key, digest, sum([row.nbytes for row in rows])))
    if len(results) < len(plan):
        assert stream is not None, "a batch C did not answer in full needs its stream"
        stream.unread(unread)
        results += [_one(stream, key, rows, digest) for _, _, key, rows in plan[len(results) :]]
    return results


def _planned(
    items: Sequence[tuple[bytes, bytes, Sequence[memoryview]]], digest: bytes
) -> tuple[list[tuple[bytes, int, bytes, list]], int]:
    """The plan of a ``GET`` batch for ``_pipelines.get_into`` and the bytes its replies
    take. Per item: the bytes planned before its payload (the previous value's CRLF but for
    the first, ``$<length>\r\n``, its header with a zero CRC field, its key), how many of
    them are that lead, its key, its rows. The heads of one shape are made once."""
    plan, total, heads = [], 2, {}
    for _, key, rows in items:
        rows = rows if type(rows) is list else list(rows)
        payload = sum([row.nbytes for row in rows])
        shape = (len(key), payload, not plan)
        head = heads.get(shape)
        if head is None:
            head = heads[shape] = _lead_and_header(len(key), payload, digest, not plan)
        expected = head[0] + key
        plan.append((expected, head[1], key, rows))
        total += len(expected) + payload
    return plan, total


def _lead_and_header(key_len: int, payload: int, digest: bytes, first: bool) -> tuple[bytes, int]:
    """A value's lead (``[\r\n]$<length>\r\n``) and header with a zero CRC field, for a
    key of ``key_len`` bytes (which follows them), and the lead's length."""
    lead = (b"$%d\r\n" if first else b"\r\n$%d\r\n") % (HEADER_BYTES + key_len + payload)
    return lead + head_template(bytes(key_len), payload, digest)[:HEADER_BYTES], len(lead)


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
