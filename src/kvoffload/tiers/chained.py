"""Loads chained on promotions: a lower-tier hit served with one scheduler round trip.

Without chaining, a prefix found below the CPU tier takes two: a step plans the promotion,
its outcome comes back, and a later step plans the load from the CPU tier. With it, the
step whose lookups asked for promotions also plans the load that reads what they fill:

* ``promote_now(keys)`` plans at once (not at the next ``take_transfers``) the promotions
  the lookups of ``keys`` asked for; the same step's ``take_transfers`` hands them out.
* ``chain_prefix(keys)`` says how many leading keys a load can be planned on (each
  loadable in the primary, or being promoted into it) and whether the key after them is
  one to wait for rather than a miss.
* ``prepare_chained_load(keys)`` plans the load: it pins the loadable keys and returns
  the spec (every key's primary slot) with the keys still being written, by the token of
  their promotion. Those are held by their state (being written: nothing evicts them);
  once ``complete_transfer`` made them loadable the caller pins them (``prepare_load``)
  for its load in the same call, before anything else can evict them. A failed
  promotion frees its slots and the keys are never pinned.

The worker starts the load when the promotion succeeded and fails it unrun when it did
not (``kvoffload.worker.WorkerRouter``): nothing is loaded before its bytes arrived.
A mixin of ``TieredOffloadingManager``, over its tables.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvoffload.keys import OffloadKey
from kvoffload.manager import LookupResult
from kvoffload.specs import CPULoadStoreSpec, LoadStoreSpec

_MISS = LookupResult.MISS


class ChainedLoads:
    """``promote_now``, ``chain_prefix`` and ``prepare_chained_load`` of the tiered
    manager (``_wanted``: key -> tier asked; ``_promoting``: key -> token of the promotion
    writing it; ``_planned``: promotions planned by ``promote_now``)."""

    def promote_now(self, keys: Sequence[OffloadKey]) -> None:
        """Plan now, not at the next ``take_transfers``, the promotions that lookups of
        ``keys`` asked for (the next ``take_transfers`` hands them out)."""
        by_tier: dict[int, list[OffloadKey]] = {}
        wanted = self._wanted
        for key in keys:
            index = wanted.pop(key, None)
            if index is not None:
                by_tier.setdefault(index, []).append(key)
        for index, tier_keys in by_tier.items():
            transfer = self._promote(index, tier_keys)
            if transfer is not None:
                self._planned.append(transfer)

    def chain_prefix(self, keys: Sequence[OffloadKey]) -> tuple[int, bool]:
        """How many leading ``keys`` a load can be planned on now (each loadable in the
        primary or being promoted into it), and whether the key after them is one to wait
        for (a store into the primary in flight, a tier that cannot tell yet, a promotion
        not planned yet) rather than a miss."""
        table, promoting = self.primary.block_table, self._promoting
        for count, key in enumerate(keys):
            status = table.get(key)
            if (status is not None and status.ref >= 0) or key in promoting:
                continue
            return count, self.lookup(key) is not _MISS
        return len(keys), False

    def prepare_chained_load(
        self, keys: Sequence[OffloadKey]
    ) -> tuple[LoadStoreSpec, dict[int, list[OffloadKey]]]:
        """``prepare_load`` of keys each loadable or being promoted (``chain_prefix``):
        the loadable ones are pinned; the spec names every key's primary slot, in key
        order; the keys being promoted are returned by the token of their promotion, for
        the caller to pin (``prepare_load``) when ``complete_transfer`` made them loadable
        (they are not, and never pinned, if it failed)."""
        promoting = self._promoting
        if not promoting:
            return self.primary.prepare_load(keys), {}
        waiting: dict[int, list[OffloadKey]] = {}
        ready = []
        for key in keys:
            token = promoting.get(key)
            if token is None:
                ready.append(key)
            else:
                waiting.setdefault(token, []).append(key)
        if not waiting:
            return self.primary.prepare_load(keys), {}
        self.primary.prepare_load(ready)  # KeyError for a key neither loadable nor promoted
        table = self.primary.block_table
        return CPULoadStoreSpec([table[key].slot for key in keys]), waiting

    def _chained_source(self, key: OffloadKey) -> int:
        """The tier a key still being promoted comes from (a chained load's source)."""
        self._sourced.add(key)
        return self._transfers[self._promoting[key]].tier

    def _promoted(self, keys: list[OffloadKey]) -> list[OffloadKey]:
        """Forget that ``keys`` are being promoted; those whose source no chained load
        said yet (they stay known as promoted until their first load)."""
        promoting, sourced = self._promoting, self._sourced
        for key in keys:
            promoting.pop(key, None)
        if not sourced:
            return keys
        unsaid = [key for key in keys if key not in sourced]
        sourced.difference_update(keys)
        return unsaid
