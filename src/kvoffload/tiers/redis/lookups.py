"""``RemoteLookups``: the Redis tier's ``StoreLookups`` (``kvoffload.tiers.shared_store_lookups``:
requests, answers, batching, ranks), on its own threads.

Existence checks are pipelines of ``EXISTS``, deletions of ``UNLINK``, through
``NodeCalls`` (a circuit breaker per node): while a node is down, probes of its keys fail
at once (``failed``), and a command the server refused fails its names too.

``gone`` answers come from reconciliations and from keyspace notifications (``evicted``,
``expired``, ``del`` events of this namespace, when the server has
``notify-keyspace-events`` enabled with ``E`` and ``g``, ``x``, ``e`` or ``A``: the tier
does not change server settings), heard on a second thread. ``resync``: the notification
stream was (re)connected after a loss: what was missed is unknown. Notifications are off
on a Redis Cluster (they are per node); reconciliation covers it.

While every node is down the manager asks nothing (lookups miss at once), so the thread
checks the server every ``HEARTBEAT_S`` seconds when idle (as far as the breaker lets it):
its return is noticed without traffic, notifications or a reconciliation.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Sequence

from kvoffload.tiers.redis.calls import NodeCalls, NodeDown
from kvoffload.tiers.redis.format import KeyNames
from kvoffload.tiers.shared_store_lookups import Answer, StoreLookups

log = logging.getLogger("kvoffload.tiers.redis")

_EVENTS = ("evicted", "expired", "del")
HEARTBEAT_S = 0.5
_HEARTBEAT_NAME = b"kvoffload-heartbeat"


class RemoteLookups(StoreLookups):
    idle_s = HEARTBEAT_S

    def __init__(
        self,
        connect: Callable[[], object],
        names: KeyNames | Sequence[KeyNames],
        calls: NodeCalls,
        notifications: bool = True,
        db: int = 0,
    ) -> None:
        self._connect = connect
        self.calls = calls
        self._db = db
        super().__init__(names, "kvoffload-redis-lookups")
        self._listener = None
        # set while the listener is subscribed (the server confirmed it): a removal after
        # that is heard; one before it is found by the resync or reconciliation
        self.listening = threading.Event()
        if notifications:
            self._listener = threading.Thread(target=self._listen, name="kvoffload-redis-events", daemon=True)
            self._listener.start()

    @property
    def down(self) -> bool:
        return self.calls.down

    @property
    def outages(self) -> int:
        return self.calls.outages

    def close(self, timeout: float = 5.0) -> None:
        """Stop both threads (bounded by ``timeout``); queued requests are dropped."""
        super().close(timeout)
        if self._listener is not None:
            self._listener.join(timeout)

    # -- calls ---------------------------------------------------------------------------

    def _rank_names(self, ranks: KeyNames, keys: Sequence[bytes]) -> list[bytes]:
        return ranks.names(keys)

    def _exist(self, names: list[bytes]) -> list[bool | None]:
        replies = self.calls.run(names, lambda name, _: ("EXISTS", name))
        return [None if isinstance(reply, NodeDown) else bool(reply) for reply in replies]

    def _remove(self, names: list[bytes]) -> None:
        self.calls.run(names, lambda name, _: ("UNLINK", name))

    def _wants_heartbeat(self) -> bool:
        return self.calls.down

    def _heartbeat(self) -> None:
        self.calls.run([_HEARTBEAT_NAME], lambda name, _: ("EXISTS", name))

    # -- keyspace notifications ----------------------------------------------------------

    def _listen(self) -> None:
        channels = [f"__keyevent@{self._db}__:{event}" for event in _EVENTS]
        reconnecting = False
        while not self._stop.is_set():
            pubsub = None
            try:
                client = self._connect()
                flags = client.config_get("notify-keyspace-events").get("notify-keyspace-events", "")
                if "E" not in flags or not ("A" in flags or {"g", "x", "e"} <= set(flags)):
                    log.info(
                        "redis tier: notify-keyspace-events is %r on the server; server-side "
                        "removals are found by reconciliation only",
                        flags,
                    )
                    return
                pubsub = client.pubsub()
                pubsub.subscribe(*channels)
                if reconnecting:
                    self._answers.put(Answer("resync", ()))
                reconnecting = True
                confirmed = 0
                while not self._stop.is_set():
                    message = pubsub.get_message(timeout=0.2)
                    if message is None:
                        continue
                    if message["type"] == "subscribe":
                        confirmed += 1
                        if confirmed == len(channels):
                            self.listening.set()
                        continue
                    if message["type"] != "message":
                        continue
                    key = next(
                        (k for ranks in self._ranks if (k := ranks.key_of(message["data"])) is not None), None
                    )
                    if key is not None:
                        self._answers.put(Answer("gone", (key,)))
            except Exception:  # noqa: BLE001 - reconnect after any error, paced by the breaker delay
                self.listening.clear()
                self._stop.wait(2.5)
            finally:
                if pubsub is not None:
                    with contextlib.suppress(Exception):
                        pubsub.close()
