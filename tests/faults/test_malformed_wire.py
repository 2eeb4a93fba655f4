"""Malformed wire input on a real ZMQ socket, to the subscriber and to ``kvoffload events
tail`` (a separate process): truncated payloads, wrong types, length headers claiming
gigabytes, deep nesting, random bytes, random frame counts and sequence frames. Each bad
message is counted once as malformed and skipped; it moves no sequence number (a random
sequence frame must not count billions of batches lost or look like a publisher
restart); the good batches between them all arrive, in order, and the process lives."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import zmq

from kvoffload.events import BlockStored, EventSubscriber, KVEventBatch, encode

pytestmark = pytest.mark.timeout(120)

GOOD = 20  # good batches, sequence numbers 0..GOOD-1, each followed by bad messages
OLD = b"old-seq!"  # replaced when sent by the number of a batch already sent


def good_batch(seq: int) -> bytes:
    stored = BlockStored([seq, 2**64 - 1 - seq], None, [seq] * 4, 4, None, "CPU", None, group_idx=0)
    return encode(KVEventBatch(float(seq), [stored], 0))


def bad_payloads(rng: random.Random) -> Iterator[bytes]:
    good = good_batch(7)
    for cut in (1, len(good) // 2, len(good) - 1):
        yield good[:cut]  # truncated
    yield msgspec.msgpack.encode({"ts": "yesterday", "events": []})  # wrong types
    yield msgspec.msgpack.encode([1.0, "events", 0])
    yield msgspec.msgpack.encode([1.0, [["BlockStored", "not-hashes", None, [1], 4]], 0])
    yield msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved", "block_hashes": [1.5], "medium": 3}], 0])
    for header in (b"\xdd", b"\xdf", b"\xc6", b"\xdb"):  # array32, map32, bin32, str32 of 4 GiB
        yield header + b"\xff\xff\xff\xff"
    yield b"\x93\xcb" + b"\x00" * 8 + b"\xdd\xff\xff\xff\xff"  # a batch whose events claim 4 G
    yield b"\x91" * 100_000  # nested 100,000 deep
    yield b""
    yield rng.randbytes(4 << 20)  # 4 MiB of noise
    for _ in range(100):
        yield rng.randbytes(rng.randrange(1, 200))


def bad_messages(seed: int) -> list[list[bytes]]:
    """Messages the subscriber must count as malformed, one each."""
    rng = random.Random(seed)
    messages = []
    for payload in bad_payloads(rng):
        # A sequence frame of the right size: noise, the largest numbers, or one the
        # stream has already passed (OLD). Never the next expected one: a bad payload
        # under that number is taken as that batch, corrupted (tests/events/test_events_pubsub.py).
        seq = rng.choice([OLD, rng.randrange(2**64).to_bytes(8, "big"), (2**64 - 2).to_bytes(8, "big")])
        messages.append([b"", seq, payload])
    for _ in range(60):  # wrong frame counts, wrong sequence-frame sizes
        frames = [rng.randbytes(rng.randrange(0, 40)) for _ in range(rng.choice([1, 2, 4, 5]))]
        messages.append([b""] + frames[1:] if frames else [b""])
        messages.append([b"", rng.randbytes(rng.choice([0, 1, 7, 9, 16])), good_batch(0)])
    rng.shuffle(messages)
    return messages


def send_stream(xpub: zmq.Socket, messages: list[list[bytes]]) -> None:
    """Good batch ``k`` is sent after the ``k``-th share of the bad messages."""
    share = -(-len(messages) // GOOD)
    for k in range(GOOD):
        for message in messages[k * share : (k + 1) * share]:
            if message[1:2] == [OLD]:
                message = [b"", (k - 1 if k else 2**63).to_bytes(8, "big"), *message[2:]]
            xpub.send_multipart(message)
        xpub.send_multipart([b"", k.to_bytes(8, "big"), good_batch(k)])


@pytest.fixture
def xpub(tmp_path: Path) -> Iterator[tuple[zmq.Socket, str]]:
    """A publisher socket that sends exactly the frames given, and tells when a
    subscription arrived (so nothing is lost to ZMQ's slow joiner)."""
    sock = zmq.Context.instance().socket(zmq.XPUB)
    endpoint = f"ipc://{tmp_path}/pub"
    sock.bind(endpoint)
    yield sock, endpoint
    sock.close(linger=0)


def wait_subscribed(sock: zmq.Socket, timeout: float = 30.0) -> None:
    assert sock.poll(int(timeout * 1000)), "no subscriber arrived"
    assert sock.recv()[:1] == b"\x01"


def test_subscriber_counts_and_skips_every_malformed_message(xpub) -> None:
    sock, endpoint = xpub
    messages = bad_messages(1)
    with EventSubscriber(endpoint) as sub:  # start_seq 0, no replay endpoint
        assert sub.receive(0.1) is None  # the subscription goes out
        wait_subscribed(sock)
        send_stream(sock, messages)
        got = []
        while len(got) < GOOD and (item := sub.receive(10)) is not None:
            got.append(item)
        stats = sub.stats()
    assert [seq for seq, _ in got] == list(range(GOOD))
    assert all(batch.events[0].block_hashes[0] == seq for seq, batch in got)
    assert stats.malformed == len(messages)
    assert (stats.decoded, stats.lost, stats.restarts, stats.duplicates) == (GOOD, 0, 0, 0)


def test_events_tail_counts_and_skips_every_malformed_message(xpub) -> None:
    sock, endpoint = xpub
    messages = bad_messages(2)
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvoffload.cli", "events", "tail", endpoint,
         "--from-start", "--max-batches", str(GOOD), "--timeout", "60"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    try:
        wait_subscribed(sock)
        time.sleep(0.2)  # the subscription is installed once the socket said so
        send_stream(sock, messages)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    lines = out.splitlines()
    assert [line.split()[0] for line in lines] == [f"seq={k}" for k in range(GOOD)]
    assert all("BlockStored medium=CPU" in line for line in lines)
    (summary,) = [line for line in err.splitlines() if line.startswith("batches=")]
    counters = dict(field.split("=") for field in summary.split())
    assert int(counters["malformed"]) == len(messages)
    assert [int(counters[k]) for k in ("batches", "decoded", "lost", "restarts")] == [GOOD, GOOD, 0, 0]
