"""Fuzzing the shared tier's RESP reply readers: ``RespStream`` (Python) and the C batches
of ``kvoffload.tiers.redis._pipelines``, on a real socket pair whose far end has sent the
drawn bytes and closed.

* ``reply()`` on any bytes returns a reply or raises ``ProtocolError`` or
  ``ConnectionError``: never another exception, never a wait (the peer has closed);
  well-formed replies, nested as deep as a server's reply to kvoffload could be, come back
  as written.
* ``get_into`` and ``set_nx`` in C and in Python give the same answers for the same
  bytes, or the same exception: values as planned, values with a byte flipped, dropped or
  added anywhere (lead, header, key, payload, CRLF), nulls, errors, RESP3 pushes and
  attributes, other lengths, noise, a stream cut anywhere. A value answered ``True`` is in
  its rows byte for byte. A read past a buffer would show under ``make test-sanitize``.
"""

from __future__ import annotations

import contextlib
import socket
import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fuzzing import TIMEOUT, fuzz
from kvoffload.tiers.redis import pipelines
from kvoffload.tiers.redis.format import CorruptValue, encode
from kvoffload.tiers.redis.resp import ProtocolError, RespStream, ServerError

pytestmark = pytest.mark.timeout(TIMEOUT)

DIGEST = bytes(range(16))
NATIVE = pipelines._pipelines is not None
needs_c = pytest.mark.skipif(not NATIVE, reason="kvoffload.tiers.redis._pipelines not built (no C compiler)")


class Peer:
    """A socket pair whose far end has sent ``data`` and closed its side: a read past it is
    a ``ConnectionError``, and a wait (a bug) a ``TimeoutError`` after 5 s."""

    def __init__(self, data: bytes) -> None:
        self.ours, self.theirs = socket.socketpair()
        self.ours.settimeout(5)
        self._sender = threading.Thread(target=self._send, args=(data,), daemon=True)
        self._sender.start()

    def _send(self, data: bytes) -> None:
        with contextlib.suppress(OSError):  # the reader may stop early and close
            self.theirs.sendall(data)
            self.theirs.shutdown(socket.SHUT_WR)

    def __enter__(self) -> RespStream:
        return RespStream(self.ours)

    def __exit__(self, *exc) -> None:
        self.ours.close()
        self._sender.join()
        self.theirs.close()


# -- reply(): any bytes, and well-formed trees -------------------------------------------------

TOKENS = [b"+OK", b"-ERR x", b":12", b"$3", b"$-1", b"*2", b"*-1", b"%1", b"~1", b">1", b"|1", b"_", b"#t",
          b",1.5", b"!3", b"=7", b"(9", b"$0", b"*0", b"abc", b"txt:", b"", b"\r", b"\n", b"$99999999999",
          b"*1000000", b"$-2", b":-", b"#x", b"$1_0", b"* 2", b":1e3"]  # fmt: skip
resp_noise = st.lists(
    st.one_of(st.sampled_from(TOKENS), st.binary(max_size=12)).map(lambda t: t + b"\r\n"), max_size=40
).map(b"".join)


def replies_of(data: bytes, count: int = 4) -> tuple[list, BaseException | None]:
    """Up to ``count`` replies read from ``data``, and the exception that ended them."""
    got: list = []
    with Peer(data) as stream:
        try:
            for _ in range(count):
                got.append(stream.reply())
        except (ProtocolError, ConnectionError) as exc:
            return got, exc
    return got, None


@fuzz(500)
@given(st.one_of(resp_noise, st.binary(max_size=300)))
def test_reply_takes_any_bytes(data):
    replies_of(data)  # anything but ProtocolError and ConnectionError fails the test


line_text = st.binary(max_size=20).filter(lambda b: b"\r" not in b and b"\n" not in b)
leaf = st.one_of(
    line_text.map(lambda t: (b"+" + t + b"\r\n", t)),
    line_text.map(lambda t: (b"-" + t + b"\r\n", ServerError(t.decode(errors="replace")))),
    st.integers(-(2**63), 2**63 - 1).map(lambda n: (b":%d\r\n" % n, n)),
    st.binary(max_size=40).map(lambda b: (b"$%d\r\n%s\r\n" % (len(b), b), b)),
    st.sampled_from([(b"$-1\r\n", None), (b"_\r\n", None), (b"*-1\r\n", None), (b"#t\r\n", True)]),
)


def array_of(children):
    return st.lists(children, max_size=4).map(
        lambda items: (b"*%d\r\n" % len(items) + b"".join(w for w, _ in items), [v for _, v in items])
    )


tree = st.recursive(leaf, array_of, max_leaves=40)


def same(got, want) -> bool:
    if isinstance(want, ServerError):
        return isinstance(got, ServerError) and got.message == want.message
    if isinstance(want, list):
        return isinstance(got, list) and len(got) == len(want) and all(map(same, got, want))
    return type(got) is type(want) and got == want


