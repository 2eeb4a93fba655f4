"""The scheduler-side contract of one offloading tier.

An ``OffloadingManager`` keeps the bookkeeping of one medium (host memory, disk, a remote
store): which keys are loadable, which are being written, which are pinned by loads, and
what to evict. It never moves bytes and never blocks; the worker side does the copies
described by the ``LoadStoreSpec`` objects it hands out.

Block state is one integer per key: ``-1`` being written (neither loadable nor
evictable), ``0`` idle (evictable), ``n > 0`` pinned by ``n`` loads.

Transfers between tiers: a manager that stacks tiers (``kvoffload.tiers.tiered``) also
moves blocks between them in the background (write-through, promotion). It hands those
copies out through ``take_transfers`` (each a ``TierTransfer``: a spec pair and a token);
the scheduler gives them job ids, the worker runs them, and ``complete_transfer(token,
success)`` reports each back. A single tier has none.

Events: an ``OffloadingEvent`` says which keys became loadable (``removed=False``) or were
dropped (``removed=True``) in one medium. It carries no block size: block size belongs to
a KV-cache group, and the scheduler, which knows each key's group, fills it in when it
converts events to the wire format.

Request lifecycle: the scheduler announces each request it serves with
``on_new_request(request)`` and ends it with ``on_request_finished(request, key_groups,
inserted, reused)`` (both no-ops by default; the CPU tier passes them to its policy, a
stacked manager to every tier). What a manager or policy may rely on:

* ``on_new_request`` fires once, when the scheduler first sees the request (its first
  ``match``), before any other call made for it, and is followed at once by its touch (one
  ``touch`` per KV-cache group, its only one), then its lookups; its loads and stores come
  later. Those calls carry no request, and other requests' calls interleave with them.
* ``on_request_finished`` fires exactly once per announced request, when the scheduler
  forgets it: the engine finished or aborted it (the same path) and none of its loads or
  stores is in flight any more (each completed, failed, or cancelled before it was sent).
  After it nothing is done for that request. Transfers between tiers are never for a
  request and may still follow.
* Not an end: preemption (the request keeps its context; when it resumes it may be matched
  and loaded again, which adds to ``reused``) and a failed load (the engine recomputes
  those tokens; the failed keys are not ``reused``).
* ``reset``: the scheduler first finishes every request it tracks (with what it knew so
  far), then resets the manager, then announces the requests still running again (no
  touch follows these), whose ``inserted`` and ``reused`` start empty. No reset ever falls
  between a request's two hooks.
* ``key_groups[g]``: the request's keys of KV-cache group ``g``, head to tail: key ``j``
  is its ``j``-th offloaded block, ending at token ``(j + 1) * request.group_tokens[g]``;
  every whole block of the tokens it computed (prompt and generated) or loaded, held or
  not (``prefix_order`` merges the groups by token position). ``inserted``: keys its stores
  made loadable. ``reused``: keys loaded for it from the tier (completed loads), less the
  ones it inserted itself. Both are subsets of ``key_groups``' keys; any of them may have
  been evicted since. Hooks must ignore keys the tier does not hold.

Session controls (``kvoffload.sessions`` defines them; every tier honours them, a stacked
manager passes each to every tier): ``retain(session, keys, until)`` keeps the held ones
among ``keys`` past eviction until ``until`` (``time.monotonic()`` seconds) or
``release(session)``; eviction passes over a retained block as over a pinned one (it
stays idle in ``stats``: loadable, not in use) and, once no session retains it, takes it
in the policy's order. A tier retains at most its retention budget; keys beyond it are
trimmed (tail first) and counted in the ``RetainOutcome``. ``retained(session)`` lists
what a session holds and until when. Retention moves nothing in the policy's order and
never pins: a retained block can be loaded, and is dropped like any other when it is
found corrupt, when its store fails, or at ``reset``. ``prefetch(keys)`` (a stacked
manager) promotes keys held only below the primary tier, after every request's own
promotions and never more than a few at a time. A tier without them retains nothing (the
defaults). A request's tier choice is the scheduler's to apply: a lookup that may not
promote, a store it does not make, a write-through it limits.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence, Set
from dataclasses import dataclass, field
from typing import Any

from kvoffload.keys import OffloadKey
from kvoffload.sessions import NO_DIRECTIVES, RetainedBlock, RetainOutcome, SessionDirectives, SessionId
from kvoffload.specs import LoadStoreSpec  # re-exported: part of the contract


class LookupResult(enum.Enum):
    """Answer of ``OffloadingManager.lookup`` for one key."""

    HIT = "hit"  # loadable now
    PENDING = "pending"  # a store of this key is in flight
    MISS = "miss"  # not held
    RETRY = "retry"  # cannot tell yet; ask again next step


@dataclass(frozen=True, eq=False)
class RequestContext:
    """One request as the scheduler announces it to the tiers.

    ``hints``: what the engine passed with the request for offloading (vLLM's
    ``kv_transfer_params``), unchanged, empty when none; read them, never change them.
    ``group_tokens[g]``: the tokens one offloaded block of KV-cache group ``g`` spans (the
    scheduler fills it in), which places the keys of ``on_request_finished``'s
    ``key_groups``. ``directives``: what the request asks of the cache about itself
    (``kvoffload.sessions``: its session, retention, release, prefetch, tier choice), as
    an integration parsed it; ``NO_DIRECTIVES`` when none.
    """

    request_id: str
    hints: Mapping[str, Any] = field(default_factory=dict)
    group_tokens: tuple[int, ...] = ()
    directives: SessionDirectives = NO_DIRECTIVES


def prefix_order(request: RequestContext, key_groups: Sequence[Sequence[OffloadKey]]) -> list[OffloadKey]:
    """The keys of all groups head to tail: by the token each block ends at, a lower group
    first on a tie. A group of unknown size counts its ``j``-th key as ending at ``j + 1``."""
    if len(key_groups) == 1:
        return list(key_groups[0])
    sizes = request.group_tokens
    ends = []
    for g, keys in enumerate(key_groups):
        tokens = sizes[g] if g < len(sizes) else 1
        ends += [((j + 1) * tokens, g, j) for j in range(len(keys))]
    ends.sort()
    return [key_groups[g][j] for _, g, j in ends]


@dataclass(frozen=True)
class PrepareStoreOutput:
    """What ``prepare_store`` reserved.

    ``keys_to_store`` are the keys the caller must now write, in call order, into the
    slots of ``store_spec`` (same order); ``evicted_keys`` were dropped to make room.
    """

    keys_to_store: list[OffloadKey]
    store_spec: LoadStoreSpec
    evicted_keys: list[OffloadKey]


@dataclass(frozen=True)
class OffloadingEvent:
    """Keys that became loadable (``removed=False``) or were dropped in ``medium``."""

    keys: list[OffloadKey]
    medium: str
    removed: bool


@dataclass(frozen=True)
class TierTransfer:
    """A copy between two tiers that the manager needs done; ``token`` names it back."""

    token: int
    src_spec: LoadStoreSpec
    dst_spec: LoadStoreSpec


@dataclass(frozen=True)
class TierStats:
    """A snapshot of one tier. Counters (hits, misses, evictions) count since creation.

    ``used`` blocks are resident: ``in_flight`` (being written) + ``pinned`` (read by
    loads) + ``idle`` (loadable and evictable). ``in_use`` = in flight + pinned: the blocks
    no eviction can take now (vLLM's cache-usage gauge counts these).
    """

    medium: str
    capacity: int
    used: int
    in_flight: int
    pinned: int
    hits: int
    misses: int
    evictions: int

    @property
    def in_use(self) -> int:
        return self.in_flight + self.pinned

    @property
    def idle(self) -> int:
        return self.used - self.in_flight - self.pinned

    @property
    def usage(self) -> float:
        """``in_use`` as a fraction of ``capacity`` (0 for an empty tier)."""
        return self.in_use / self.capacity if self.capacity else 0.0


class OffloadingManager(ABC):
    """Bookkeeping of one offloading tier. Single-threaded; never blocks."""

    medium: str = ""

    @abstractmethod
    def lookup(self, key: OffloadKey) -> LookupResult:
        """Whether ``key`` is loadable now. Never changes recency."""

    def lookup_prefix(self, keys: Iterable[OffloadKey]) -> int:
        """How many leading keys are ``HIT``s."""
        count = 0
        for key in keys:
            if self.lookup(key) is not LookupResult.HIT:
                break
            count += 1
        return count

    @abstractmethod
    def prepare_load(self, keys: Sequence[OffloadKey]) -> LoadStoreSpec:
        """Pin every key (each must be a ``HIT``) and say where they are, in key order.

        A key named twice is pinned twice. Raises ``KeyError`` naming the first key that is
        not a ``HIT``; nothing is pinned then.
        """

    @abstractmethod
    def touch(self, keys: Sequence[OffloadKey]) -> None:
        """Record a use of ``keys`` (absent keys are allowed) for the eviction policy."""

    @abstractmethod
    def complete_load(self, keys: Sequence[OffloadKey]) -> None:
        """Unpin keys pinned by ``prepare_load``. Raises if a key is not pinned."""

    @abstractmethod
    def prepare_store(self, keys: Sequence[OffloadKey]) -> PrepareStoreOutput | None:
        """Reserve slots for the keys not yet present (ready or in flight).

        Evicts idle blocks if needed, never one named in ``keys``. Atomic: returns ``None``
        and changes nothing when room cannot be made.
        """

    @abstractmethod
    def complete_store(self, keys: Sequence[OffloadKey], success: bool = True) -> None:
        """Finish stores: success makes in-flight keys loadable (one event); failure frees
        them silently. Keys not in flight are ignored."""

    @abstractmethod
    def take_events(self) -> list[OffloadingEvent]:
        """Drain the queued events, oldest first."""

    @abstractmethod
    def reset(self) -> None:
        """Drop every block."""

    @abstractmethod
    def stats(self) -> TierStats:
        """A snapshot of occupancy and counters."""

    def discard(self, keys: Sequence[OffloadKey]) -> None:
        """Drop the idle ones among ``keys`` (found unreadable or corrupt by a read that
        failed and was completed): they become misses and one ``removed=True`` event lists
        them. Keys still being written or pinned by other reads stay; absent keys are
        ignored."""
        raise NotImplementedError(f"{type(self).__name__} cannot discard blocks")

    def take_transfers(self) -> list[TierTransfer]:
        """Copies between tiers to start now (none for a single tier)."""
        return []

    def complete_transfer(self, token: int, success: bool) -> None:
        """The outcome of a ``TierTransfer``; unknown tokens raise ``KeyError``."""
        raise KeyError(f"unknown tier transfer {token}")

    def load_source(self, key: OffloadKey) -> str:
        """The medium whose copy of ``key`` (a ``HIT`` about to be loaded) was found for
        this load: a block promoted from a lower tier for it names that tier's medium.
        For metrics only (vLLM's cached-tokens-by-source); the default is this tier's."""
        return self.medium

    def on_new_request(self, request: RequestContext) -> None:
        """A request starts (see the module docstring for when); the default does nothing."""

    def on_request_finished(
        self,
        request: RequestContext,
        key_groups: Sequence[Sequence[OffloadKey]],
        inserted: Set[OffloadKey],
        reused: Set[OffloadKey],
    ) -> None:
        """A request announced by ``on_new_request`` ended (see the module docstring for
        when, and for what the arguments hold); the default does nothing."""

    def retain(self, session: SessionId, keys: Sequence[OffloadKey], until: float) -> RetainOutcome:
        """Retain the held ones among ``keys`` (head to tail) for ``session`` until ``until``
        (see the module docstring); the default retains nothing."""
        return RetainOutcome(absent=len(keys))

    def release(self, session: SessionId) -> int:
        """End ``session``'s retention now; how many blocks it retained here."""
        return 0

    def retained(self, session: SessionId) -> list[RetainedBlock]:
        """The blocks ``session`` retains in this tier (expired ones excluded)."""
        return []

    def prefetch(self, keys: Sequence[OffloadKey]) -> int:
        """Promote the keys held only below the primary tier into it, in the background and
        after every request's own promotions; how many promotions were queued. The default
        (a single tier) has nothing below it."""
        return 0

    def close(self) -> None:
        """Release resources held by the tier."""
