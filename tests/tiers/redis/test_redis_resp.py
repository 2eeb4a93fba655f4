"""``RespStream`` and the worker's pipelines against a scripted peer on a socket pair:
replies of every kind split at every byte, values checked (by the C batch, and by the
Python fallback, which copies them only when whole and right), partial sends of many
buffers, a peer that closes mid-reply, malformed replies."""

from __future__ import annotations

import random
import socket
import threading

import numpy as np
import pytest

from kvoffload.tiers.redis import pipelines
from kvoffload.tiers.redis.format import CorruptValue, KeyNames, encode
from kvoffload.tiers.redis.pipelines import get_into, set_nx
from kvoffload.tiers.redis.resp import ProtocolError, RespStream, ServerError, command

NAMES = KeyNames("kvoffload", "kvr-test")


class Peer:
    """The other end of a socket pair: records what it receives; ``reply(data, piece)``
    sends ``data`` in pieces of 1..``piece`` bytes, then (``close``) closes."""

    def __init__(self, rcvbuf: int | None = None) -> None:
        self.ours, self.theirs = socket.socketpair()
        self.ours.settimeout(10)
        if rcvbuf:
            self.theirs.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
            self.ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, rcvbuf)
        self.received = bytearray()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        try:
            while chunk := self.theirs.recv(997):  # small reads: the sender's buffer fills
                self.received += chunk
        except OSError:  # closed at the end of a test
            pass

    def all_received(self) -> bytes:
        """Everything our end sent (it sends nothing more)."""
        self.ours.shutdown(socket.SHUT_WR)
        self._reader.join(10)
        return bytes(self.received)

    def reply(self, data: bytes, piece: int = 1, close: bool = False, seed: int = 0) -> None:
        rng = random.Random(seed)

        def send() -> None:
            at = 0
            while at < len(data):
                n = rng.randint(1, piece)
                self.theirs.sendall(data[at : at + n])
                at += n
            if close:
                self.theirs.shutdown(socket.SHUT_WR)

        threading.Thread(target=send, daemon=True).start()

    def close(self) -> None:
        self.ours.close()
        self.theirs.close()


@pytest.fixture
def peer():
    made = []
    yield lambda **kw: made.append(Peer(**kw)) or made[-1]
    for p in made:
        p.close()


def bulk(data: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(data), data)


REPLIES = [
    (b"+OK\r\n", b"OK"),
    (b"-ERR no such thing\r\n", ServerError),
    (b":42\r\n", 42),
    (bulk(b"hel\r\nlo"), b"hel\r\nlo"),
    (b"$-1\r\n", None),
    (b"_\r\n", None),
    (b"*2\r\n$1\r\na\r\n:-1\r\n", [b"a", -1]),
    (b">2\r\n$7\r\nmessage\r\n$1\r\nx\r\n+after a push\r\n", b"after a push"),
    (b"|1\r\n+ttl\r\n:3\r\n:7\r\n", 7),
    (b"%1\r\n+k\r\n+v\r\n", [b"k", b"v"]),
    (b"#t\r\n", True),
    (b",1.5\r\n", 1.5),
    (b"!9\r\nOOM later\r\n", ServerError),
    (b"=8\r\ntxt:abcd\r\n", b"abcd"),
    (b"*-1\r\n", None),
]


@pytest.mark.parametrize("piece", [1, 3, 64, 1 << 16])
def test_every_reply_kind_parses_whatever_the_splits(peer, piece):
    p = peer()
    p.reply(b"".join(data for data, _ in REPLIES), piece)
    stream = RespStream(p.ours)
    for data, expected in REPLIES:
        got = stream.reply()
        if expected is ServerError:
            assert isinstance(got, ServerError), (data, got)
        else:
            assert got == expected, (data, got)


@pytest.mark.parametrize("bad", [b"?what\r\n", b"$abc\r\n", b"$-5\r\n", b":x\r\n", b"$3\r\nabcXY"])
def test_a_malformed_reply_is_a_protocol_error(peer, bad):
    p = peer()
    p.reply(bad, 1 << 10)
    with pytest.raises(ProtocolError):
        RespStream(p.ours).reply()


