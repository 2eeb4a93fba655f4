"""``RespStream``: RESP2 on a connected socket, with vectored sends from the caller's
buffers and bulk replies read straight into the caller's buffers.

The stream borrows a socket that is connected and ready for commands (authenticated, its
database selected, TLS negotiated: redis-py does that); it never connects, closes or
retries. Every socket call is bounded by the socket's own timeout.

* ``send(buffers)``: writes the buffers in order without joining them (``sendmsg``, resumed
  after partial sends; a TLS socket, which has no ``sendmsg``, gets them one by one).
* ``reply()``: the next reply read whole: ``bytes`` (simple or bulk string), ``int``,
  ``None`` (a null), a list (array, set, or a map's keys and values in turn), or a
  ``ServerError`` (an error reply is returned, not raised: the server answered). RESP2
  and RESP3 both (redis-py negotiates RESP3 by default); RESP3 pushes are dropped.
* ``bulk_length()``: the next reply's first line when a bulk string is expected: its
  length, ``-1`` for a null, or a ``ServerError``. Its bytes are then consumed with
  ``read_into`` (into a caller's buffer, optionally computing a CRC32C as they arrive)
  and ``skip``, then ``end()`` (the closing CRLF).

Malformed input raises ``ProtocolError``; a closed connection ``ConnectionError``; socket
errors and timeouts propagate. After any exception the stream and its socket are in an
unknown state: the caller must drop the connection.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Sequence
from typing import Any

import crc32c as _crc32c

_CRLF = b"\r\n"
_READ = 1 << 16  # the buffer: first lines and small replies come through it
_FILL = 1 << 13  # read into it at most this at once: a value's bytes should go to its caller's buffer
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
        self._buf = bytearray(_READ)
        self._view = memoryview(self._buf)
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

    def _fill(self) -> None:
        """Read more bytes into the buffer (after any unread ones)."""
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._buf):
            if self._start == 0:
                raise ProtocolError(f"a reply line longer than {_READ} bytes")
            unread = self._end - self._start
            self._buf[:unread] = self._buf[self._start : self._end]
            self._start, self._end = 0, unread
        n = self._sock.recv_into(self._view[self._end :], min(_FILL, len(self._buf) - self._end))
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
            self._fill()

    def _length(self, text: bytes) -> int:
        try:
            n = int(text)
        except ValueError:
            raise ProtocolError(f"bad length {text[:40]!r} in a reply") from None
        if n < -1:
            raise ProtocolError(f"bad length {n} in a reply")
        return n

    def _head(self) -> bytes:
        """The next reply's first line; out-of-band RESP3 pushes and attributes before it
        are read and dropped (nothing kvoffload asked for)."""
        while True:
            line = self._line()
            if line[:1] not in (b">", b"|"):
                return line
            n = self._length(line[1:])
            for _ in range(n * 2 if line[:1] == b"|" else n):
                self.reply()

    def _bulk(self, n: int) -> bytes:
        data = bytearray(n)
        self.read_into(memoryview(data))
        self.end()
        return bytes(data)

    def reply(self) -> Any:
        line = self._head()
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
            return None if n == -1 else [self.reply() for _ in range(n * 2 if kind == b"%" else n)]
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

    def read_into(self, view: memoryview, crc: int | None = None) -> int | None:
        """Fill ``view`` (writable, bytes) with the next ``len(view)`` bytes; with ``crc``,
        return it extended over them (computed piece by piece, while they are in cache)."""
        want, got = view.nbytes, min(view.nbytes, self._end - self._start)
        if got:
            view[:got] = self._view[self._start : self._start + got]
            self._start += got
            if crc is not None:
                crc = _crc32c.crc32c(view[:got], crc)
        recv_into = self._sock.recv_into
        while got < want:
            n = recv_into(view[got:])
            if n == 0:
                raise ConnectionError("the server closed the connection mid-reply")
            if crc is not None:
                crc = _crc32c.crc32c(view[got : got + n], crc)
            got += n
        return crc

    def skip(self, nbytes: int) -> None:
        while nbytes:
            if self._start == self._end:
                self._fill()
            take = min(nbytes, self._end - self._start)
            self._start += take
            nbytes -= take

    def end(self) -> None:
        while self._end - self._start < 2:
            self._fill()
        if self._view[self._start : self._start + 2] != _CRLF:
            raise ProtocolError("a bulk string not followed by CRLF")
        self._start += 2
