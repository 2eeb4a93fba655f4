"""``StoreLookups``: the scheduler side's one window on a shared store, served by a
background thread (the base of the Redis and Mooncake tiers' lookups).

The scheduler thread never calls the store. It posts requests (``probe`` a key,
``delete`` keys, ``reconcile`` keys it believes present) with non-blocking queue puts; one
background thread serves everything queued at once, probes first, in batches of
``BATCH`` keys, and posts ``Answer``s that the scheduler thread collects with
``answers()`` (never blocks):

* ``present`` / ``absent``: the verdict of probed keys; ``failed``: keys whose probe could
  not be made (the store is down);
* ``gone``: keys the store no longer holds (a reconciliation found them missing, or the
  store said so);
* ``resync``: the store may have lost keys unseen (it came back after an outage): the
  manager should reconcile now;
* ``lost``: the store came back after an outage that may have emptied it (a Mooncake
  master restarts with no objects): nothing the manager indexed can be trusted.

With tensor parallelism each rank stores its share of a block under its own name
(``names``: one ``KeyNames`` per rank, or one): a key is ``present`` only when every
rank's name exists, ``gone`` when any rank's is missing, ``failed`` when any rank's could
not be asked; ``delete`` removes every rank's.

A subclass says how to ask its store: ``_rank_names`` (a rank's names of keys),
``_exist`` (per name: ``True``, ``False``, or ``None`` when it could not be asked),
``_remove``, ``down`` and ``outages``; optionally ``_serve`` (wrapping the base's), and
``idle_s`` with ``_wants_heartbeat``/``_heartbeat`` for a store to be checked while
nothing is asked. It sets its own attributes before calling ``__init__``, which starts
the thread.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

BATCH = 512  # keys per existence or removal call
_MOST = 16 * BATCH  # requests taken off the queue in one round


@dataclass(frozen=True)
class Answer:
    kind: str  # "present", "absent", "failed", "gone", "resync", "lost"
    keys: tuple[bytes, ...]


class StoreLookups:
    idle_s: float | None = None  # with a value: call _wants_heartbeat after this long idle

    def __init__(self, names: Any, thread_name: str) -> None:
        # one KeyNames, or a sequence of them (one per rank)
        self._ranks = tuple(names) if isinstance(names, Sequence) else (names,)
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._answers: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self.probes_sent = 0
        self._thread = threading.Thread(target=self._run, name=thread_name, daemon=True)
        self._thread.start()

    # -- what a subclass provides --------------------------------------------------------

    @property
    def down(self) -> bool:
        """Whether the store is known to be unavailable now (probes would fail)."""
        raise NotImplementedError

    @property
    def outages(self) -> int:
        """How many times the store became unavailable."""
        raise NotImplementedError

    def _rank_names(self, ranks: Any, keys: Sequence[bytes]) -> list:
        """One rank's store names of ``keys``, in key order."""
        raise NotImplementedError

    def _exist(self, names: list) -> list[bool | None]:
        """Per name: present, absent, or ``None`` when it could not be asked."""
        raise NotImplementedError

    def _remove(self, names: list) -> None:
        raise NotImplementedError

    def _wants_heartbeat(self) -> bool:
        """After ``idle_s`` without requests: whether to call ``_heartbeat`` now."""
        return False

    def _heartbeat(self) -> None:
        """One call to the store that asks nothing (so its breaker learns it is back)."""

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
        """Stop the thread (bounded by ``timeout``); queued requests are dropped."""
        self._stop.set()
        self._requests.put(("stop", None))
        self._thread.join(timeout)

    # -- background thread ---------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                batch = [self._requests.get(timeout=self.idle_s)]
            except queue.Empty:
                if not self._wants_heartbeat():
                    continue
                batch = [("heartbeat", None)]
            try:
                while len(batch) < _MOST:
                    batch.append(self._requests.get_nowait())
            except queue.Empty:
                pass
            if self._stop.is_set():
                return
            self._serve(batch)

    def _serve(self, batch: list[tuple[str, Any]]) -> None:
        """Serve one round of requests: every probe, then the rest in order."""
        probes = [item for kind, item in batch if kind == "probe"]
        for start in range(0, len(probes), BATCH):
            self._exists(probes[start : start + BATCH], "present", "absent", "failed")
        for kind, item in batch:
            if kind == "heartbeat":
                self._heartbeat()
            elif kind == "delete":
                self._remove(self._all_names(item))
            elif kind == "reconcile":
                for start in range(0, len(item), BATCH):
                    self._exists(item[start : start + BATCH], None, "gone", None)

    def _all_names(self, keys: Sequence[bytes]) -> list:
        """Every rank's names of ``keys``: rank-major, so key ``i``'s are ``[i::len(keys)]``."""
        return [name for ranks in self._ranks for name in self._rank_names(ranks, keys)]

    def _exists(self, keys: Sequence[bytes], hit: str | None, miss: str, failed: str | None) -> None:
        """Post the keys found on every rank as ``hit``, the rest as ``miss``, those with a
        rank that could not be asked as ``failed`` (a ``None`` kind is not posted)."""
        self.probes_sent += len(keys)
        found = self._exist(self._all_names(keys))
        verdicts: dict[str | None, list[bytes]] = {hit: [], miss: [], failed: []}
        n = len(keys)
        for i, key in enumerate(keys):
            ranks = found[i::n]  # this key's answer for every rank's name
            kind = failed if None in ranks else hit if all(ranks) else miss
            verdicts[kind].append(key)
        for kind, keys_of_kind in verdicts.items():
            if kind and keys_of_kind:
                self._answers.put(Answer(kind, tuple(keys_of_kind)))
