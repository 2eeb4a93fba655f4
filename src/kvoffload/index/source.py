"""One publisher's stream into the index: a thread with its own gap-repairing subscriber.

Contract:

* ``EventSource(index, engine, endpoint, replay_endpoint)`` subscribes to one publisher
  (``kvoffload.events.EventSubscriber``, from sequence 0: a late joiner backfills by
  replay; token ids decoded lazily, ``kvoffload.index.wire``) and applies every delivered
  batch to ``engine`` in ``index``, in order, on its own thread (``start``/``stop``). The
  endpoints are the publisher's own (no data-parallel offset is derived: register each
  rank's endpoint).
* State (``kvoffload.index.state``), kept on the engine so queries report it:

  - ``FALLBACK`` until the publisher is heard from: a first batch, or a replay answer
    that shows it has published nothing yet (then ``EXACT``, empty).
  - a delivery preceded by a gap (batches lost beyond the replay buffer, undecodable, or
    no replay endpoint to ask) makes it ``DEGRADED``; so does a gap known before the next
    delivery. An ``AllBlocksCleared`` makes it ``EXACT`` again (nothing is held).
  - a publisher restart (its sequence going back) drops the engine's entries and starts
    over from the new lifetime's first batch: ``EXACT`` unless that start is lost.
  - if ingestion fails, the engine's entries are dropped and the state is ``FALLBACK``.
* While the stream is idle the subscriber asks the replay endpoint for anything after the
  last batch every ``idle_catch_up`` seconds: a lost *last* batch leaves no gap to notice.
* ``stats()``: batches and events applied, gaps (deliveries preceded by one), batches lost,
  restarts, gaps repaired (replay runs that recovered everything they were asked for),
  times degraded; and the subscriber's own counters.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import zmq

from kvoffload.counters import Counters
from kvoffload.events.subscriber import Delivery, EventSubscriber
from kvoffload.index.core import BlockIndex
from kvoffload.index.space import Engine
from kvoffload.index.state import SourceState
from kvoffload.index.wire import decode_batch

logger = logging.getLogger(__name__)

_POLL_S = 0.1  # how often the thread looks at its stop flag


@dataclass
class SourceStats(Counters):
    batches: int = 0  # batches applied
    events: int = 0  # events in them
    gaps: int = 0  # deliveries preceded by missing batches
    lost: int = 0  # batches missing in all
    restarts: int = 0  # publisher restarts (entries dropped, stream started over)
    gaps_repaired: int = 0  # replay runs that delivered every batch they were asked for
    degraded: int = 0  # times the source became DEGRADED
    errors: int = 0  # ingestion failures (the source then stops, FALLBACK)


class EventSource:
    """Feeds one publisher's events into one engine of the index (see module doc)."""

    def __init__(
        self,
        index: BlockIndex,
        engine: Engine,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        *,
        replay_timeout: float = 2.0,
        idle_catch_up: float = 1.0,
        context: zmq.Context | None = None,
    ) -> None:
        if not isinstance(idle_catch_up, (int, float)) or idle_catch_up <= 0:
            raise ValueError(f"idle_catch_up must be a positive number of seconds, got {idle_catch_up!r}")
        self.index = index
        self.engine = engine
        self._sub = EventSubscriber(
            endpoint,
            replay_endpoint,
            topic,
            start_seq=0,
            replay_timeout=replay_timeout,
            context=context,
            decoder=decode_batch,
        )
        self.endpoint = self._sub.endpoint
        self.replay_endpoint = self._sub.replay_endpoint
        self._idle_catch_up = float(idle_catch_up)
        self._stats = SourceStats()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._epoch = 0
        self._replay_run = False  # inside a run of replayed deliveries
        self._replay_run_clean = True
        self._thread = threading.Thread(
            target=self._run, name=f"kv-index-{engine.instance_id}-dp{engine.dp_rank}", daemon=True
        )

    @property
    def state(self) -> SourceState:
        return self.engine.state

    def start(self) -> EventSource:
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop ingesting and close the subscriber. Idempotent."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        elif self._thread.ident is None:
            self._sub.close()  # never started: the thread did not take the socket over

    def stats(self) -> SourceStats:
        with self._lock:
            return self._stats.snapshot()

    def subscriber_stats(self) -> dict[str, int]:
        return self._sub.stats().as_dict()

    # -- the ingestion thread --------------------------------------------------------------

    def _run(self) -> None:
        sub = self._sub
        try:
            if sub.replay_endpoint is not None:
                self._first_catch_up()
            last_heard = time.monotonic()
            while not self._stop.is_set():
                delivery = sub.receive_delivery(_POLL_S)
                if delivery is not None:
                    last_heard = time.monotonic()
                    self._on_delivery(delivery)
                    continue
                self._end_replay_run()
                if sub.replay_endpoint is not None and time.monotonic() - last_heard >= self._idle_catch_up:
                    sub.catch_up()
                    last_heard = time.monotonic()
                if sub.pending_gap and self.engine.state is not SourceState.DEGRADED:
                    self._set_state(SourceState.DEGRADED)
        except Exception:
            logger.exception("KV index source %s stopped", self.endpoint)
            with self._lock:
                self._stats.errors += 1
            self.index.clear(self.engine)
            self._set_state(SourceState.FALLBACK)
        finally:
            sub.close()

    def _first_catch_up(self) -> None:
        sub = self._sub
        timeouts = sub.stats().replay_timeouts
        ready = sub.catch_up()
        answered = sub.stats().replay_timeouts == timeouts
        if ready == 0 and answered and not sub.pending_gap and self.engine.state is SourceState.FALLBACK:
            self._set_state(SourceState.EXACT)  # the publisher has published nothing: it holds nothing

    def _on_delivery(self, delivery: Delivery) -> None:
        engine = self.engine
        if delivery.epoch != self._epoch:
            self._epoch = delivery.epoch
            self.index.clear(engine)  # the old lifetime's entries mean nothing any more
            with self._lock:
                self._stats.restarts += 1
            logger.warning("KV event publisher %s restarted: its entries were dropped", self.endpoint)
            self._set_state(SourceState.EXACT)
        if delivery.replayed:
            self._replay_run = True
            self._replay_run_clean &= delivery.gap == 0
        else:
            self._end_replay_run()
        if delivery.gap:
            with self._lock:
                self._stats.gaps += 1
                self._stats.lost += delivery.gap
            self._set_state(SourceState.DEGRADED)
        elif engine.state is SourceState.FALLBACK:
            self._set_state(SourceState.EXACT)
        events = delivery.batch.events
        if self.index.apply(engine, events) and engine.state is SourceState.DEGRADED:
            self._set_state(SourceState.EXACT)  # cleared: nothing is held, exactly
        with self._lock:
            self._stats.batches += 1
            self._stats.events += len(events)

    def _end_replay_run(self) -> None:
        if self._replay_run:
            if self._replay_run_clean:
                with self._lock:
                    self._stats.gaps_repaired += 1
            self._replay_run = False
            self._replay_run_clean = True

    def _set_state(self, state: SourceState) -> None:
        if state is self.engine.state:
            return
        if state is SourceState.DEGRADED:
            with self._lock:
                self._stats.degraded += 1
            logger.warning("KV index source %s is DEGRADED: batches were lost", self.endpoint)
        self.index.set_state(self.engine, state)
