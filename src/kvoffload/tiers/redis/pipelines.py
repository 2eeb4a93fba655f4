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

  Where the stream scatters (a plain socket), the replies are planned before they come:
  each expected as ``$<value length>`` with its header and key in a small scratch buffer
  and its payload received by the kernel straight into ``rows`` (no copy in Python), then
  checked there (header, key, namespace digest as soon as they are in; CRC32C once the
  payload is). The first reply that is not what was planned (a null, an error, a value of
  another length) ends the plan: the bytes after it are handed back to the stream and the
  rest of the batch is read as below. A value of the expected length that fails a check
  has been received into its rows: they hold garbage, the item is not ``True``, and the
  caller must fail the load (the rows of a failed load are unspecified; nothing makes them
  loadable). On a TLS socket each value is read into the stream's buffer, checked there and
  copied into ``rows`` only once it passed.

On a plain socket, where ``kvoffload.tiers.redis._pipelines`` was built (C), each batch is
sent and answered on one release of the GIL: the load's plan and checks as above, the
stores' CRC32Cs (written into each value's header just before it is sent) and one-line
replies; a reply they do not expect is left to the stream, read as here.
Without it, the same runs in Python (``_Planned``), taking the GIL back per socket call,
which costs up to the switch interval each time while an engine's Python loop is busy.

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
    native = stream.scatters and _pipelines is not None
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
    if stream.scatters and items and _pipelines is not None:
        results = _received(stream, items, digest, request)  # sends the request too
    else:
        stream.send([request])
        if not stream.scatters or not items:
            return [_one(stream, key, rows, digest) for _, key, rows in items]
        results = _Planned(items, digest).receive(stream)
    return results + [_one(stream, key, rows, digest) for _, key, rows in items[len(results) :]]


def _received(
    stream: RespStream,
    items: Sequence[tuple[bytes, bytes, Sequence[memoryview]]],
    digest: bytes,
    request: bytes,
) -> list[Any]:
    """``_Planned``'s plan, received and checked by ``_pipelines.get_into``, which sends
    ``request`` first: the whole batch on one release of the GIL."""
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


class _Planned:
    """A batch of ``GET`` replies received where they go: per item a scratch region for
    what precedes the payload (the previous reply's CRLF, ``$<length>\\r\\n``, header and
    key), then its rows; a last region for the final CRLF. A region's expected bytes are
    known but for the header's CRC field, so one comparison each side of it checks the
    framing, header, key and namespace digest of a good value at once."""

    def __init__(self, items: Sequence[tuple[bytes, bytes, Sequence[memoryview]]], digest: bytes) -> None:
        self.items, self.digest = items, digest
        pieces: list[memoryview] = []
        marks: list[
            tuple[int, memoryview, bytes, int, int, int]
        ] = []  # start, region, expected, lead, head end, end
        at = 0
        for (_, _, rows), (expected, lead, payload) in zip(items, _planned_heads(items, digest)):
            region = memoryview(bytearray(len(expected)))
            pieces.append(region)
            pieces += [
                row if row.format == "B" and row.ndim == 1 else row.cast("B") for row in rows if row.nbytes
            ]
            head_end = at + len(expected)
            marks.append((at, region, expected, lead, head_end, head_end + payload))
            at = head_end + payload
        self.tail = memoryview(bytearray(2))
        pieces.append(self.tail)
        self.pieces, self.marks, self.total = pieces, marks, at + 2
        self.results: list[Any] = []
        self.recorded: int | CorruptValue | None = (
            None  # the current item's header: its CRC, or why it is bad
        )

    def receive(self, stream: RespStream) -> list[Any]:
        """The results of the items before the first reply that was not as planned (all of
        them if none); the stream is left at that reply."""
        stream.scatter(self.pieces, self.watch)
        return self.results

    def watch(self, n: int) -> int | None:
        results, marks = self.results, self.marks
        i = len(results)
        while i < len(marks):
            start, region, expected, lead, head_end, end = marks[i]
            recorded = self.recorded
            if recorded is None:
                if n < head_end:  # the lead so far must be as planned, or the plan ends
                    return self._surprise(i, min(n - start, lead))
                crc_at = lead + CRC_AT
                if region[:crc_at] == expected[:crc_at] and region[crc_at + 4 :] == expected[crc_at + 4 :]:
                    recorded = int.from_bytes(region[crc_at : crc_at + 4], "big")
                else:
                    stop = self._surprise(i, lead)
                    if stop is not None:
                        return stop
                    recorded = self._bad_head(i)
                self.recorded = recorded
            if n < end:
                return None
            self.recorded = None
            if isinstance(recorded, int):
                _, key, rows = self.items[i]
                crc = crc32c(key)
                for row in rows:
                    crc = crc32c(row, crc)
                results.append(True if crc == recorded else CorruptValue("CRC32C mismatch"))
            else:
                results.append(recorded)
            i += 1
        if n == self.total and self.tail != b"\r\n":
            raise ProtocolError("a bulk string not followed by CRLF")
        return None

    def _surprise(self, i: int, got: int) -> int | None:
        """Where the plan ends if the first ``got`` bytes of item ``i``'s lead are not the
        ones planned (a ``ProtocolError`` if the previous value's CRLF is not); else ``None``."""
        start, region, expected = self.marks[i][:3]
        crlf = min(got, 2 if i else 0)  # the previous value's end
        if region[:crlf] != expected[:crlf]:
            raise ProtocolError("a bulk string not followed by CRLF")
        if region[crlf:got] != expected[crlf:got]:
            return start + crlf  # another reply: the rest is read reply by reply
        return None

    def _bad_head(self, i: int) -> CorruptValue:
        """Why item ``i``'s head (a value of the expected length) differs from the plan."""
        _, region, _, lead, head_end, end = self.marks[i]
        return _why_bad(region[lead:], self.items[i][1], self.digest, end - head_end)


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
    if crc32c(value[HEADER_BYTES:]) != recorded:
        return CorruptValue("CRC32C mismatch")
    offset = HEADER_BYTES + len(key)
    for row in rows:  # only now: bytes of a value that failed a check never reach the rows
        row[:] = value[offset : offset + row.nbytes]
        offset += row.nbytes
    return True
