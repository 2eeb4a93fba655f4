"""``MooncakeLookups``: the scheduler side's one window on the Mooncake master, on its own
thread.

The scheduler thread never calls the client. It posts requests (``probe`` a key,
``delete`` keys, ``reconcile`` keys it believes present) with non-blocking queue puts; a
background thread serves everything queued at once in batches (``batch_is_exist``,
``batch_remove``) and posts ``Answer``s the scheduler thread collects with ``answers()``
(never blocks):

* ``present`` / ``absent``: the verdict of probed keys; ``failed``: keys whose probe could
  not be made (the master is down: the client is not set up, the breaker is open, or the
  call answered an outage code);
* ``gone``: keys a reconciliation found missing (Mooncake evicts in the background and
  loses every key when its master restarts; it sends no notifications to its clients);
* ``resync``: the master answers again after an outage: what it lost is unknown (a
  restarted master starts empty), so the manager should reconcile now. While the master
  is down and nothing is asked, the thread checks it every ``HEARTBEAT_S`` seconds (as
  far as the breaker lets it), so its return is noticed without traffic.

With tensor parallelism each rank stores its share under its own name (``names`` holds
one ``KeyNames`` per rank): a key is ``present`` only when every rank's object exists,
``gone`` when any rank's is missing; ``delete`` removes every rank's.

Deletions are forced (``force=True``): an existence check or a get grants a lease
(10 s by default) during which a plain remove fails, and the tier's own probes would keep
its blocks leased. A reader that loses an object under it reads a short or torn value,
which the block's checks turn into a counted miss.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from kvoffload.tiers.mooncake.names import object_names
from kvoffload.tiers.mooncake.store import MooncakeStore, StoreClosed, split_codes
from kvoffload.tiers.redis.format import KeyNames

BATCH = 512
HEARTBEAT_S = 0.5


@dataclass(frozen=True)
class Answer:
    kind: str  # "present", "absent", "failed", "gone", "resync"
    keys: tuple[bytes, ...]


class MooncakeLookups:
    def __init__(self, store: MooncakeStore, names: KeyNames | Sequence[KeyNames]) -> None:
        self.store = store
        self._ranks = (names,) if isinstance(names, KeyNames) else tuple(names)
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._answers: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._recoveries = store.breaker.recoveries
        self.probes_sent = 0
        self._thread = threading.Thread(target=self._run, name="kvoffload-mooncake-lookups", daemon=True)
        self._thread.start()

    @property
    def down(self) -> bool:
        return self.store.down

    @property
    def outages(self) -> int:
        return self.store.breaker.outages

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

    def close(self, timeout: float = 10.0) -> None:
        """Stop the thread (bounded by ``timeout``), then close the store; queued requests
        are dropped."""
        self._stop.set()
        self._requests.put(("stop", None))
        self._thread.join(timeout)
        self.store.close()

    # -- background thread ---------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                batch = [self._requests.get(timeout=HEARTBEAT_S)]
            except queue.Empty:
                # idle while the master is down: one call now and then, so that the breaker
                # notices its return without waiting for the next lookup
                if self.store.breaker.is_open:
                    batch = [("heartbeat", None)]
                else:
                    continue
            try:
                while len(batch) < 16 * BATCH:
                    batch.append(self._requests.get_nowait())
            except queue.Empty:
                pass
            if self._stop.is_set():
                return
            try:
                self._serve(batch)
            except StoreClosed:
                return

    def _serve(self, batch: list) -> None:
        probes = [item for kind, item in batch if kind == "probe"]
        for start in range(0, len(probes), BATCH):
            self._exists(probes[start : start + BATCH], "present", "absent", "failed")
        for kind, item in batch:
            if kind == "heartbeat":
                self.store.call("batch_is_exist", ["kvoffload-heartbeat"])
            elif kind == "delete":
                self.store.call("batch_remove", self._all_names(item), True)
            elif kind == "reconcile":
                for start in range(0, len(item), BATCH):
                    self._exists(item[start : start + BATCH], None, "gone", None)
        recoveries = self.store.breaker.recoveries
        if recoveries != self._recoveries:
            self._recoveries = recoveries
            self._answers.put(Answer("resync", ()))

    def _all_names(self, keys: Sequence[bytes]) -> list[str]:
        return [name for ranks in self._ranks for name in object_names(ranks, keys)]

    def _exists(self, keys: Sequence[bytes], hit: str | None, miss: str, failed: str | None) -> None:
        self.probes_sent += len(keys)
        names = self._all_names(keys)
        codes = split_codes(self.store.call("batch_is_exist", names), len(names))
        verdicts: dict[str | None, list[bytes]] = {hit: [], miss: [], failed: []}
        n = len(keys)
        for i, key in enumerate(keys):
            ranks = codes[i::n]  # this key's answer for every rank's name: 1, 0 or an error
            kind = failed if any(c < 0 for c in ranks) else hit if all(c == 1 for c in ranks) else miss
            verdicts[kind].append(key)
        for kind, found in verdicts.items():
            if kind and found:
                self._answers.put(Answer(kind, tuple(found)))
