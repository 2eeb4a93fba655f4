"""Session controls: what an application tells the cache that the cache cannot infer.

Engine-agnostic types shared by the tiers (``kvoffload.manager``'s session methods), the
scheduler and the ways in (vLLM's ``kv_hints`` and ``kv_transfer_params``, the HTTP
control endpoint). Every control names a ``SessionId``; none is a guarantee that can
starve the cache: each has a budget, an expiry and a tenant.

* **Tenant.** A session id is scoped by its tenant (the request's ``cache_salt``; ``""``
  when it has none). Two tenants' sessions of the same name are different sessions: a
  control of one never retains, releases, prefetches or inspects the other's blocks.
* **Retain** (``OffloadingManager.retain``): the blocks of a session a tier holds are kept
  past eviction until a deadline (``time.monotonic()`` seconds) or a release. They stay in
  the policy's order and eviction passes over them; when retention ends they are evicted
  in the order the policy kept meanwhile. Per tier, retained blocks never exceed its
  retention budget (a fraction of its capacity): keys beyond it are trimmed, tail first
  (a prefix's head serves every longer prefix), and counted, never an error.
* **Release**: a session's retention ends now, in every tier.
* **Prefetch**: a session's (or a token prefix's) blocks held only in lower tiers are
  promoted into the primary tier without a request, after every running request's own
  promotions and loads.
* **Tier choice** (``TierChoice``, per request): the tiers a request may load from and
  the tiers its blocks are stored to (none: a one-off prompt is stored nowhere).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from kvoffload.keys import OffloadKey


def positive_seconds(name: str, value: object) -> float:
    """``value`` as a time to live: ``ValueError`` naming ``name`` unless a finite number > 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    return float(value)


@dataclass(frozen=True, order=True)
class SessionId:
    """A session of one tenant. ``tenant`` is the requests' ``cache_salt`` ("" for none)."""

    tenant: str
    session: str

    def __post_init__(self) -> None:
        if not isinstance(self.tenant, str):
            raise TypeError(f"session tenant must be a string, got {self.tenant!r}")
        if not isinstance(self.session, str) or not self.session:
            raise ValueError(f"session id must be a non-empty string, got {self.session!r}")


@dataclass(frozen=True)
class RetainOutcome:
    """What one ``retain`` call did in one tier: ``retained`` keys are now held for the
    session (a key it already retained counts again, with its deadline moved), ``trimmed``
    were held but over the retention budget, ``absent`` were not held by the tier."""

    retained: int = 0
    trimmed: int = 0
    absent: int = 0

    def __add__(self, other: RetainOutcome) -> RetainOutcome:
        return RetainOutcome(
            self.retained + other.retained, self.trimmed + other.trimmed, self.absent + other.absent
        )


@dataclass(frozen=True)
class RetainedBlock:
    """One retained block as ``inspect`` reports it: in ``medium`` until ``until``
    (``time.monotonic()`` seconds)."""

    key: OffloadKey
    medium: str
    until: float


@dataclass(frozen=True)
class TierChoice:
    """The tiers one request uses, by medium name (``"CPU"``, the secondary tiers' media).

    ``load_from``: the tiers it may load from (``None``: every tier). ``store_to``: the
    tiers its blocks are stored to (``None``: every tier; empty: stored nowhere). A lower
    tier is reached only through the primary (CPU) tier, so storing to a lower tier
    stores to CPU as well, and loading from one goes through CPU."""

    load_from: frozenset[str] | None = None
    store_to: frozenset[str] | None = None

    @staticmethod
    def of(load_from: Iterable[str] | None = None, store_to: Iterable[str] | None = None) -> TierChoice:
        def media(names: Iterable[str] | None, what: str) -> frozenset[str] | None:
            if names is None:
                return None
            if isinstance(names, str):
                raise TypeError(f"{what} must be a list of tier media, got the string {names!r}")
            return frozenset(str(name).upper() for name in names)

        return TierChoice(media(load_from, "load_from"), media(store_to, "store_to"))

    @property
    def stores_nowhere(self) -> bool:
        return self.store_to is not None and not self.store_to

    def may_load_from(self, medium: str) -> bool:
        return self.load_from is None or medium in self.load_from

    def stores_to(self, medium: str) -> bool:
        return self.store_to is None or medium in self.store_to


EVERY_TIER = TierChoice()


@dataclass(frozen=True)
class SessionDirectives:
    """What one request asks of the cache about itself (parsed from the engine's request
    fields by an integration): its ``session`` (``None`` for none); ``retain_s``: retain
    its blocks for this many seconds once it finishes (``None``: no retention asked);
    ``release``: end the session's retention when it arrives (its own blocks may then be
    retained again by ``retain_s``); ``prefetch``: promote the session's blocks when it
    arrives; ``tiers``: its tier choice."""

    session: SessionId | None = None
    retain_s: float | None = None
    release: bool = False
    prefetch: bool = False
    tiers: TierChoice = EVERY_TIER

    def __post_init__(self) -> None:
        if self.session is not None and not isinstance(self.session, SessionId):
            raise TypeError(f"directives' session must be a SessionId, got {self.session!r}")
        if self.retain_s is not None:
            positive_seconds("retain_s", self.retain_s)


NO_DIRECTIVES = SessionDirectives()
