"""The session controls, as JSON answers: what the HTTP endpoint asks of a scheduler's
session registry.

Every function runs where the registry may be called (``ControlQueue``: the scheduler
thread, or under its lock). A session is always named with its tenant: one tenant's
command never reaches another tenant's session, which is simply unknown to it (404, the
same answer as for a session that never existed). The registry is the scheduler's
(``kvoffload.scheduler.sessions.SessionRegistry``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvoffload.keys import OffloadKey
from kvoffload.sessions import SessionId

if TYPE_CHECKING:
    from kvoffload.scheduler.sessions import SessionRegistry


class ControlError(Exception):
    """A command refused: ``status`` is its HTTP status, the message says why."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _known(registry: SessionRegistry, session: SessionId) -> None:
    if not registry.known(session):
        raise ControlError(404, f"no session {session.session!r} of tenant {session.tenant!r}")


def _named(session: SessionId) -> dict[str, Any]:
    return {"session_id": session.session, "tenant": session.tenant}


def retain(registry: SessionRegistry, session: SessionId, ttl_s: float) -> dict[str, Any]:
    """Retain the session's last known blocks for ``ttl_s`` seconds from now."""
    _known(registry, session)
    outcome = registry.retain(session, ttl_s)
    return _named(session) | {
        "ttl_s": ttl_s,
        "retained": outcome.retained,
        "trimmed": outcome.trimmed,
        "absent": outcome.absent,
    }


def release(registry: SessionRegistry, session: SessionId) -> dict[str, Any]:
    _known(registry, session)
    return _named(session) | {"released": registry.release(session)}


def prefetch(registry: SessionRegistry, session: SessionId) -> dict[str, Any]:
    _known(registry, session)
    return _named(session) | {"prefetching": registry.prefetch(session)}


def prefetch_prefix(
    registry: SessionRegistry,
    keys_of: Callable[[str, list[int]], list[OffloadKey]],
    tenant: str,
    tokens: list[int],
) -> dict[str, Any]:
    """Prefetch the blocks of a token prefix of ``tenant`` (``keys_of(tenant, tokens)``:
    its keys as the engine computes them; a ``ValueError`` names what it cannot compute)."""
    try:
        keys = keys_of(tenant, tokens)
    except ValueError as exc:
        raise ControlError(400, str(exc)) from None
    return {"tenant": tenant, "blocks": len(keys), "prefetching": registry.prefetch(keys=keys)}


def inspect(registry: SessionRegistry, session: SessionId) -> dict[str, Any]:
    """What the session retains: per tier, how many blocks and when the first and the
    last of them expire (seconds from now)."""
    _known(registry, session)
    now = time.monotonic()
    tiers: dict[str, dict[str, Any]] = {}
    for block in registry.inspect(session):
        left = round(max(0.0, block.until - now), 3)
        tier = tiers.setdefault(block.medium, {"blocks": 0, "first_expiry_s": left, "last_expiry_s": left})
        tier["blocks"] += 1
        tier["first_expiry_s"] = min(tier["first_expiry_s"], left)
        tier["last_expiry_s"] = max(tier["last_expiry_s"], left)
    return _named(session) | {"blocks": sum(t["blocks"] for t in tiers.values()), "tiers": tiers}
