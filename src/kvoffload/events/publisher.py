"""ZMQ publisher of KV event batches with a replay buffer.

Contract:

* Every message is three frames: the topic, an 8-byte big-endian sequence number that
  counts this publisher's batches from 0, and the encoded batch (``kvoffload.events.codec``).
* ``publish(batch_or_events)`` never blocks and costs the caller no encoding: it checks
  the batch's types, assigns the next sequence number, keeps the batch in a replay buffer
  of the last ``buffer_steps`` batches and hands the send to a background thread through a
  queue of at most ``max_queue_size`` entries. The sender encodes each batch once and
  keeps the payload in the buffer (a replay encodes a batch whose send was dropped). When
  the queue is full the send is dropped and counted, but the buffered copy stays, so a
  subscriber sees a gap and repairs it by replay. A batch must not be modified after it is
  published. A batch that cannot be encoded (e.g. a hash outside the unsigned 64-bit
  range) is logged, counted in ``encode_errors`` and never sent: subscribers count it lost.
  ``check_hashes=False`` is for producers whose hashes are already ``external_hash`` ints
  (the scheduler's ``EventConverter``): the sender then encodes at msgspec's own speed
  instead of first checking every hash (``kvoffload.events.codec``, ``EventEncoder``).
* Replay: a ROUTER socket on ``replay_endpoint``. A request is one 8-byte big-endian start
  sequence (from a REQ socket, or ``[b"", start]`` from a DEALER). The reply is one message
  ``[topic, seq, payload]`` per buffered batch with ``seq >= start``, in order, then the end
  marker ``[b"", b"\\xff" * 8, b""]``. A malformed request gets just the end marker and a
  log line; it never stops the publisher.
* Endpoints are bound by default (``bind=False`` connects the PUB socket instead), tcp on
  127.0.0.1 unless another host is named; with data parallelism each rank derives its own
  endpoints (``kvoffload.events.endpoints.for_rank``). ``endpoint``/``replay_endpoint``
  hold the resolved addresses (a tcp port 0 becomes the port the OS chose). An ``ipc://``
  socket file it binds is made 0600: only its user's processes can subscribe or replay.
* ``close()`` sends what is queued within ``flush_timeout`` seconds, then closes the
  sockets; later ``publish`` calls raise ``RuntimeError``.
"""

from __future__ import annotations

import errno
import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import zmq

from kvoffload.counters import Counters
from kvoffload.events import endpoints
from kvoffload.events.codec import EventEncoder
from kvoffload.events.types import EVENT_TYPES, HashFormat, KVEvent, KVEventBatch
from kvoffload.private import chmod_private
from kvoffload.validation import non_negative_int, positive_int

logger = logging.getLogger(__name__)

END_SEQ = b"\xff" * 8
END_MARKER = (b"", END_SEQ, b"")
_STOP = object()
_BIND_RETRY_S = 1.0  # a restarted publisher may find its old port still closing


@dataclass
class PublisherStats(Counters):
    published: int = 0  # batches given to publish(); also the next sequence number
    sent: int = 0  # batches handed to the PUB socket
    dropped_sends: int = 0  # sends dropped because the queue was full (still replayable)
    buffered: int = 0  # batches in the replay buffer
    replay_requests: int = 0  # well-formed replay requests served
    replayed: int = 0  # batches sent in replay replies
    malformed_requests: int = 0  # replay requests answered with only the end marker
    encode_errors: int = 0  # batches that could not be encoded (never sent)