@fuzz(300)
@given(st.lists(tree, min_size=1, max_size=4), st.lists(st.booleans(), min_size=4, max_size=4))
def test_well_formed_replies_come_back_as_written(replies, pushes):
    push = b">2\r\n$7\r\nmessage\r\n$1\r\nx\r\n"  # RESP3 out-of-band data before a reply is dropped
    data = b"".join((push if p else b"") + wire for (wire, _), p in zip(replies, pushes))
    got, exc = replies_of(data, len(replies))
    assert exc is None, exc
    assert all(map(same, got, [value for _, value in replies])), (got, replies)


@pytest.mark.parametrize("opener", [b"*1\r\n", b"~1\r\n", b"%1\r\n+k\r\n", b">1\r\n", b"|1\r\n+k\r\n"])
def test_nesting_past_any_reply_kvoffload_asks_for_is_a_protocol_error(opener):
    """Found by fuzzing: each level of nesting took one Python frame, so 1,000 levels of a
    malformed (or hostile) reply raised ``RecursionError`` instead of ``ProtocolError``."""
    got, exc = replies_of(opener * 5_000 + b":1\r\n", 1)
    assert isinstance(exc, ProtocolError) and "nested" in str(exc), exc
    got, exc = replies_of(b"*1\r\n" * 32 + b":1\r\n", 1)  # as deep as any reply may be: fine
    assert exc is None and got


# -- get_into / set_nx: C and Python agree --------------------------------------------------

item = st.tuples(
    st.binary(min_size=1, max_size=40),  # key
    st.lists(st.integers(0, 48), min_size=1, max_size=3),  # row widths
    st.integers(0, 2**32 - 1),  # payload seed
)
EDITS = ["good", "flip", "drop", "add", "null", "resp3-null", "error", "blob-error", "other-length",
         "push", "attribute", "noise", "array"]  # fmt: skip


def payload_of(widths: list[int], seed: int) -> list[bytes]:
    out, x = [], seed or 1
    for w in widths:
        row = bytearray()
        for _ in range(w):
            x = (x * 1103515245 + 12345) & 0x7FFFFFFF
            row.append(x >> 16 & 0xFF)
        out.append(bytes(row))
    return out


@st.composite
def batch(draw):
    """Items ``(name, key, payload)`` and the bytes a server answers their GETs with."""
    items = draw(st.lists(item, min_size=1, max_size=5))
    plan, wire = [], []
    for i, (key, widths, seed) in enumerate(items):
        payload = payload_of(widths, seed)
        value = encode(key, payload, DIGEST)
        good = b"$%d\r\n%s\r\n" % (len(value), value)
        edit = draw(st.sampled_from(EDITS))
        if edit in ("flip", "drop", "add"):
            at = draw(st.integers(0, len(good) - 1))
            if edit == "flip":
                good = good[:at] + bytes([good[at] ^ draw(st.integers(1, 255))]) + good[at + 1 :]
            elif edit == "drop":
                good = good[:at] + good[at + 1 :]
            else:
                good = good[:at] + draw(st.binary(min_size=1, max_size=3)) + good[at:]
        elif edit == "null":
            good = b"$-1\r\n"
        elif edit == "resp3-null":
            good = b"_\r\n"
        elif edit == "error":
            good = b"-WRONGTYPE Operation\r\n"
        elif edit == "blob-error":
            good = b"!5\r\nOOM x\r\n"
        elif edit == "other-length":
            other = draw(st.binary(max_size=80))
            good = b"$%d\r\n%s\r\n" % (len(other), other)
        elif edit == "push":
            good = b">2\r\n+invalidate\r\n*1\r\n$1\r\nk\r\n" + good
        elif edit == "attribute":
            good = b"|1\r\n+ttl\r\n:3\r\n" + good
        elif edit == "noise":
            good = draw(st.binary(max_size=30))
        elif edit == "array":
            good = b"*1\r\n" + good
        plan.append((b"name%d" % i, key, payload))
        wire.append(good)
    data = b"".join(wire)
    if draw(st.booleans()):
        data = data[: draw(st.integers(0, len(data)))]  # the server goes away mid-batch
    return plan, data


def outcome(result) -> object:
    if result is True or result is None:
        return result
    if isinstance(result, CorruptValue):
        return ("corrupt", str(result))
    if isinstance(result, ServerError):
        return ("error", result.message)
    raise AssertionError(f"get_into answered {result!r}")


def run_get(plan, data: bytes, native: bool):
    rows = [[memoryview(bytearray(len(p))) for p in payload] for _, _, payload in plan]
    with Peer(data) as stream:
        stream.can_hand_off = native and stream.can_hand_off
        try:
            results = pipelines.get_into(stream, [(n, k, r) for (n, k, _), r in zip(plan, rows)], DIGEST)
        except (ProtocolError, ConnectionError) as exc:
            return type(exc).__name__
    for result, row, (_, _, payload) in zip(results, rows, plan):
        if result is True:
            assert [bytes(r) for r in row] == payload  # a value answered True is in its rows
    return [outcome(r) for r in results]


