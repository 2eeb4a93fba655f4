"""``RespStream``: RESP2 on a connected socket, with vectored sends from the caller's
buffers, replies read into a buffer of its own, and the socket handed off to a receiver
that reads it itself (``kvoffload.tiers.redis._pipelines``, which receives bulk replies
straight into the caller's buffers).

The stream borrows a socket that is connected and ready for commands (authenticated, its
database selected, TLS negotiated: redis-py does that); it never connects, closes or
retries. Every socket call is bounded by the socket's own timeout.

* ``send(buffers)``: writes the buffers in order without joining them (``sendmsg``, resumed
  after partial sends; a TLS socket, which has no ``sendmsg``, gets them one by one).
* ``reply()``: the next reply read whole: ``bytes`` (simple or bulk string), ``int``,
  ``None`` (a null), a list (array, set, or a map's keys and values in turn), or a
  ``ServerError`` (an error reply is returned, not raised: the server answered). RESP2
  and RESP3 both (redis-py negotiates RESP3 by default); RESP3 pushes are dropped. A
  reply nested more than 32 levels deep is malformed.
* ``bulk(n)``: the next reply where a bulk string of ``n`` bytes is expected: a view of
  its bytes in the receive buffer, valid until the next call; otherwise its length (``-1``
  for a null; a bulk string of another length is skipped, never held whole) or its
  ``ServerError``. ``bulk_length()``, ``take(n)`` and ``skip(n)`` are its pieces.
* ``hand_off(limit)`` and ``unread(data)``: for a receiver that reads the socket itself
  (``kvoffload.tiers.redis._pipelines``): its descriptor, its timeout and the buffered
  bytes (taken), then the bytes it read past what it wanted, given back to read first.
  ``can_hand_off`` says whether the socket allows it: a plain one does; a TLS one, whose
  descriptor carries encrypted bytes, does not (the caller reads replies as above).

Replies are read into a receive buffer of the calling thread (reused from batch to batch,
grown to four times the largest value taken), as many bytes per call as have arrived: a
pipeline of values takes few calls, and each value is copied once, from there to where the
caller wants it. One stream per thread at a time.

Malformed input raises ``ProtocolError``; a closed connection ``ConnectionError``; socket
errors and timeouts propagate. After any exception the stream and its socket are in an
unknown state: the caller must drop the connection.
"""

from __future__ import annotations

import os
import ssl
import threading
from collections.abc import Sequence
from typing import Any

_CRLF = b"\r\n"
_BUFFER = 1 << 20  # a thread's receive buffer, to begin with; it grows to 4x the largest value
_MAX_LINE = 1 << 16
_MAX_BULK = 512 << 20  # the server's proto-max-bulk-len default: a longer length is garbage
# Replies to kvoffload's commands are flat, a push or a cluster reply a few levels deep: one
# nested deeper is garbage, refused before each level's Python frame exhausts the stack.
_MAX_DEPTH = 32
_local = threading.local()
_IOV = max(16, min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024))


class ProtocolError(Exception):
    """The server sent something that is not the RESP reply expected."""


class ServerError:
    """An error reply (``-ERR ...``, ``-OOM ...``, ``-MOVED ...``): the server refused one command."""

    __slots__ = ("message",)

    def __init__(self, message: str) -> None:
        self.message = message

    def __repr__(self) -> str:
        return f"ServerError({self.message!r})"


def command(*args: bytes | str | int) -> bytes:
    """One command of small arguments, framed."""
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        data = arg if isinstance(arg, bytes) else str(arg).encode()
        parts += (b"$%d\r\n" % len(data), data, _CRLF)
    return b"".join(parts)


def bulk_head(nbytes: int) -> bytes:
    """The framing before an argument of ``nbytes`` bytes (a CRLF follows the argument)."""
    return b"$%d\r\n" % nbytes