@pytest.fixture(params=["c", "python"])
def batches(request, monkeypatch):
    """``get_into`` by ``_pipelines`` (C: values received into the rows and checked there)
    or by the Python fallback (each value read into the stream's buffer, checked there,
    copied into the rows only if it passed), as without the C module."""
    if request.param == "c" and pipelines._pipelines is None:
        pytest.skip("could not import kvoffload.tiers.redis._pipelines (not built: no C compiler at install)")
    if request.param == "python":
        monkeypatch.setattr(pipelines, "_pipelines", None)
    return request.param


def stream_of(p: Peer) -> RespStream:
    stream = RespStream(p.ours)
    assert stream.can_hand_off  # a socket pair can: the C batch may run
    return stream


def test_a_peer_closing_mid_value_is_a_connection_error(peer, batches):
    p = peer()
    key = b"k" * 36
    value = encode(key, [b"\x01" * 5000], NAMES.digest)
    p.reply(bulk(value)[: len(value) // 2], 100, close=True)
    rows = [memoryview(bytearray(5000))]
    with pytest.raises(ConnectionError):
        get_into(stream_of(p), [(b"name", key, rows)], NAMES.digest)
    if batches == "python":
        assert bytes(rows[0]) == bytes(5000)  # read into the buffer: half a value never reaches the rows


@pytest.mark.parametrize("piece", [1, 7, 1500, 1 << 20])
def test_values_are_checked_whole_and_only_good_ones_reach_the_rows(peer, piece, batches):
    rng = np.random.default_rng(piece)
    widths = (3, 4096, 1000)
    keys = [bytes([i]) * 36 for i in range(7)]
    payloads = [[rng.integers(0, 256, w, dtype=np.uint8) for w in widths] for _ in keys]
    good = [encode(key, payload, NAMES.digest) for key, payload in zip(keys, payloads)]
    flipped = bytearray(good[4])
    flipped[-3] ^= 1
    replies = [
        bulk(good[0]),
        b"$-1\r\n",  # missing
        b"-WRONGTYPE Operation against a key holding the wrong kind of value\r\n",
        bulk(good[3][:-1]),  # another length
        bulk(bytes(flipped)),  # CRC
        bulk(good[0]),  # right length, another key
        bulk(good[6]),
    ]
    p = peer()
    p.reply(b"".join(replies), piece, seed=piece)
    rows = [[memoryview(bytearray(b"\xee" * w)) for w in widths] for _ in keys]
    names = [b"n%d" % i for i in range(7)]
    got = get_into(stream_of(p), list(zip(names, keys, rows)), NAMES.digest)
    assert got[0] is True and got[6] is True and got[1] is None
    assert isinstance(got[2], ServerError) and "WRONGTYPE" in got[2].message
    assert all(isinstance(g, CorruptValue) for g in got[3:6])
    assert "CRC32C" in str(got[4]) and "another key" in str(got[5])
    for i in (0, 6):
        assert [bytes(r) for r in rows[i]] == [a.tobytes() for a in payloads[i]]
    if batches == "python":  # checked in the stream's buffer: the rows of a bad value are left as they were
        for i in range(1, 6):
            assert all(bytes(r) == b"\xee" * r.nbytes for r in rows[i])
    assert p.all_received() == b"".join(command(b"GET", n) for n in names)


@pytest.mark.parametrize("piece", [1, 5, 97, 1500, 1 << 20])
def test_bad_values_of_the_expected_length_then_a_surprise_mid_batch(peer, piece, batches):
    """The bad values of the expected length come first (in C they are received into the
    rows, so the checks there decide them); then replies that are not as planned (a null, a
    value of another length) hand the rest back to the reply-by-reply reader, which still
    gets the good values after them right; bytes the stream held before the batch come
    first; the stream is in step for the next batch."""
    rng = np.random.default_rng(piece)
    widths = (3, 4096, 1000)
    keys = [bytes([i]) * 36 for i in range(9)]
    payloads = [[rng.integers(0, 256, w, dtype=np.uint8) for w in widths] for _ in keys]
    good = [encode(key, payload, NAMES.digest) for key, payload in zip(keys, payloads)]
    flipped = bytearray(good[1])
    flipped[-1] ^= 0x80  # the payload's last byte: CRC
    foreign = encode(keys[3], payloads[3], KeyNames("kvoffload", "kvr-other").digest)  # namespace
    replies = [
        bulk(good[0]),
        bulk(bytes(flipped)),
        bulk(good[0]),  # the expected length, another key
        bulk(foreign),
        bulk(good[4]),
        b"$-1\r\n",  # missing: the plan ends here
        bulk(good[6]),
        bulk(good[7] + b"x"),  # another length
        bulk(good[8]),
    ]
    p = peer()
    p.reply(b"+PONG\r\n" + b"".join(replies), piece, seed=piece)
    stream = stream_of(p)
    assert stream.reply() == b"PONG"  # may have read some of the values into the buffer
    rows = [[memoryview(bytearray(b"\xee" * w)) for w in widths] for _ in keys]
    names = [b"n%d" % i for i in range(9)]
    got = get_into(stream, list(zip(names, keys, rows)), NAMES.digest)
    assert [g is True for g in got] == [True, False, False, False, True, False, True, False, True]
    assert "CRC32C" in str(got[1]) and "another key" in str(got[2]) and "namespace" in str(got[3])
    assert got[5] is None and "expected" in str(got[7])
    for i in (0, 4, 6, 8):
        assert [bytes(r) for r in rows[i]] == [a.tobytes() for a in payloads[i]]
    p.reply(bulk(good[2]), piece)  # the stream is in step for the next batch
    assert get_into(stream, [(b"again", keys[2], rows[2])], NAMES.digest) == [True]
    assert [bytes(r) for r in rows[2]] == [a.tobytes() for a in payloads[2]]


def test_a_value_not_followed_by_crlf_is_a_protocol_error(peer, batches):
    key = b"q" * 36
    value = encode(key, [b"\x02" * 100], NAMES.digest)
    p = peer()
    p.reply(b"$%d\r\n%sXY" % (len(value), value) + bulk(value), 1 << 10)
    with pytest.raises(ProtocolError):
        rows = [[memoryview(bytearray(100))] for _ in range(2)]
        get_into(stream_of(p), [(b"a", key, rows[0]), (b"b", key, rows[1])], NAMES.digest)


def test_vectored_sends_survive_partial_writes_and_more_buffers_than_one_call_takes(peer):
    p = peer(rcvbuf=4096)
    rng = np.random.default_rng(1)
    rows = [rng.integers(0, 256, n, dtype=np.uint8) for n in (1, 70000, 0, 3, 300000)]
    buffers = [
        b"head",
        *rows,
        bytearray(b"tail"),
        memoryview(b"x" * 10)[2:7],
        *[b"%d," % i for i in range(3000)],
    ]
    stream = RespStream(p.ours)
    stream.send(buffers)
    assert p.all_received() == b"".join(bytes(memoryview(b).cast("B")) for b in buffers)


def test_set_nx_frames_values_from_their_parts_and_reads_one_reply_each(peer, batches):
    p = peer(rcvbuf=4096)
    key = b"\x05" * 36
    parts = [np.arange(200000, dtype=np.uint32).view(np.uint8), b"\x00\x01"]
    head_and_parts = encode(key, parts, NAMES.digest)
    items = [(name, key, parts) for name in (b"name-a", b"name-b")]
    p.reply(b"+OK\r\n_\r\n", 1)
    assert set_nx(RespStream(p.ours), items, NAMES.digest, ttl=30) == [b"OK", None]
    one = lambda name: command(b"SET", name, head_and_parts, b"NX", b"EX", b"30")  # noqa: E731
    assert p.all_received() == one(b"name-a") + one(b"name-b")
