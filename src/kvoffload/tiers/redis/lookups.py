"""``RemoteLookups``: the scheduler side's one window on the server, on its own threads.

The scheduler thread never touches a socket. It posts requests (``probe`` a key,
``delete`` keys, ``reconcile`` keys it believes present) with non-blocking queue puts; a
background thread serves them in batches (everything queued at once goes in one
pipeline of ``EXISTS`` or ``UNLINK``) and posts ``Answer``s that the scheduler thread
collects with ``answers()`` (never blocks).

* ``present`` / ``absent``: the verdict of probed keys; ``failed``: keys whose probe
  could not be made (server down: the breaker is open or the call failed).
* ``gone``: keys the server no longer holds, learnt from keyspace notifications
  (``evicted``, ``expired``, ``del`` events of this namespace, when the server has
  ``notify-keyspace-events`` enabled with ``E`` and ``g``, ``x``, ``e`` or ``A``: the tier
  does not change server settings) or from a reconciliation.
* ``resync``: the notification stream was (re)connected after a loss: what was missed is
  unknown, so the manager should reconcile.

With tensor parallelism each rank stores its share of a block under its own name
(``names`` holds one ``KeyNames`` per rank): a key is ``present`` only when every rank's
name exists, ``gone`` when any rank's is; ``delete`` unlinks every rank's.

Calls go through ``NodeCalls`` (a circuit breaker per node): while a node is down, probes
of its keys fail at once. Notifications are off on a Redis Cluster (they are per node);
reconciliation covers it.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvoffload.tiers.redis.calls import NodeCalls, NodeDown
from kvoffload.tiers.redis.format import KeyNames

log = logging.getLogger("kvoffload.tiers.redis")

BATCH = 512
_EVENTS = ("evicted", "expired", "del")


@dataclass(frozen=True)
class Answer:
    kind: str  # "present", "absent", "failed", "gone", "resync"
    keys: tuple[bytes, ...]


class RemoteLookups:
    def __init__(
        self,
        connect: Callable[[], object],
        names: KeyNames | Sequence[KeyNames],
        calls: NodeCalls,
        notifications: bool = True,
        db: int = 0,
    ) -> None:
        self._connect = connect
        self._ranks = (names,) if isinstance(names, KeyNames) else tuple(names)
        self.calls = calls
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._answers: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._db = db
        self.probes_sent = 0
        self._thread = threading.Thread(target=self._run, name="kvoffload-redis-lookups", daemon=True)
        self._thread.start()
        self._listener = None
        if notifications:
            self._listener = threading.Thread(target=self._listen, name="kvoffload-redis-events", daemon=True)
            self._listener.start()

    # -- scheduler thread ----------------------------------------------------------------

    def probe(self, key: bytes) -> None:
        self._requests.put(("probe", key))

    def delete(self, keys: Sequence[bytes]) -> None:
        if keys:
            self._requests.put(("delete", tuple(keys)))

    def reconcile(self, keys: Sequence[bytes]) -> None:
        if keys:
            self._requests.put(("reconcile", tuple(keys)))

    def answers(self) -> list[Answer]:
        out = []
        get = self._answers.get_nowait
        try:
            while True:
                out.append(get())
        except queue.Empty:
            return out

    def has_answers(self) -> bool:
        return not self._answers.empty()

    def close(self, timeout: float = 5.0) -> None:
        """Stop both threads (bounded by ``timeout``); queued requests are dropped."""
        self._stop.set()
        self._requests.put(("stop", None))
        self._thread.join(timeout)
        if self._listener is not None:
            self._listener.join(timeout)

    # -- background thread ---------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            batch = [self._requests.get()]
            try:
                while len(batch) < 16 * BATCH:
                    batch.append(self._requests.get_nowait())
            except queue.Empty:
                pass
            probes = [item for kind, item in batch if kind == "probe"]
            for start in range(0, len(probes), BATCH):
                self._exists(probes[start : start + BATCH], "present", "absent", "failed")
            for kind, item in batch:
                if kind == "delete":
                    self._unlink(item)
                elif kind == "reconcile":
                    for start in range(0, len(item), BATCH):
                        self._exists(item[start : start + BATCH], None, "gone", None)

    def _all_names(self, keys: Sequence[bytes]) -> list[bytes]:
        return [name for ranks in self._ranks for name in ranks.names(keys)]

    def _exists(self, keys: Sequence[bytes], hit: str | None, miss: str, failed: str | None) -> None:
        self.probes_sent += len(keys)
        replies = self.calls.run(self._all_names(keys), lambda name, _: ("EXISTS", name))
        verdicts: dict[str | None, list[bytes]] = {hit: [], miss: [], failed: []}
        n = len(keys)
        for i, key in enumerate(keys):
            ranks = replies[i::n]  # this key's reply from every rank's name
            down = any(isinstance(reply, NodeDown) for reply in ranks)
            verdicts[failed if down else hit if all(ranks) else miss].append(key)
        for kind, found in verdicts.items():
            if kind and found:
                self._answers.put(Answer(kind, tuple(found)))

    def _unlink(self, keys: Sequence[bytes]) -> None:
        self.calls.run(self._all_names(keys), lambda name, _: ("UNLINK", name))

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
                pubsub = client.pubsub(ignore_subscribe_messages=True)
                pubsub.subscribe(*channels)
                if reconnecting:
                    self._answers.put(Answer("resync", ()))
                reconnecting = True
                while not self._stop.is_set():
                    message = pubsub.get_message(timeout=0.2)
                    if message is None:
                        continue
                    key = next(
                        (k for ranks in self._ranks if (k := ranks.key_of(message["data"])) is not None), None
                    )
                    if key is not None:
                        self._answers.put(Answer("gone", (key,)))
            except Exception:  # noqa: BLE001 - reconnect after any error, paced by the breaker delay
                self._stop.wait(2.5)
            finally:
                if pubsub is not None:
                    with contextlib.suppress(Exception):
                        pubsub.close()