class RespStream:
    def __init__(self, sock: Any) -> None:
        self._sock = sock
        self._vectored = not isinstance(sock, ssl.SSLSocket) and hasattr(sock, "sendmsg")
        self.can_hand_off = self._vectored  # a plain socket, not TLS: see hand_off
        buffer = getattr(_local, "buffer", None)  # one per thread, reused: no allocation per batch
        if buffer is None:
            buffer = _local.buffer = bytearray(_BUFFER)
        self._buf = buffer
        self._view = memoryview(buffer)
        self._start = 0  # unread bytes are _buf[_start:_end]
        self._end = 0

    # -- sending -------------------------------------------------------------------------

    def send(self, buffers: Sequence[Any]) -> None:
        views = [v for v in (memoryview(b).cast("B") for b in buffers) if v.nbytes]
        if not self._vectored:
            for view in views:
                self._sock.sendall(view)
            return
        sock, i = self._sock, 0
        while i < len(views):
            sent = sock.sendmsg(views[i : i + _IOV])
            while sent:
                n = views[i].nbytes
                if sent >= n:
                    sent -= n
                    i += 1
                else:
                    views[i] = views[i][sent:]
                    sent = 0

    # -- receiving -----------------------------------------------------------------------

    def _need(self, nbytes: int) -> None:
        """At least ``nbytes`` unread bytes in the buffer: reads as much as has arrived (up
        to the buffer's end), so a batch's replies come in with few calls."""
        if self._end - self._start >= nbytes:
            return
        if self._start + nbytes > len(self._buf):  # no room after the unread bytes
            unread = self._end - self._start
            if nbytes > len(self._buf):
                if nbytes > _MAX_BULK + 64:
                    raise ProtocolError(f"a reply of {nbytes} bytes (more than {_MAX_BULK})")
                grown = bytearray(max(4 * nbytes, 2 * len(self._buf)))
                grown[:unread] = self._view[self._start : self._end]
                self._buf = _local.buffer = grown
                self._view = memoryview(grown)
            else:
                self._view[:unread] = self._view[self._start : self._end]
            self._start, self._end = 0, unread
        recv_into, view = self._sock.recv_into, self._view
        while self._end - self._start < nbytes:
            n = recv_into(view[self._end :])
            if n == 0:
                raise ConnectionError("the server closed the connection")
            self._end += n

    def _line(self) -> bytes:
        while True:
            at = self._buf.find(_CRLF, self._start, self._end)
            if at >= 0:
                line = bytes(self._view[self._start : at])
                self._start = at + 2
                return line
            if self._end - self._start > _MAX_LINE:
                raise ProtocolError(f"a reply line longer than {_MAX_LINE} bytes")
            self._need(self._end - self._start + 1)

    def _length(self, text: bytes) -> int:
        try:
            n = int(text)
        except ValueError:
            raise ProtocolError(f"bad length {text[:40]!r} in a reply") from None
        if n < -1:
            raise ProtocolError(f"bad length {n} in a reply")
        return n

    def _head(self, depth: int = 0) -> bytes:
        """The next reply's first line; out-of-band RESP3 pushes and attributes before it
        are read and dropped (nothing kvoffload asked for)."""
        while True:
            line = self._line()
            if line[:1] not in (b">", b"|"):
                return line
            n = self._length(line[1:])
            for _ in range(n * 2 if line[:1] == b"|" else n):
                self._reply(depth + 1)

    def _bulk(self, n: int) -> bytes:
        if n > _MAX_BULK:
            raise ProtocolError(f"a bulk string of {n} bytes (more than {_MAX_BULK})")
        data = self.take(n + 2)
        if data[n:] != _CRLF:
            raise ProtocolError("a bulk string not followed by CRLF")
        return bytes(data[:n])

    def reply(self) -> Any:
        return self._reply(0)

    def _reply(self, depth: int) -> Any:
        if depth > _MAX_DEPTH:
            raise ProtocolError(f"a reply nested more than {_MAX_DEPTH} levels deep")
        line = self._head(depth)
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest
        if kind == b"-":
            return ServerError(rest.decode(errors="replace"))
        if kind in (b"$", b"=", b"!"):  # bulk, verbatim (a 4-byte format, then the text), blob error
            n = self._length(rest)
            if n == -1:
                return None
            data = self._bulk(n)
            if kind == b"!":
                return ServerError(data.decode(errors="replace"))
            return data[4:] if kind == b"=" else data
        if kind == b"_":
            return None
        if kind in (b"*", b"~", b"%"):
            n = self._length(rest)
            return None if n == -1 else [self._reply(depth + 1) for _ in range(n * 2 if kind == b"%" else n)]
        try:
            if kind in (b":", b"("):
                return int(rest)
            if kind == b",":
                return float(rest)
            if kind == b"#" and rest in (b"t", b"f"):
                return rest == b"t"
        except ValueError:
            pass
        raise ProtocolError(f"unexpected reply {line[:40]!r}")

    def bulk_length(self) -> int | ServerError:
        line = self._head()
        kind = line[:1]
        if kind == b"$":
            return self._length(line[1:])
        if kind == b"_":
            return -1
        if kind == b"-":
            return ServerError(line[1:].decode(errors="replace"))
        if kind == b"!":
            return ServerError(self._bulk(self._length(line[1:])).decode(errors="replace"))
        raise ProtocolError(f"expected a bulk string, got {line[:40]!r}")

    def bulk(self, nbytes: int) -> memoryview | int | ServerError:
        """The next reply where a bulk string of ``nbytes`` bytes is expected: a view of
        them (valid until the next call on the stream); otherwise the reply's length
        (``-1``: a null; a bulk string of another length is dropped unread) or its
        ``ServerError``."""
        at = self._buf.find(_CRLF, self._start, self._end)
        if at > self._start and self._buf[self._start] == 36:  # "$": the common case, inline
            length = self._length(self._buf[self._start + 1 : at])
            self._start = at + 2
        else:
            length = self.bulk_length()
        if length != nbytes:
            if isinstance(length, int) and length >= 0:
                self.skip(length + 2)
            return length
        view = self.take(nbytes + 2)
        if view[nbytes:] != _CRLF:
            raise ProtocolError("a bulk string not followed by CRLF")
        return view[:nbytes]

    def take(self, nbytes: int) -> memoryview:
        """The next ``nbytes`` bytes, as a view into the stream's buffer that is valid only
        until the next call on the stream."""
        self._need(nbytes)
        start = self._start
        self._start += nbytes
        return self._view[start : start + nbytes]

    def skip(self, nbytes: int) -> None:
        """Drop the next ``nbytes`` bytes (without holding them all at once)."""
        while nbytes:
            self._need(1)
            n = min(nbytes, self._end - self._start)
            self._start += n
            nbytes -= n

    # -- a receiver that reads the socket itself ------------------------------------------

    def hand_off(self, limit: int) -> tuple[int, float, bytes]:
        """For a receiver that reads the socket itself (``_pipelines``): the socket's file
        descriptor, its timeout in seconds (``-1.0``: none) and the stream's buffered
        unread bytes, at most ``limit`` of them, which are taken: they come first."""
        n = min(limit, self._end - self._start)
        taken = bytes(self._view[self._start : self._start + n])
        self._start += n
        timeout = self._sock.gettimeout()
        return self._sock.fileno(), -1.0 if timeout is None else float(timeout), taken

    @property
    def buffered(self) -> int:
        """Bytes received and not read yet."""
        return self._end - self._start

    def unread(self, data: bytes) -> None:
        """Make ``data`` the stream's next unread bytes (before any it still buffers)."""
        if not data:
            return
        data = b"".join((data, self._view[self._start : self._end]))
        if len(data) > len(self._buf):
            self._buf = _local.buffer = bytearray(max(len(data), 2 * len(self._buf)))
            self._view = memoryview(self._buf)
        self._view[: len(data)] = data
        self._start, self._end = 0, len(data)