class ZmqEventPublisher:
    """Publishes ``KVEventBatch`` es on a PUB socket and serves replays (see module doc)."""

    def __init__(
        self,
        endpoint: str | int,
        replay_endpoint: str | int | None = None,
        topic: str = "",
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        max_queue_size: int = 100_000,
        data_parallel_rank: int = 0,
        fmt: str = "map",
        *,
        hash_format: HashFormat = "u64",
        check_hashes: bool = True,
        bind: bool = True,
        flush_timeout: float = 1.0,
        context: zmq.Context | None = None,
    ) -> None:
        if not isinstance(topic, str):
            raise ValueError(f"topic must be a str, got {topic!r}")
        positive_int("buffer_steps", buffer_steps)
        positive_int("max_queue_size", max_queue_size)
        non_negative_int("hwm", hwm, "0 = unlimited")
        if not isinstance(flush_timeout, (int, float)) or flush_timeout < 0:
            raise ValueError(f"flush_timeout must be a number >= 0, got {flush_timeout!r}")
        pub_endpoint = endpoints.for_rank(endpoints.normalize(endpoint), data_parallel_rank)
        replay = None if replay_endpoint is None else endpoints.normalize(replay_endpoint)
        replay = None if replay is None else endpoints.for_rank(replay, data_parallel_rank)
        # validates fmt, hash_format and check_hashes
        self._encoder = EventEncoder(fmt, hash_format, check_hashes=check_hashes)

        self.topic = topic
        self.data_parallel_rank = data_parallel_rank
        self.fmt = fmt
        self._topic_bytes = topic.encode()
        self._max_queue = max_queue_size
        self._flush_timeout = float(flush_timeout)

        # The caller's thread and the replay thread share the buffer; the lock also keeps
        # sequence numbers, buffer order and queue order identical.
        self._lock = threading.Lock()
        # Entries are [seq, batch or payload]: the batch is replaced by its encoding once.
        self._buffer: deque[list] = deque(maxlen=buffer_steps)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._next_seq = 0
        self._enqueued = 0
        self._dequeued = 0  # written by the sender thread only
        self._stats = PublisherStats()  # published and buffered are filled in by stats()
        self._closed = False
        self._abandon_queue = False
        self._stopping = threading.Event()

        ctx = context or zmq.Context.instance()
        self._pub = ctx.socket(zmq.PUB)
        self._replay: zmq.Socket | None = None
        try:
            self._pub.setsockopt(zmq.SNDHWM, hwm)
            self.endpoint = self._attach(self._pub, pub_endpoint, bind)
            self.replay_endpoint: str | None = None
            if replay is not None:
                self._replay = ctx.socket(zmq.ROUTER)
                # Fail a send to a vanished or stuck client instead of silently dropping
                # the rest of its reply; the bounded timeout keeps the replay thread alive.
                self._replay.setsockopt(zmq.ROUTER_MANDATORY, 1)
                self._replay.setsockopt(zmq.SNDHWM, 0)
                self._replay.setsockopt(zmq.SNDTIMEO, 5000)
                self.replay_endpoint = self._attach(self._replay, replay, True)
        except Exception:
            self._pub.close(linger=0)
            if self._replay is not None:
                self._replay.close(linger=0)
            raise

        self._sender = threading.Thread(target=self._send_loop, name="kv-events-pub", daemon=True)
        self._sender.start()
        self._replayer: threading.Thread | None = None
        if self._replay is not None:
            self._replayer = threading.Thread(target=self._replay_loop, name="kv-events-replay", daemon=True)
            self._replayer.start()

    # -- caller side -------------------------------------------------------------------

    def publish(self, batch_or_events: KVEventBatch | Sequence[KVEvent]) -> int:
        """Queue one batch for sending and return its sequence number; never blocks."""
        if isinstance(batch_or_events, KVEventBatch):
            batch = batch_or_events
            if batch.data_parallel_rank is None:
                batch = KVEventBatch(batch.ts, batch.events, self.data_parallel_rank)
        elif isinstance(batch_or_events, (list, tuple)):
            batch = KVEventBatch(time.time(), list(batch_or_events), self.data_parallel_rank)
        else:
            raise TypeError(f"publish() takes a KVEventBatch or a list of events, got {batch_or_events!r}")
        for event in batch.events:
            if not isinstance(event, EVENT_TYPES):
                raise TypeError(f"not a KV event: {event!r}")
        with self._lock:
            if self._closed:
                raise RuntimeError(f"publisher on {self.endpoint} is closed")
            seq = self._next_seq
            self._next_seq = seq + 1
            entry = [seq, batch]
            self._buffer.append(entry)
            if self._enqueued - self._dequeued >= self._max_queue:
                self._stats.dropped_sends += 1
            else:
                self._enqueued += 1
                self._queue.put(entry)
        return seq

    def _payload(self, entry: list) -> bytes | None:
        """The entry's encoded batch, encoding it the first time (``None``: unencodable)."""
        value = entry[1]
        if value is None or isinstance(value, bytes):
            return value
        try:
            payload = self._encoder.encode(value)
        except (ValueError, TypeError, msgspec.EncodeError) as exc:
            logger.error("KV event batch %d cannot be encoded and is dropped: %s", entry[0], exc)
            with self._lock:
                self._stats.encode_errors += 1
            payload = None
        entry[1] = payload  # the sender and a replay may both encode it; same bytes
        return payload

    def stats(self) -> PublisherStats:
        with self._lock:
            return self._stats.snapshot(published=self._next_seq, buffered=len(self._buffer))

    def close(self) -> None:
        """Flush queued sends for at most ``flush_timeout`` seconds, then close. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(_STOP)
        self._sender.join(self._flush_timeout)
        if self._sender.is_alive():
            self._abandon_queue = True  # the sender skips what is left and exits
            self._sender.join(1.0)
            logger.warning("KV event publisher on %s closed before its queue was flushed", self.endpoint)
        self._stopping.set()
        if self._replayer is not None:
            self._replayer.join(2.0)

    def __enter__(self) -> ZmqEventPublisher:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"ZmqEventPublisher(endpoint={self.endpoint!r}, "
            f"replay_endpoint={self.replay_endpoint!r}, topic={self.topic!r})"
        )

    # -- background threads ------------------------------------------------------------

    def _send_loop(self) -> None:
        pub, topic = self._pub, self._topic_bytes
        while True:
            item = self._queue.get()
            if item is _STOP:
                break
            self._dequeued += 1
            if self._abandon_queue:
                continue
            payload = self._payload(item)
            if payload is None:
                continue
            try:
                # PUB never blocks: at its high-water mark ZMQ drops the message for that
                # subscriber, who then repairs the gap by replay.
                pub.send_multipart((topic, item[0].to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
                self._stats.sent += 1
            except zmq.ZMQError as exc:
                logger.warning("KV event send of seq %d failed: %s", item[0], exc)
        pub.close(linger=int(self._flush_timeout * 1000))

    def _replay_loop(self) -> None:
        sock = self._replay
        assert sock is not None
        try:
            while not self._stopping.is_set():
                if sock.poll(100):
                    try:
                        self._serve_replay(sock, sock.recv_multipart())
                    except zmq.ZMQError as exc:
                        logger.warning("KV event replay aborted: %s", exc)
        finally:
            sock.close(linger=0)

    def _serve_replay(self, sock: zmq.Socket, frames: list[bytes]) -> None:
        client = frames[0]
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            with self._lock:
                self._stats.malformed_requests += 1
            logger.warning("malformed KV event replay request %r; answering with the end marker", frames[1:])
            sock.send_multipart((client, b"", *END_MARKER))
            return
        start = int.from_bytes(frames[2], "big")
        with self._lock:
            self._stats.replay_requests += 1
            first = self._buffer[0][0] if self._buffer else 0
            # Sequence numbers in the buffer are contiguous, so the start is an offset.
            wanted = list(itertools.islice(self._buffer, max(0, start - first), None))
        for entry in wanted:
            payload = self._payload(entry)
            if payload is not None:
                sock.send_multipart((client, b"", self._topic_bytes, entry[0].to_bytes(8, "big"), payload))
        sock.send_multipart((client, b"", *END_MARKER))
        with self._lock:
            self._stats.replayed += len(wanted)

    @staticmethod
    def _attach(sock: zmq.Socket, endpoint: str, bind: bool) -> str:
        if not bind:
            sock.connect(endpoint)
            return endpoint
        deadline = time.monotonic() + _BIND_RETRY_S
        while True:
            try:
                sock.bind(endpoint)
                break
            except zmq.ZMQError as exc:
                if exc.errno != errno.EADDRINUSE or time.monotonic() > deadline:
                    raise ValueError(f"cannot bind KV event endpoint {endpoint!r}: {exc}") from exc
                time.sleep(0.05)
        bound = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        path = bound[len("ipc://") :] if bound.startswith("ipc://") else ""
        if path and not path.startswith("@"):  # a socket file (not Linux's abstract names)
            chmod_private(path)
        return bound
