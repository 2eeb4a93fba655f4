"""``Lane``: one connection of a standalone server kept for a worker's batches, which
several threads drive in turns, so that queued jobs run back to back.

A worker thread that finished a batch spends Python time on its job (results, counters)
and on the next one (names, plans), and with a busy Python thread in the process it also
waits for the GIL each time it takes it back: on one connection per thread, the wire was
idle all that while. On a lane two threads (or more) share one connection: each plans
its job while the other's batch is on the wire, and waits in C (``_pipelines.Turns``,
without the GIL) for that batch's last reply; its own batch goes out at that moment. One
batch is on the wire at a time: the pipeline depth is a job's, as before.

``borrow(pool)`` gives the lane's connection (taken from ``pool`` when it has none, or
when its turns broke: no batch is on it then) and its ``Turns``; a connection is kept
when the client (and its pool) is replaced, since another thread may be mid-batch on it. ``drop(connection)``
disconnects a connection whose batch failed and gives it back to its pool, if the lane
still holds it: exactly one thread does that (the one whose batch failed, or the next to
borrow). ``close()`` gives the connection back. Thread-safe.

``TurnLost`` is what a batch raises when an earlier batch on its connection failed: it
was not sent, and may run again on a fresh connection. ``Stale``: a batch on a kept
connection found it closed (the server restarted or dropped it while idle); both
directions may run again on a fresh one (``SET NX`` and ``GET`` are idempotent).
"""

from __future__ import annotations

import threading
from typing import Any

try:
    from kvoffload.tiers.redis._pipelines import TurnLost, Turns
except ImportError:  # pragma: no cover - depends on the build: no lanes without the C module
    Turns = None

    class TurnLost(ConnectionError):  # type: ignore[no-redef]
        """Never raised without the C module."""


class Stale(ConnectionError):
    """A kept connection was found closed by the batch on it: run the batch again on a fresh one."""


AVAILABLE = Turns is not None  # lanes need the C module's Turns


class Lane:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pool: Any = None
        self._connection: Any = None
        self._turns: Any = None
        self._behind = 0  # of the turns given up

    @property
    def back_to_back(self) -> int:
        """Batches that came while another one had the lane's connection: each was sent the
        moment the batches before it were answered."""
        with self._lock:
            return self._behind + (self._turns.behind if self._turns is not None else 0)

    def borrow(self, pool: Any) -> tuple[Any, Any, bool]:
        """The lane's connection from ``pool`` (connected by redis-py), its turns, and
        whether the connection was kept from earlier batches (it may have gone stale while
        idle, as a pooled one would, which redis-py checks when it hands one out)."""
        with self._lock:
            if self._connection is not None and self._turns.broken:
                self._give_back(disconnect=True)
            if self._connection is None:
                self._connection = pool.get_connection()  # raises if the server cannot be reached
                self._pool, self._turns = pool, Turns()
                return self._connection, self._turns, False
            return self._connection, self._turns, True

    def drop(self, connection: Any) -> None:
        """``connection`` failed a batch: disconnected and given back, if the lane holds it."""
        with self._lock:
            if self._connection is connection:
                self._give_back(disconnect=True)

    def close(self) -> None:
        with self._lock:
            if self._connection is not None:
                self._give_back(disconnect=False)

    def _give_back(self, disconnect: bool) -> None:
        connection, pool = self._connection, self._pool
        self._behind += self._turns.behind
        self._connection = self._pool = self._turns = None
        try:
            if disconnect:
                connection.disconnect()
        finally:
            pool.release(connection)
