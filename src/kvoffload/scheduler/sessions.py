"""``SessionRegistry``: the scheduler's session controls (``scheduler.sessions``).

Engine-agnostic, on the manager's contract (``kvoffload.manager``: what each control does
to eviction; ``kvoffload.sessions``: the types). Called on the scheduler thread only: an
integration parses requests' fields into ``SessionDirectives`` (passed to ``match``) and
drains its control endpoint's commands into the methods below on that thread.

* ``retain(session, ttl_s, keys=None) -> RetainOutcome``: retain ``keys`` (default: the
  session's last keys, those of its latest finished request, head to tail) for ``ttl_s``
  seconds in every tier; an unknown session with no keys retains nothing.
* ``release(session) -> int``: end the session's retention in every tier (blocks released).
* ``prefetch(session=None, keys=None) -> int``: promote ``keys`` (default: the session's
  last keys) from the lower tiers into the CPU tier in the background, below every
  request's own promotions (promotions queued). Without a session, ``keys`` are taken as
  they are: an integration's own call with keys it derived from a request's tokens and
  salt; a control from outside names a session.
* ``inspect(session) -> list[RetainedBlock]``: what the session retains, per tier.
* ``known(session) -> bool``: whether its last keys are remembered.

Tenants: everything is keyed by ``SessionId`` (tenant, session), so a control never
reaches another tenant's session. Keys given with a session must be keys the registry
saw in a finished request of the same tenant: any other is refused (not retained, not
prefetched; a refused retention counts as ``absent``) and counted in
``tenant_refusals``, so a tenant cannot retain or prefetch blocks it did not produce.

Requests: at its arrival (first ``match``) a request whose directives name a session and
ask ``release`` releases it, then ``prefetch`` prefetches the session's last keys; when it
finishes (``on_request_finished``) its keys become the session's last keys and, with
``retain_s``, are retained for that long. The registry remembers at most
``max_sessions`` sessions; past that the least recently used is forgotten (its retention
runs out on its own). ``stats()`` counts what happened, for the metrics layer.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvoffload.counters import Counters
from kvoffload.keys import OffloadKey
from kvoffload.manager import OffloadingManager, RequestContext
from kvoffload.sessions import RetainedBlock, RetainOutcome, SessionId, positive_seconds
from kvoffload.validation import positive_int


@dataclass
class SessionStats(Counters):
    """Counts since creation. ``retained``/``trimmed``/``absent``: blocks, summed over
    tiers, of every retention (asked by a request or a control); ``expired``: retentions
    of a block in a tier that reached their deadline (read from the tiers)."""

    retains: int = 0
    retained: int = 0
    trimmed: int = 0
    absent: int = 0
    releases: int = 0
    released: int = 0
    prefetches: int = 0
    prefetched: int = 0
    expired: int = 0
    tenant_refusals: int = 0
    sessions_forgotten: int = 0


class SessionRegistry:
    """Session controls over ``manager`` (see the module docstring)."""

    def __init__(
        self,
        manager: OffloadingManager,
        *,
        max_sessions: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``clock``: the tiers' deadline clock (``time.monotonic`` unless a test gave the
        tiers another); ``max_sessions``: sessions whose last keys are remembered."""
        self.manager = manager
        self.max_sessions = positive_int("max_sessions", max_sessions)
        self.clock = clock
        self._last: dict[SessionId, tuple[OffloadKey, ...]] = {}  # least recently used first
        self._owners: dict[OffloadKey, dict[str, int]] = {}  # key -> tenant -> sessions holding it
        self._stats = SessionStats()

    # -- controls --------------------------------------------------------------------------

    def retain(
        self, session: SessionId, ttl_s: float, keys: Sequence[OffloadKey] | None = None
    ) -> RetainOutcome:
        _check_session(session)
        ttl_s = positive_seconds("ttl_s", ttl_s)
        chosen, refused = self._keys(session, keys)
        outcome = RetainOutcome(absent=refused)
        if chosen:
            outcome += self.manager.retain(session, chosen, self.clock() + ttl_s)
        stats = self._stats
        stats.retains += 1
        stats.retained += outcome.retained
        stats.trimmed += outcome.trimmed
        stats.absent += outcome.absent
        return outcome

    def release(self, session: SessionId) -> int:
        _check_session(session)
        released = self.manager.release(session)
        self._stats.releases += 1
        self._stats.released += released
        return released

    def prefetch(self, session: SessionId | None = None, keys: Sequence[OffloadKey] | None = None) -> int:
        if session is None:
            if keys is None:
                raise ValueError("prefetch needs a session or keys")
            chosen = list(keys)
        else:
            _check_session(session)
            chosen, _ = self._keys(session, keys)
        queued = self.manager.prefetch(chosen) if chosen else 0
        self._stats.prefetches += 1
        self._stats.prefetched += queued
        return queued

    def inspect(self, session: SessionId) -> list[RetainedBlock]:
        _check_session(session)
        return self.manager.retained(session)

    def known(self, session: SessionId) -> bool:
        return session in self._last

    def stats(self) -> SessionStats:
        tiers = [tier for tier in _tiers(self.manager) if hasattr(tier, "retention")]
        expired = sum(tier.retention.counts.expired for tier in tiers)
        return self._stats.snapshot(expired=expired)

    # -- the scheduler's hooks -------------------------------------------------------------

    def on_arrival(self, request: RequestContext) -> None:
        """A request's first match: its directives' ``release``, then ``prefetch``."""
        directives = request.directives
        if directives.session is None:
            return
        if directives.release:
            self.release(directives.session)
        if directives.prefetch and directives.session in self._last:
            self.prefetch(directives.session)

    def on_finished(self, request: RequestContext, keys: Sequence[OffloadKey]) -> None:
        """A request ended with ``keys`` (head to tail): its session's last keys; retained
        for its directives' ``retain_s``."""
        directives = request.directives
        session = directives.session
        if session is None:
            return
        if keys:
            self._remember(session, tuple(keys))
        if directives.retain_s is not None and keys:
            self.retain(session, directives.retain_s)

    # -- bookkeeping -----------------------------------------------------------------------

    def _keys(self, session: SessionId, keys: Sequence[OffloadKey] | None) -> tuple[list[OffloadKey], int]:
        """The keys a control of ``session`` may use and how many it named were refused."""
        if keys is None:
            last = self._last.pop(session, None)
            if last is None:
                return [], 0
            self._last[session] = last  # most recently used now
            return list(last), 0
        owners, tenant = self._owners, session.tenant
        chosen = [key for key in dict.fromkeys(keys) if tenant in owners.get(key, ())]
        refused = len(dict.fromkeys(keys)) - len(chosen)
        self._stats.tenant_refusals += refused
        return chosen, refused

    def _remember(self, session: SessionId, keys: tuple[OffloadKey, ...]) -> None:
        old = self._last.pop(session, None)
        if old is not None:
            self._disown(session.tenant, old)
        self._last[session] = keys
        owners, tenant = self._owners, session.tenant
        for key in dict.fromkeys(keys):
            tenants = owners.setdefault(key, {})
            tenants[tenant] = tenants.get(tenant, 0) + 1
        while len(self._last) > self.max_sessions:
            oldest = next(iter(self._last))
            self._disown(oldest.tenant, self._last.pop(oldest))
            self._stats.sessions_forgotten += 1

    def _disown(self, tenant: str, keys: tuple[OffloadKey, ...]) -> None:
        owners = self._owners
        for key in dict.fromkeys(keys):
            tenants = owners.get(key)
            if tenants is None or tenant not in tenants:
                continue
            tenants[tenant] -= 1
            if not tenants[tenant]:
                del tenants[tenant]
                if not tenants:
                    del owners[key]


def _check_session(session: object) -> None:
    if not isinstance(session, SessionId):
        raise TypeError(f"a session control needs a SessionId (tenant, session), got {session!r}")


def _tiers(manager: OffloadingManager) -> list:
    """The tiers under ``manager``: a stacked manager's every tier, else itself."""
    primary = getattr(manager, "primary", None)
    return [manager] if primary is None else [primary, *getattr(manager, "secondaries", ())]