@needs_c
@fuzz(400)
@given(batch())
def test_get_into_in_c_and_in_python_agree(drawn):
    plan, data = drawn
    assert run_get(plan, data, native=True) == run_get(plan, data, native=False)


@fuzz(150)
@given(st.lists(item, min_size=1, max_size=5))
def test_values_as_written_are_all_true(items):
    plan = [(b"n%d" % i, key, payload_of(widths, seed)) for i, (key, widths, seed) in enumerate(items)]
    data = b"".join(b"$%d\r\n%s\r\n" % (len(v), v) for v in (encode(k, p, DIGEST) for _, k, p in plan))
    for native in (True, False) if NATIVE else (False,):
        assert run_get(plan, data, native) == [True] * len(plan)


SET_REPLIES = [b"+OK\r\n", b"$-1\r\n", b"_\r\n", b"-OOM command not allowed\r\n", b"+\r\n", b"$3\r\nabc\r\n",
               b">1\r\n+x\r\n", b":1\r\n", b"+O\rK\r\n", b"$-01\r\n", b"-\r\n"]  # fmt: skip


def run_set(count: int, data: bytes, native: bool):
    items = [(b"n%d" % i, b"key%d" % i, [b"payload"]) for i in range(count)]
    with Peer(data) as stream:
        stream.can_hand_off = native and stream.can_hand_off
        try:
            results = pipelines.set_nx(stream, items, DIGEST)
        except (ProtocolError, ConnectionError) as exc:
            return type(exc).__name__
    return [r.message if isinstance(r, ServerError) else r for r in results]


@needs_c
@fuzz(300)
@given(
    st.integers(1, 6),
    st.lists(st.one_of(st.sampled_from(SET_REPLIES), st.binary(max_size=10)), max_size=8).map(b"".join),
)
def test_set_nx_replies_in_c_and_in_python_agree(count, data):
    assert run_set(count, data, native=True) == run_set(count, data, native=False)


# -- the C batches with any plan -------------------------------------------------------------

plan_item = st.tuples(
    st.binary(max_size=40),  # the bytes planned before the payload
    st.integers(-2, 50),  # how many of them are the lead
    st.binary(max_size=12),  # key
    st.lists(st.integers(0, 24), max_size=3),  # row widths
)


@needs_c
@fuzz(400)
@given(st.lists(plan_item, max_size=4), st.binary(max_size=60), st.binary(max_size=300))
def test_c_get_into_takes_any_plan_and_any_bytes(plan, buffered, data):
    """Plans that do not fit are refused before a read; any other plan and any reply bytes
    end in results (no more than the plan's items) or an exception of the batch."""
    items = [(expected, lead, key, [bytearray(w) for w in widths]) for expected, lead, key, widths in plan]
    with Peer(data) as stream:
        try:
            results, unread = pipelines._pipelines.get_into(stream._sock.fileno(), 5.0, b"", buffered, items)
        except (ValueError, ConnectionError):
            return
    assert len(results) <= len(items) and all(r in (True, False) or isinstance(r, bytes) for r in results)
    assert isinstance(unread, bytes)


@needs_c
@fuzz(300)
@given(st.integers(-1, 6), st.binary(max_size=40), st.binary(max_size=100))
def test_c_set_nx_takes_any_count_and_any_bytes(count, buffered, data):
    with Peer(data) as stream:
        try:
            lines, unread = pipelines._pipelines.set_nx(stream._sock.fileno(), 5.0, [b"x"], buffered, count)
        except ConnectionError:
            return
    assert len(lines) <= max(count, 0) and all(line[:1] in (b"+", b"-", b"$", b"_") for line in lines)
    assert isinstance(unread, bytes)


def test_a_value_a_byte_short_and_a_closed_connection_is_the_same_error_either_way():
    """Found by ``make fuzz`` (seed 12345): a server sent a value one byte shorter than its
    length said, its CRLF, and closed. C took the CRLF's first byte as the value's last and
    the ``\\n`` as the start of the next reply's CRLF, and called the stream not RESP at once
    (``ProtocolError``); Python, which checks a value's CRLF once both bytes are in, saw the
    connection close first (``ConnectionError``). C now waits for both bytes too."""
    payload = [b"x" * 23]
    value = encode(b"k0", payload, DIGEST)
    plan = [(b"n0", b"k0", payload), (b"n1", b"k1", [b""])]
    data = b"$%d\r\n" % len(value) + value[1:] + b"\r\n"
    assert run_get(plan, data, native=False) == "ConnectionError"
    if NATIVE:
        assert run_get(plan, data, native=True) == "ConnectionError"
