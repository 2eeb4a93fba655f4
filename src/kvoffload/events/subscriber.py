"""Subscriber of KV event batches that repairs gaps from the publisher's replay buffer.

Contract:

* ``receive(timeout)`` returns the next ``(seq, batch)`` in sequence order, or ``None``
  when nothing arrives in time; iterating the subscriber yields them forever. Each
  sequence number is delivered at most once per publisher lifetime.
* A gap (live ``seq`` above the next expected one) is filled by asking the replay
  endpoint for everything from the first missing sequence on. Sequence numbers the
  publisher no longer buffers, or that no replay answered within ``replay_timeout``, are
  counted as ``lost``; with no replay endpoint every gap is lost.
* A subscriber that joins late (first live ``seq`` above ``start_seq``) backfills from
  ``start_seq`` (0 by default; ``None`` starts from the first live batch).
* A live sequence number at or below the last live one, a live batch that differs from
  the one replay already delivered under its number, or, before any live batch of this
  publisher lifetime, a live sequence number below the next expected one that was never
  delivered (e.g. below a resumed ``start_seq``, or after a stream delivered by replay
  alone) means the publisher restarted:
  ``restarts`` is counted and delivery starts over from the new publisher's first batch
  (sequence 0, whatever ``start_seq`` was: it names where to join the first publisher's
  stream, and a checkpoint of the old stream means nothing in the new one).
* A message that is not three frames with an 8-byte sequence, or whose payload does not
  decode, is skipped and counted as ``malformed``. The sequence frame of a payload that
  does not decode is believed only when it is exactly the next expected number (that
  batch is then skipped: it is not requested again, and the next delivery's ``gap``
  counts it); any other number moves nothing, so noise never counts batches lost or looks
  like a publisher restart.
* ``stats()`` counts: ``decoded`` = ``live`` + ``replayed`` batches delivered, ``lost``,
  ``malformed``, ``duplicates`` (already delivered, skipped), ``restarts``,
  ``replay_requests``, ``replay_timeouts`` (requests no replay answered in time).
* ``decoder`` turns a payload into a batch, raising ``EventDecodeError`` for one that is
  not (default ``kvoffload.events.codec.decode``; a consumer may decode lazily).
* ``receive_delivery(timeout)`` is ``receive`` for consumers that keep state derived from
  the stream (an index): each ``Delivery`` also says in which publisher lifetime it was
  sent (``epoch``, the restarts seen before it), how many batches of that lifetime before
  it will never be delivered (``gap``: lost, or undecodable), and whether it came by replay.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

import zmq

from kvoffload.counters import Counters
from kvoffload.events import endpoints
from kvoffload.events.codec import EventDecodeError, decode
from kvoffload.events.publisher import END_SEQ
from kvoffload.events.types import KVEventBatch
from kvoffload.validation import non_negative_int

logger = logging.getLogger(__name__)

_AHEAD_LIMIT = 1 << 20  # remembered replay-ahead payload hashes, if live never catches up
_SKIPPED_LIMIT = 1024  # remembered ranges counted lost


@dataclass
class SubscriberStats(Counters):
    decoded: int = 0
    live: int = 0
    replayed: int = 0
    lost: int = 0
    malformed: int = 0
    duplicates: int = 0
    restarts: int = 0
    replay_requests: int = 0
    replay_timeouts: int = 0


class Delivery(NamedTuple):
    """One delivered batch and where it stands in the stream (see ``receive_delivery``)."""

    seq: int
    batch: KVEventBatch
    epoch: int  # publisher restarts seen before this batch was delivered
    gap: int  # batches of this publisher lifetime missing since the previous delivery
    replayed: bool  # delivered from the replay endpoint, not the live stream


def _connect_address(endpoint: str | int, rank: int) -> str:
    address = endpoints.for_rank(endpoints.normalize(endpoint), rank)
    # A publisher bound on every interface is reached through the loopback one.
    for wildcard in ("tcp://*:", "tcp://0.0.0.0:"):
        if address.startswith(wildcard):
            return f"tcp://{endpoints.LOCALHOST}:{address[len(wildcard) :]}"
    return address


class EventSubscriber:
    """Receives, orders, de-duplicates and gap-repairs a publisher's batches (see module doc)."""

    def __init__(
        self,
        endpoint: str | int,
        replay_endpoint: str | int | None = None,
        topic: str = "",
        *,
        start_seq: int | None = 0,
        replay_timeout: float = 5.0,
        hwm: int = 100_000,
        data_parallel_rank: int = 0,
        context: zmq.Context | None = None,
        decoder: Callable[[bytes], KVEventBatch] = decode,
    ) -> None:
        if not isinstance(topic, str):
            raise ValueError(f"topic must be a str, got {topic!r}")
        if start_seq is not None:
            non_negative_int("start_seq", start_seq, "or None")
        if not isinstance(replay_timeout, (int, float)) or replay_timeout <= 0:
            raise ValueError(f"replay_timeout must be a positive number of seconds, got {replay_timeout!r}")
        non_negative_int("hwm", hwm, "0 = unlimited")
        self.endpoint = _connect_address(endpoint, data_parallel_rank)
        self.replay_endpoint = (
            None if replay_endpoint is None else _connect_address(replay_endpoint, data_parallel_rank)
        )
        self.topic = topic
        self._start_seq = start_seq
        self._replay_timeout_ms = int(replay_timeout * 1000)
        self._ctx = context or zmq.Context.instance()
        self._decoder = decoder
        self._expected: int | None = start_seq  # next sequence number to deliver
        self._last_live: int | None = None
        self._ready: deque[Delivery] = deque()
        self._gap = 0  # batches missing since the last delivery, in this publisher lifetime
        # Payload hashes of batches replay delivered ahead of the live stream: their live
        # copies are duplicates only if they are the same bytes.
        self._ahead: dict[int, int] = {}
        self._ahead_order: deque[int] = deque()
        self._ahead_floor = -1  # the highest sequence number forgotten for _AHEAD_LIMIT
        # Ranges of this publisher lifetime counted lost (newest last, at most _SKIPPED_LIMIT):
        # a live batch arriving late inside one is the same publisher's, not a new one's.
        self._skipped: deque[tuple[int, int]] = deque()
        self._stats = SubscriberStats()

        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.RCVHWM, hwm)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sub.connect(self.endpoint)
        self._replay: zmq.Socket | None = None
        if self.replay_endpoint is not None:
            self._replay = self._new_replay_socket()

    # -- public API --------------------------------------------------------------------

    def receive(self, timeout: float | None = None) -> tuple[int, KVEventBatch] | None:
        """The next batch in order, or ``None`` if none is ready within ``timeout`` seconds."""
        delivery = self.receive_delivery(timeout)
        return None if delivery is None else (delivery.seq, delivery.batch)

    def receive_delivery(self, timeout: float | None = None) -> Delivery | None:
        """Like ``receive``, with the batch's lifetime, preceding gap and origin."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._ready:
            wait_ms = -1 if deadline is None else max(0, int((deadline - time.monotonic()) * 1000))
            if not self._sub.poll(wait_ms):
                if deadline is not None and time.monotonic() >= deadline:
                    return None
                continue
            self._on_live(self._sub.recv_multipart())
        return self._ready.popleft()

    def __iter__(self) -> Iterator[tuple[int, KVEventBatch]]:
        while True:
            item = self.receive()
            if item is not None:
                yield item

    def catch_up(self) -> int:
        """Ask the replay endpoint for everything after the last delivered batch.

        Useful when the stream goes quiet: a dropped *last* message leaves no gap to notice.
        Returns how many batches became ready."""
        before = len(self._ready)
        if self._replay is not None:
            start = self._expected if self._expected is not None else 0
            self._repair(start, None)
        return len(self._ready) - before

    @property
    def next_seq(self) -> int | None:
        """The sequence number expected next (``None`` before the first batch if
        ``start_seq`` is ``None``)."""
        return self._expected

    @property
    def pending_gap(self) -> int:
        """Batches known missing that no delivery has reported yet (its ``gap`` will)."""
        return self._gap

    def stats(self) -> SubscriberStats:
        return self._stats.snapshot()

    def close(self) -> None:
        self._sub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def __enter__(self) -> EventSubscriber:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- internals ---------------------------------------------------------------------

    def _on_live(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self._stats.malformed += 1
            logger.warning("skipping malformed KV event message of %d frames", len(frames))
            return
        # Decoded before its sequence frame is believed: a message that is not a batch
        # (noise, a foreign sender) must not count batches lost or look like a restart.
        seq = int.from_bytes(frames[1], "big")
        batch = self._decode(frames[2], frames[1].hex())
        if batch is None:
            self._skip_undecodable(seq)
            return
        if self._is_restart(seq, frames[2]):
            self._stats.restarts += 1
            logger.warning("KV event publisher restarted (live seq %d, expected %s)", seq, self._expected)
            self._expected = 0
            self._gap = 0  # what the old publisher's stream missed is no gap in the new one
            self._ahead.clear()
            self._ahead_order.clear()
            self._ahead_floor = -1
            self._skipped.clear()
        self._last_live = seq
        while self._ahead_order and self._ahead_order[0] <= seq:
            self._ahead.pop(self._ahead_order.popleft(), None)
        if self._expected is None:
            self._expected = seq
        if seq > self._expected:
            self._repair(self._expected, seq)
        if seq < self._expected:
            self._stats.duplicates += 1
            return
        self._deliver(seq, batch, live=True)

    def _is_restart(self, seq: int, payload: bytes) -> bool:
        delivered = self._ahead.get(seq)
        if self._last_live is not None:
            # One publisher's live stream only goes up, so going back means a new
            # publisher. Above the last live number it is the same publisher's, also when
            # replay went further (a late live message of a range replay delivered, or
            # counted lost because it had left the publisher's buffer): unless replay
            # delivered other bytes under that number.
            if seq <= self._last_live:
                return True
            return delivered is not None and delivered != hash(payload)
        if delivered is not None:
            return delivered != hash(payload)
        # No live batch yet in this lifetime: below the next expected number yet neither
        # delivered by replay nor counted lost is not this publisher's, so a new one's.
        # Without this, a subscriber fed by replay alone would drop a restarted
        # publisher's whole stream as duplicates.
        if any(lo <= seq <= hi for lo, hi in self._skipped):
            return False
        return self._expected is not None and self._ahead_floor < seq < self._expected

    def _count_lost(self, lo: int, hi: int) -> None:
        """Sequence numbers ``lo..hi`` will never be delivered in this lifetime."""
        self._stats.lost += hi - lo + 1
        self._gap += hi - lo + 1
        skipped = self._skipped
        if skipped and skipped[-1][1] + 1 >= lo:
            skipped[-1] = (skipped[-1][0], max(hi, skipped[-1][1]))
        else:
            skipped.append((lo, hi))
            if len(skipped) > _SKIPPED_LIMIT:
                skipped.popleft()

    def _decode(self, payload: bytes, seq: str) -> KVEventBatch | None:
        try:
            return self._decoder(payload)
        except EventDecodeError as exc:
            self._stats.malformed += 1
            logger.warning("skipping KV event message (sequence frame %s): %s", seq, exc)
            return None

    def _skip_undecodable(self, seq: int) -> None:
        if seq == self._expected:
            # The next batch in order, corrupted: never delivered, so the next delivery's
            # gap reports it. Any other number is not believed (a gap repairs it if real).
            self._expected = seq + 1
            self._gap += 1

    def _deliver(self, seq: int, batch: KVEventBatch, live: bool) -> None:
        self._expected = seq + 1
        self._stats.decoded += 1
        if live:
            self._stats.live += 1
        else:
            self._stats.replayed += 1
        self._ready.append(Delivery(seq, batch, self._stats.restarts, self._gap, not live))
        self._gap = 0

    def _repair(self, start: int, until: int | None) -> None:
        """Deliver replayed batches from ``start``; count as lost what misses below ``until``."""
        if self._replay is not None and self._request_replay(start):
            self._read_replay()
        if until is not None and self._expected is not None and self._expected < until:
            self._count_lost(self._expected, until - 1)
            self._expected = until

    def _request_replay(self, start: int) -> bool:
        assert self._replay is not None
        self._stats.replay_requests += 1
        try:
            self._replay.send_multipart((b"", start.to_bytes(8, "big")), flags=zmq.NOBLOCK)
            return True
        except zmq.Again:
            logger.warning("KV event replay endpoint %s is not reachable", self.replay_endpoint)
            return False

    def _read_replay(self) -> None:
        sock = self._replay
        assert sock is not None
        while True:
            if not sock.poll(self._replay_timeout_ms):
                self._stats.replay_timeouts += 1
                logger.warning("KV event replay from %s timed out", self.replay_endpoint)
                # A late answer must not be mistaken for the next request's, so start afresh.
                sock.close(linger=0)
                self._replay = self._new_replay_socket()
                return
            frames = sock.recv_multipart()
            if len(frames) != 4 or frames[0] != b"" or len(frames[2]) != 8:
                self._stats.malformed += 1
                continue
            if frames[2] == END_SEQ:
                return
            seq = int.from_bytes(frames[2], "big")
            batch = self._decode(frames[3], frames[2].hex())
            if batch is None:
                self._skip_undecodable(seq)
                continue
            assert self._expected is not None
            if seq < self._expected:
                self._stats.duplicates += 1
                continue
            if seq > self._expected:
                self._count_lost(self._expected, seq - 1)  # fell out of the publisher's buffer
            self._ahead[seq] = hash(frames[3])
            self._ahead_order.append(seq)
            if len(self._ahead_order) > _AHEAD_LIMIT:
                forgotten = self._ahead_order.popleft()
                self._ahead.pop(forgotten, None)
                self._ahead_floor = max(self._ahead_floor, forgotten)
            self._deliver(seq, batch, live=False)

    def _new_replay_socket(self) -> zmq.Socket:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.RCVHWM, 0)  # a replay reply may be the whole buffer
        sock.setsockopt(zmq.LINGER, 0)
        assert self.replay_endpoint is not None
        sock.connect(self.replay_endpoint)
        return sock
