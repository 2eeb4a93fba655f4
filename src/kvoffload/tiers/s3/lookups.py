"""``S3Lookups``: the object tier's ``StoreLookups`` (``kvoffload.tiers.shared_store_lookups``:
requests, answers, batching, ranks), on its own thread.

S3 has no batched existence check: a batch of probes is one ``HEAD`` per name, made
``concurrency`` at a time on a small pool of this object's own (about half a millisecond
each over loopback). A name that answers 404 is absent; one that could not be asked
(the endpoint down, or a refusal: an identity without ``s3:ListBucket`` gets 403 for a
missing object) is ``failed``, a miss for a while. Deletions are S3's multi-object
``DeleteObjects``.

Reconciliation lists instead of asking name by name: one listing of each rank's folder
(``<prefix>/<namespace>/``, a thousand names per call) tells which indexed keys are gone.
A listing that fails leaves the index as it is until the next one.

S3 sends no notifications: what another writer or a lifecycle rule deleted is found by
reconciliation. Objects persist across a server restart, so the end of an outage asks
for a reconciliation at once (``resync``), not for the index to be dropped.

``lifetime_s``: an object last modified longer ago than that (by this host's clock) is
treated as absent and deleted when a probe or a reconciliation meets it, so the next
store writes it afresh (S3's own expiry, a bucket lifecycle rule, counts in whole days).

While the endpoint is down and nothing is asked, the thread calls it every
``HEARTBEAT_S`` seconds (as far as the breaker lets it), so its return is noticed
without traffic.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvoffload.tiers.s3.names import ObjectNames
from kvoffload.tiers.s3.store import MISSING, OK, ObjectStore
from kvoffload.tiers.shared_store_lookups import Answer, StoreLookups

HEARTBEAT_S = 0.5
_DELETE_BATCH = 1000  # names per DeleteObjects call (S3's most)


def expired(meta: Any, lifetime: float | None, now: float) -> bool:
    """Whether an object's metadata says it outlived ``lifetime`` seconds."""
    if lifetime is None:
        return False
    modified = meta.get("last_modified") if isinstance(meta, dict) else None
    return modified is not None and now - modified.timestamp() > lifetime


class S3Lookups(StoreLookups):
    idle_s = HEARTBEAT_S

    def __init__(
        self,
        store: ObjectStore,
        names: ObjectNames | Sequence[ObjectNames],
        *,
        concurrency: int = 8,
        lifetime: float | None = None,
    ) -> None:
        self.store = store
        self.lifetime = lifetime
        self.expired_found = 0  # objects past their lifetime this thread deleted
        self._recoveries = store.breaker.recoveries
        self._heads = ThreadPoolExecutor(concurrency, "kvoffload-s3-lookups")
        super().__init__(names, "kvoffload-s3-lookups")

    @property
    def down(self) -> bool:
        return self.store.down

    @property
    def outages(self) -> int:
        return self.store.breaker.outages

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread (bounded by ``timeout``); queued requests are dropped."""
        super().close(timeout)
        self._heads.shutdown(wait=False, cancel_futures=True)

    # -- calls ---------------------------------------------------------------------------

    def _serve(self, batch: list[tuple[str, Any]]) -> None:
        reconciles = [item for kind, item in batch if kind == "reconcile"]
        super()._serve([(kind, item) for kind, item in batch if kind != "reconcile"])
        for keys in reconciles:
            self._reconcile(keys)
        recoveries = self.store.breaker.recoveries
        if recoveries != self._recoveries:
            self._recoveries = recoveries
            self._answers.put(Answer("resync", ()))  # deletions may have happened meanwhile

    def _rank_names(self, ranks: ObjectNames, keys: Sequence[bytes]) -> list[str]:
        return ranks.names(keys)

    def _exist(self, names: list[str]) -> list[bool | None]:
        now = time.time()
        old: list[str] = []

        def one(name: str) -> bool | None:
            outcome, meta = self.store.head(name)
            if outcome == OK:
                if expired(meta, self.lifetime, now):
                    old.append(name)
                    return False
                return True
            return False if outcome == MISSING else None

        found = list(self._heads.map(one, names))
        self._drop_expired(old)
        return found

    def _remove(self, names: list[str]) -> None:
        for start in range(0, len(names), _DELETE_BATCH):
            self.store.delete(names[start : start + _DELETE_BATCH])

    def _drop_expired(self, names: list[str]) -> None:
        if names:
            self.expired_found += len(names)
            self._remove(names)

    def _reconcile(self, keys: Sequence[bytes]) -> None:
        """Post the keys whose object is missing (for any rank) as ``gone``."""
        self.probes_sent += len(keys)
        now = time.time()
        gone: set[bytes] = set()
        for ranks in self._ranks:
            outcome, listed = self.store.listing(ranks.folder)
            if outcome != OK:
                return  # unknown: the index stays until the next reconciliation
            present, old = set(), []
            for meta in listed:
                if expired(meta, self.lifetime, now):
                    old.append(meta["path"])
                else:
                    present.add(meta["path"])
            self._drop_expired(old)
            gone.update(key for key, name in zip(keys, ranks.names(keys)) if name not in present)
        if gone:
            self._answers.put(Answer("gone", tuple(key for key in keys if key in gone)))

    def _wants_heartbeat(self) -> bool:
        return self.store.down

    def _heartbeat(self) -> None:
        self.store.head(self._ranks[0].folder + "/kvoffload-heartbeat")
