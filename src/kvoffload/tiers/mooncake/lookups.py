"""``MooncakeLookups``: the Mooncake tier's ``StoreLookups``
(``kvoffload.tiers.shared_store_lookups``: requests, answers, batching, ranks), on its own
thread.

Existence checks are ``batch_is_exist`` calls, deletions ``batch_remove``, through the
``MooncakeStore`` (its breaker): while the master is down (the client is not set up, the
breaker is open, or a call answered an outage code) probes are ``failed``.

Mooncake evicts in the background and loses every key when its master restarts; it sends
its clients no notifications, so ``gone`` answers come from reconciliations only. When the
master answers again after an outage the thread posts ``lost`` (a restarted master
starts empty: the manager drops its index). While the master is down and nothing is
asked, the thread checks it every ``HEARTBEAT_S`` seconds (as far as the breaker lets
it), so its return is noticed without traffic.

Deletions are forced (``force=True``): an existence check or a get grants a lease (10 s by
default) during which a plain remove fails, and the tier's own probes would keep its
blocks leased. A reader that loses an object under it reads a short or torn value, which
the block's checks turn into a counted miss.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvoffload.tiers.mooncake.names import object_names
from kvoffload.tiers.mooncake.store import MooncakeStore, StoreClosed, split_codes
from kvoffload.tiers.redis.format import KeyNames
from kvoffload.tiers.shared_store_lookups import Answer, StoreLookups

HEARTBEAT_S = 0.5


class MooncakeLookups(StoreLookups):
    idle_s = HEARTBEAT_S

    def __init__(self, store: MooncakeStore, names: KeyNames | Sequence[KeyNames]) -> None:
        self.store = store
        self._recoveries = store.breaker.recoveries
        super().__init__(names, "kvoffload-mooncake-lookups")

    @property
    def down(self) -> bool:
        return self.store.down

    @property
    def outages(self) -> int:
        return self.store.breaker.outages

    def close(self, timeout: float = 10.0) -> None:
        """Stop the thread (bounded by ``timeout``), then close the store; queued requests
        are dropped."""
        super().close(timeout)
        self.store.close()

    # -- calls ---------------------------------------------------------------------------

    def _serve(self, batch: list[tuple[str, Any]]) -> None:
        try:
            super()._serve(batch)
        except StoreClosed:
            self._stop.set()
            return
        recoveries = self.store.breaker.recoveries
        if recoveries != self._recoveries:
            self._recoveries = recoveries
            self._answers.put(Answer("lost", ()))  # a restarted master holds nothing

    def _rank_names(self, ranks: KeyNames, keys: Sequence[bytes]) -> list[str]:
        return object_names(ranks, keys)

    def _exist(self, names: list[str]) -> list[bool | None]:
        codes = split_codes(self.store.call("batch_is_exist", names), len(names))
        return [None if code < 0 else code == 1 for code in codes]  # 1, 0 or an error

    def _remove(self, names: list[str]) -> None:
        self.store.call("batch_remove", names, True)

    def _wants_heartbeat(self) -> bool:
        # idle while the master is down: one call now and then, so that the breaker
        # notices its return without waiting for the next lookup
        return self.store.breaker.is_open

    def _heartbeat(self) -> None:
        self.store.call("batch_is_exist", ["kvoffload-heartbeat"])
