"""The shared tier's C batches (``kvoffload.tiers.redis._pipelines``) on a socket pair, byte
by byte where it matters: what ``get_into`` answers per planned value and ``set_nx`` per
reply, where each stops, what it hands back, how it fails; and the CRC32C against the
``crc32c`` library."""

from __future__ import annotations

import os
import random
import socket
import threading

import crc32c
import pytest

from kvoffload.tiers.redis.format import KeyNames, encode, head_template
from kvoffload.tiers.redis.pipelines import _pipelines

NOT_BUILT = "could not import kvoffload.tiers.redis._pipelines (not built: no C compiler at install)"
pytestmark = pytest.mark.skipif(_pipelines is None, reason=NOT_BUILT)

NAMES = KeyNames("kvoffload", "kvr-getinto")


def test_its_crc32c_is_the_librarys_at_every_length_and_alignment() -> None:
    rng = random.Random(3)
    lengths = [0, 1, 7, 8, 9, 6143, 6144, 6145, 12289, 65536, 65536 + 13, 300007]
    for n in lengths:
        for skew in (0, 1, 5):
            data = memoryview(os.urandom(n + skew))[skew:]
            start = rng.getrandbits(32)
            assert _pipelines.crc32c(data) == crc32c.crc32c(data), n
            assert _pipelines.crc32c(data, start) == crc32c.crc32c(data, start), (n, skew)


def key(i: int) -> bytes:
    return i.to_bytes(4, "big") * 9


