"""Session controls of the tiered manager: retention in every tier, prefetch below CPU.

* ``retain(session, keys, until)`` retains in every tier, the primary first; the outcome
  is the tiers' outcomes summed (a key held in two tiers counts in both; one held in only
  one counts ``absent`` in the others). ``release`` ends it in every tier (the blocks
  released, summed); ``retained`` lists every tier's, each with its medium.
* ``prefetch(keys)`` queues the promotion of the keys the primary does not hold and a
  secondary holds loadable now (how many it queued); the queue keeps the newest
  ``PREFETCH_QUEUE`` keys. They are promoted in the background, below every request:
  a step (``take_transfers``) issues prefetches only when no request's promotion was
  waiting in it, at most ``prefetch_batch`` keys, and only while fewer than
  ``prefetch_in_flight`` prefetch transfers are in flight. So a request's promotion is
  always issued the step it is asked for, with at most ``prefetch_in_flight`` prefetch
  transfers ahead of it at the worker, however many prefetches are queued. A prefetch
  that finds no room in the primary is dropped, never declined for requests.
  A promoted key counts as promoted (``load_source``) like a request's.
  ``prefetch_pending()`` says whether prefetches are queued or in flight: an engine that
  steps only for requests must keep stepping until it is false, or an idle engine's
  prefetch waits for the next request (and is then overtaken by its own promotion).
* Tier choice (``kvoffload.sessions.TierChoice``) of one request: ``lookup_within(key,
  load_from)`` is ``lookup`` asking for promotions only from the tiers in ``load_from``;
  ``limit_write_through(keys, media)`` just before ``complete_store(keys)`` writes those
  keys through only to the tiers in ``media``.

A mixin of ``TieredOffloadingManager``, over its tiers and its ``_promote``.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvoffload.keys import OffloadKey
from kvoffload.manager import LookupResult, TierTransfer
from kvoffload.sessions import RetainedBlock, RetainOutcome, SessionId
from kvoffload.validation import positive_int

PREFETCH_QUEUE = 65536  # queued prefetch keys kept, newest first


class TieredSessions:
    """``retain``, ``release``, ``retained`` and ``prefetch`` of the tiered manager."""

    def _init_prefetch(self, prefetch_in_flight: int, prefetch_batch: int) -> None:
        self.prefetch_in_flight = positive_int("prefetch_in_flight", prefetch_in_flight)
        self.prefetch_batch = positive_int("prefetch_batch", prefetch_batch)
        self._prefetch_queue: dict[OffloadKey, int] = {}  # key -> secondary holding it
        self._prefetching: set[int] = set()  # tokens of prefetch transfers in flight
        self.prefetched = 0  # keys whose prefetch promotion was issued
        self._write_limits: dict[OffloadKey, frozenset[str]] = {}  # for the next complete_store

    def retain(self, session: SessionId, keys: Sequence[OffloadKey], until: float) -> RetainOutcome:
        outcome = RetainOutcome()
        for tier in (self.primary, *self.secondaries):
            outcome += tier.retain(session, keys, until)
        return outcome

    def release(self, session: SessionId) -> int:
        return sum(tier.release(session) for tier in (self.primary, *self.secondaries))

    def retained(self, session: SessionId) -> list[RetainedBlock]:
        return [block for tier in (self.primary, *self.secondaries) for block in tier.retained(session)]

    def lookup_within(self, key: OffloadKey, load_from: frozenset[str]) -> LookupResult:
        """``lookup`` promoting only from the secondaries whose medium is in ``load_from``."""
        return self._lookup(key, load_from)

    def limit_write_through(self, keys: Sequence[OffloadKey], media: frozenset[str]) -> None:
        """The next ``complete_store`` writes ``keys`` through only to tiers in ``media``."""
        self._write_limits.update(dict.fromkeys(keys, media))

    def prefetch(self, keys: Sequence[OffloadKey]) -> int:
        queue, queued = self._prefetch_queue, 0
        for key in dict.fromkeys(keys):
            if key in queue or key in self._promoting or key in self._wanted:
                continue
            if self.primary.state(key) is not None:
                continue
            index = self._held_below(key)
            if index is not None:
                queue[key] = index
                queued += 1
        while len(queue) > PREFETCH_QUEUE:
            del queue[next(iter(queue))]
        return queued

    def prefetch_pending(self) -> bool:
        """Whether prefetches are queued or in flight (steps must run for them to finish)."""
        return bool(self._prefetch_queue or self._prefetching)

    def _held_below(self, key: OffloadKey) -> int | None:
        """The first secondary holding ``key`` loadable, without counting a lookup where
        the tier tells its state."""
        for index, tier in enumerate(self.secondaries):
            state = getattr(tier, "state", None)
            if state is None:
                held = tier.lookup(key) is LookupResult.HIT
            else:
                ref = state(key)
                held = ref is not None and ref >= 0
            if held:
                return index
        return None

    def _take_prefetches(self) -> list[TierTransfer]:
        """The prefetch promotions this step may issue (called after the requests')."""
        room = self.prefetch_in_flight - len(self._prefetching)
        queue = self._prefetch_queue
        if room <= 0 or not queue:
            return []
        by_tier: dict[int, list[OffloadKey]] = {}
        for key in list(queue)[: self.prefetch_batch]:
            by_tier.setdefault(queue.pop(key), []).append(key)
        transfers = []
        for index, tier_keys in by_tier.items():
            if len(transfers) == room:  # no room this step: queued again
                queue.update(dict.fromkeys(tier_keys, index))
                continue
            tier_keys = [key for key in tier_keys if key not in self._promoting]
            transfer = self._promote(index, tier_keys, decline=False) if tier_keys else None
            if transfer is not None:
                self._prefetching.add(transfer.token)
                self.prefetched += len(self._transfers[transfer.token].keys)
                transfers.append(transfer)
        return transfers