def plan(payloads: list[int]) -> tuple[list, list[bytearray]]:
    """Items for ``receive`` for values of these payload sizes, and their rows (two each)."""
    items, rows, lead_format = [], [], b"$%d\r\n"
    for i, size in enumerate(payloads):
        lead = lead_format % (len(encode(key(i), [b"\0" * size], NAMES.digest)))
        lead_format = b"\r\n$%d\r\n"
        parts = [bytearray(size // 3), bytearray(size - size // 3)]
        rows += parts
        items.append((lead + head_template(key(i), size, NAMES.digest), len(lead), key(i), parts))
    return items, rows


def replies(values: list[bytes | None]) -> bytes:
    return b"".join(b"$-1\r\n" if v is None else b"$%d\r\n%s\r\n" % (len(v), v) for v in values)


def feed(sock: socket.socket, data: bytes, piece: int) -> threading.Thread:
    def run() -> None:
        rng = random.Random(piece)
        at = 0
        while at < len(data):
            n = rng.randint(1, piece)
            sock.sendall(data[at : at + n])
            at += n

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    a.settimeout(2.0)
    yield a, b
    a.close()
    b.close()


@pytest.mark.parametrize("piece", [1, 7, 1 << 20])
def test_values_as_planned_are_received_into_the_rows_and_checked(pair, piece) -> None:
    a, b = pair
    sizes = [5000, 1, 70000]
    payloads = [os.urandom(n) for n in sizes]
    items, rows = plan(sizes)
    wire = replies([encode(key(i), [p], NAMES.digest) for i, p in enumerate(payloads)]) + b"+PONG\r\n"
    feed(b, wire[:3], piece).join()
    thread = feed(b, wire[3:], piece)  # the first bytes as if the stream had buffered them
    first = a.recv(3, socket.MSG_WAITALL)
    results, unread = _pipelines.get_into(a.fileno(), 2.0, b"GET a", first, items)
    thread.join()
    assert results == [True, True, True] and unread == b""
    assert [bytes(r) for r in rows] == [
        bytes(p[: len(p) // 3]) if j % 2 == 0 else bytes(p[len(p) // 3 :]) for p in payloads for j in range(2)
    ]
    assert a.recv(16) == b"+PONG\r\n"  # nothing read past the batch
    assert b.recv(16) == b"GET a"  # the request went first


def test_a_bad_crc_and_a_foreign_head_are_answered_and_the_batch_goes_on(pair) -> None:
    a, b = pair
    items, _ = plan([3000, 3000, 3000])
    good = encode(key(0), [os.urandom(3000)], NAMES.digest)
    flipped = bytearray(encode(key(1), [os.urandom(3000)], NAMES.digest))
    flipped[-5] ^= 1
    foreign = encode(key(9), [os.urandom(3000)], NAMES.digest)  # another key, the same length
    feed(b, replies([good, bytes(flipped), foreign]), 999).join()
    results, unread = _pipelines.get_into(a.fileno(), 2.0, b"", b"", items)
    assert results[:2] == [True, False] and unread == b""
    assert results[2] == foreign[: len(items[2][0]) - items[2][1]]  # its head, to say why


@pytest.mark.parametrize("piece", [1, 1 << 20])
def test_a_reply_not_as_planned_ends_the_batch_and_is_handed_back(pair, piece) -> None:
    """A null (shorter than a planned lead) or an error as the last reply ends the batch
    as soon as its first bytes differ from the plan (never waited past): the bytes received
    from its start are handed back, the rest are still on the socket."""
    a, b = pair
    items, _ = plan([100, 100, 100])
    values = [encode(key(i), [os.urandom(100)], NAMES.digest) for i in range(3)]
    thread = feed(b, replies(values[:2] + [None]), piece)
    results, unread = _pipelines.get_into(a.fileno(), 2.0, b"", b"", items)
    thread.join()
    assert results == [True, True] and unread == b"$-1\r\n"[: len(unread)]
    assert unread + a.recv(5 - len(unread), socket.MSG_WAITALL) == b"$-1\r\n"  # the rest: unread
    thread = feed(b, replies(values[:1]) + b"-ERR wrong\r\n", piece)
    results, unread = _pipelines.get_into(a.fileno(), 2.0, b"", b"", items)
    thread.join()
    assert results == [True] and unread == b"-ERR wrong\r\n"[: len(unread)] and unread
    assert unread + a.recv(12 - len(unread), socket.MSG_WAITALL) == b"-ERR wrong\r\n"


def test_bytes_that_are_not_resp_a_silent_server_and_a_closed_one_raise(pair) -> None:
    a, b = pair
    items, _ = plan([50])
    value = encode(key(0), [b"x" * 50], NAMES.digest)
    feed(b, b"$%d\r\n%sXY" % (len(value), value), 99).join()
    with pytest.raises(ValueError, match="not followed by CRLF"):
        _pipelines.get_into(a.fileno(), 2.0, b"", b"", items)
    with pytest.raises(TimeoutError):
        _pipelines.get_into(a.fileno(), 0.05, b"", b"", items)
    b.sendall(b"$%d\r\n" % len(value))
    b.shutdown(socket.SHUT_WR)
    with pytest.raises(ConnectionError):
        _pipelines.get_into(a.fileno(), 2.0, b"", b"", items)


def test_a_plan_that_does_not_fit_is_refused_before_any_read(pair) -> None:
    a, _ = pair
    expected, lead, k, rows = plan([10])[0][0]
    with pytest.raises(ValueError, match="lead 999"):
        _pipelines.get_into(a.fileno(), 0.05, b"", b"", [(expected, 999, k, rows)])
    with pytest.raises(TypeError, match="item 0"):
        _pipelines.get_into(a.fileno(), 0.05, b"", b"", [(expected, lead, k)])
    with pytest.raises(BufferError, match="not writable"):
        _pipelines.get_into(a.fileno(), 0.05, b"", b"", [(expected, lead, k, [b"0123456789"])])


def drain(sock: socket.socket, into: bytearray) -> threading.Thread:
    def run() -> None:
        while data := sock.recv(1 << 16):
            into.extend(data)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("piece", [1, 3, 1 << 20])
def test_set_nx_sends_every_buffer_in_order_and_reads_one_line_replies(pair, piece) -> None:
    a, b = pair
    buffers = [os.urandom(n) for n in (10, 0, 300000, 1, 70000)] + [memoryview(bytearray(b"tail"))]
    sent = bytearray()
    reader = drain(b, sent)
    answers = b"+OK\r\n$-1\r\n_\r\n-OOM command not allowed\r\n+OK\r\n"
    writer = feed(b, answers[2:] + b"+PONG", piece)  # b"+O" was buffered by the stream
    lines, unread = _pipelines.set_nx(a.fileno(), 2.0, buffers, b"+O", 5)
    writer.join()
    assert lines == [b"+OK", b"$-1", b"_", b"-OOM command not allowed", b"+OK"]
    assert unread == b"+PONG"[: len(unread)]  # read past the last reply: handed back
    a.shutdown(socket.SHUT_WR)
    reader.join()
    assert sent == b"".join(bytes(x) for x in buffers)


def test_set_nx_stops_at_a_reply_of_another_kind_and_hands_it_back(pair) -> None:
    a, b = pair
    b.sendall(b"+OK\r\n>2\r\n$10\r\ninvalidate\r\n*0\r\n+OK\r\n")  # a RESP3 push in between
    lines, unread = _pipelines.set_nx(a.fileno(), 2.0, [b"x"], b"", 2)
    assert lines == [b"+OK"] and unread.startswith(b">2\r\n$10")
    b.sendall(b"$5\r\nhello\r\n")  # a bulk string: not a reply SET NX gets
    lines, unread = _pipelines.set_nx(a.fileno(), 2.0, [b"x"], b"", 1)
    assert lines == [] and unread.startswith(b"$5")
    b.sendall(b"+" + b"y" * 70000)  # no line end within 64 KiB
    lines, unread = _pipelines.set_nx(a.fileno(), 2.0, [b"x"], b"", 1)
    assert lines == [] and len(unread) > 1 << 16


def test_set_nx_raises_on_a_silent_or_closed_peer(pair) -> None:
    a, b = pair
    b.sendall(b"+OK\r\n+O")
    with pytest.raises(TimeoutError):
        _pipelines.set_nx(a.fileno(), 0.05, [b"x"], b"", 2)
    b.shutdown(socket.SHUT_WR)
    with pytest.raises(ConnectionError):
        _pipelines.set_nx(a.fileno(), 2.0, [b"x"], b"", 1)


def test_set_nx_fills_in_each_headers_crc32c_before_sending(pair) -> None:
    a, b = pair
    buffers, checksums, expected = [], [], b""
    for i, sizes in enumerate([(70000, 0, 3), (1,), ()]):
        parts = [os.urandom(n) for n in sizes]
        value = encode(key(i), parts, NAMES.digest)  # the header with its CRC, as format writes it
        template = head_template(key(i), sum(sizes), NAMES.digest)
        framing = bytearray(b"*4\r\n...frame %d..." % i + template)
        checksums.append((len(buffers), len(framing) - len(template) + 8, len(key(i)), len(parts)))
        buffers += [framing, *parts]
        expected += bytes(framing[: len(framing) - len(template)]) + value
    sent = bytearray()
    reader = drain(b, sent)
    b.sendall(b"+OK\r\n" * 3)
    lines, _ = _pipelines.set_nx(a.fileno(), 2.0, buffers, b"", 3, checksums)
    a.shutdown(socket.SHUT_WR)
    reader.join()
    assert lines == [b"+OK"] * 3
    assert bytes(sent) == expected


@pytest.mark.parametrize(
    "record, error",
    [
        ((0, 0, 0, 5), ValueError),  # more parts than buffers
        ((0, 3, 1, 0), ValueError),  # the CRC field past the framing's end
        ((0, 0, 9, 0), ValueError),  # a key longer than the framing
        ((1, 0, 0, 0), TypeError),  # a read-only framing
        ([0, 0, 0, 0], TypeError),  # not a tuple
    ],
)
def test_set_nx_refuses_a_checksum_that_does_not_fit(pair, record, error) -> None:
    a, _ = pair
    with pytest.raises(error, match="checksum 0"):
        _pipelines.set_nx(a.fileno(), 2.0, [bytearray(6), b"xxxxxx"], b"", 0, [record])


def respond(sock: socket.socket, answers: dict[bytes, bytes], got: bytearray) -> threading.Thread:
    """A peer that answers each request of ``answers`` once it has come (in ``got``)."""

    def run() -> None:
        while data := sock.recv(1 << 16):
            got.extend(data)
            for request, reply in answers.items():
                if got.endswith(request):
                    sock.sendall(reply)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_queue_runs_its_batches_back_to_back_and_hands_back_the_first_not_answered_in_full(pair) -> None:
    a, b = pair
    done = _pipelines.Completions()
    queue = _pipelines.JobQueue(done)
    good = [encode(key(i), [bytes([i + 1]) * 100], NAMES.digest) for i in range(2)]
    queue.push_get("load 1", b"GET 1|", plan([100, 100])[0])
    queue.push_set("store 2", [b"SET 2|"], 2, [])
    queue.push_get("load 3", b"GET 3|", plan([100, 100])[0])
    queue.push_set("store 4", [b"SET 4|"], 1, [])
    assert queue.behind == 3  # each queued behind another
    queue.close()  # what is queued still runs; serve() returns once it is empty
    got = bytearray()
    answers = {
        b"GET 1|": replies(good),
        b"SET 2|": b"+OK\r\n$-1\r\n",
        b"GET 3|": replies(good[:1]) + b"$-1\r\n",
    }
    peer = respond(b, answers, got)
    seen = done.count
    # load 1 and store 2 answered in full, in C; load 3's second value is missing: it comes back
    token, result, error = queue.serve(a.fileno(), 10.0)  # 10 s: a hang guard
    assert (token, result, error) == ("load 3", ([True], b"$-1\r\n"), None)
    assert done.count == seen + 2 and bytes(got) == b"GET 1|SET 2|GET 3|"  # store 4 not sent
    assert queue.collect() == [("load 1", ([True, True], b"")), ("store 2", ([b"+OK", b"$-1"], b""))]
    assert queue.collect() == []
    token, result, error = queue.serve(a.fileno(), 0.05)  # no reply: it fails
    assert token == "store 4" and result is None and isinstance(error, TimeoutError)
    assert queue.serve(a.fileno(), 2.0) is None and not queue.wait_job()
    a.shutdown(socket.SHUT_WR)
    peer.join(30.0)
    assert bytes(got) == b"GET 1|SET 2|GET 3|SET 4|"


def test_a_queue_wakes_a_waiter_runs_what_was_queued_before_close_and_gives_back_unsent_batches(pair) -> None:
    a, b = pair
    done = _pipelines.Completions()
    queue = _pipelines.JobQueue(done)
    served: list = []
    server = threading.Thread(target=lambda: served.append(queue.serve(a.fileno(), 30.0)), daemon=True)
    server.start()
    seen = done.count
    queue.push_set("s1", [b"SET 1"], 1, [])
    b.sendall(b"+OK\r\n")
    assert done.wait(seen, 30.0)  # woken by the batch answered on the serving thread (30 s: a hang guard)
    assert queue.collect() == [("s1", ([b"+OK"], b""))]
    queue.push_set("s2", [b"SET 2"], 1, [])
    queue.close()  # s2 still runs
    b.sendall(b"+OK\r\n")
    server.join(30.0)
    assert served == [None] and queue.collect() == [("s2", ([b"+OK"], b""))]
    with pytest.raises(RuntimeError, match="after close"):
        queue.push_set("s3", [b"SET 3"], 1, [])
    assert not done.wait(done.count, 0.01)
    other = _pipelines.JobQueue(done)
    other.push_get("g", b"GET", plan([100])[0])
    other.push_set("s", [b"SET"], 1, [])
    assert other.drain() == ["g", "s"] and other.collect() == []
    with pytest.raises(TypeError, match="item 0"):
        other.push_get("bad", b"GET", [(b"x", 0, b"k")])
    with pytest.raises(ValueError, match="checksum 0"):
        other.push_set("bad", [bytearray(6), b"xxxxxx"], 1, [(0, 0, 0, 5)])
    with pytest.raises(ValueError, match="timeout must be >= 0, got -1"):
        done.wait(0, -1)
