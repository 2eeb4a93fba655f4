"""A request's session directives, read from what the engine carries with it.

Two ways in, both per request, both read once when the request arrives:

* **kv_hints actions** (vLLM's ``KvHintsEnvelope``: versioned actions, each with a type,
  a version and a JSON payload). kvoffload's own types are ``ACTIONS`` below, all at
  version ``ACTION_VERSION``; their payload keys are the schemas' (README's tables are
  generated from them). An action of another type or version is someone else's (or a
  newer kvoffload's): counted in ``unknown`` and ignored.
* **kv_transfer_params** (what vLLM's OpenAI server forwards from a request body today):
  the mapping under ``PARAMS_KEY`` (``{"kvoffload": {...}}``), keys in ``PARAMS``.
  vLLM's own keys (``do_remote_prefill``, ...) sit beside it and are never read here.

The session is the request's session id (vLLM's ``session_id``: body field, the
``X-Session-ID`` header or ``vllm_xargs``), else ``session_id`` under ``PARAMS_KEY``;
a different one there is a bad value. Its tenant is the request's ``cache_salt`` (``""``
without one), so a request can only name its own tenant's sessions.

A bad action or parameter (wrong type, out of range, unknown key, a tier no tier of this
engine has, a session control without a session) is logged once as a warning naming the
value, counted in ``invalid`` and has no effect; the request's other directives apply.
When both ways give the same directive, the kv_hints action wins.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvoffload.sessions import NO_DIRECTIVES, SessionDirectives, SessionId, TierChoice, positive_seconds
from kvoffload.settings import BOOL, Key, Kind, Schema

logger = logging.getLogger(__name__)

ACTION_VERSION = "1"
PARAMS_KEY = "kvoffload"


def _media(where: str, value: Any) -> frozenset[str] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(m, str) and m for m in value):
        raise ValueError(f'{where} must be a list of tier media such as ["CPU"], got {value!r}')
    return frozenset(m.upper() for m in value)


TTL = Kind("seconds > 0", parse=positive_seconds)
MEDIA = Kind('list of tier media (`"CPU"`, `"DISK"`, `"REMOTE"`, ...)', parse=_media)
SESSION = Kind("string", "be a non-empty string", lambda v: isinstance(v, str) and bool(v))

_LOAD_FROM = Key(
    "load_from",
    MEDIA,
    None,
    "tiers the request may load from; `[]`: none (recompute what the device lacks)",
    shown_default="every tier",
)
_STORE_TO = Key(
    "store_to",
    MEDIA,
    None,
    "tiers its blocks are stored to; `[]`: stored nowhere (a one-off prompt). A lower tier is reached "
    "through CPU, so naming one stores to CPU too",
    shown_default="every tier",
)


def _payload(*keys: Key) -> Schema:
    return Schema(keys, where="payload[{key!r}]", unknown="unknown payload key(s) {unknown}; known: {known}")


ACTIONS: dict[str, Schema] = {
    "kvoffload.retain": _payload(
        Key("ttl_s", TTL, None, "for how long, from when the request finishes", shown_default="required"),
    ),
    "kvoffload.release": _payload(),
    "kvoffload.prefetch": _payload(),
    "kvoffload.tiers": _payload(_LOAD_FROM, _STORE_TO),
}
ACTION_MEANINGS = {
    "kvoffload.retain": "when the request finishes, retain its blocks (now the session's latest) in every "
    "tier that holds them, past eviction and within each tier's retention budget",
    "kvoffload.release": "end the session's retention when the request arrives",
    "kvoffload.prefetch": "when the request arrives, promote the session's blocks held only in lower tiers "
    "into CPU, in the background and after every request's own promotions",
    "kvoffload.tiers": "the tiers this request loads from and stores to",
}

PARAMS = Schema(
    (
        Key(
            "session_id",
            SESSION,
            None,
            "the session, where the request's own `session_id` cannot be set",
            shown_default="the request's",
        ),
        Key("retain_s", TTL, None, "as `kvoffload.retain`'s `ttl_s`", shown_default="no retention"),
        Key("release", BOOL, False, "as `kvoffload.release`"),
        Key("prefetch", BOOL, False, "as `kvoffload.prefetch`"),
        _LOAD_FROM,
        _STORE_TO,
    ),
    where=f"kv_transfer_params[{PARAMS_KEY!r}][{{key!r}}]",
    unknown=f"unknown kv_transfer_params[{PARAMS_KEY!r}] key(s) {{unknown}}; known: {{known}}",
)

_NEEDS_SESSION = ("retain_s", "release", "prefetch")
_SESSION_SOURCES = (
    f"the request's session_id, the X-Session-ID header or kv_transfer_params[{PARAMS_KEY!r}]['session_id']"
)
_UNKNOWN: Any = object()  # an action that is not kvoffload's (or of a version it does not know)


@dataclass
class DirectiveCounts:
    """Actions and parameter sets read: ``applied``, ``unknown`` (not kvoffload's, or a
    version it does not know) and ``invalid`` (warned about, no effect)."""

    applied: int = 0
    unknown: int = 0
    invalid: int = 0


@dataclass(frozen=True)
class Reading:
    """One request's directives, with what was applied and what was not (action ids, and
    ``"kv_transfer_params"`` for the parameters)."""

    directives: SessionDirectives = NO_DIRECTIVES
    applied: tuple[str, ...] = ()
    unknown: tuple[str, ...] = ()
    invalid: tuple[str, ...] = ()

    def report(self) -> dict[str, Any]:
        """What a client is told back (JSON)."""
        d = self.directives
        out: dict[str, Any] = {"session_id": d.session.session if d.session else None}
        if d.retain_s is not None:
            out["retain_s"] = d.retain_s
        if d.release:
            out["release"] = True
        if d.prefetch:
            out["prefetch"] = True
        for name in ("load_from", "store_to"):
            media = getattr(d.tiers, name)
            if media is not None:
                out[name] = sorted(media)
        for name in ("applied", "unknown", "invalid"):
            if getattr(self, name):
                out[name] = list(getattr(self, name))
        return out


@dataclass
class DirectiveReader:
    """Reads requests' directives; ``media``: the tier media a tier choice may name
    (``None``: any)."""

    media: frozenset[str] | None = None
    counts: DirectiveCounts = field(default_factory=DirectiveCounts)

    def read(
        self,
        request_id: str,
        session_id: str | None,
        cache_salt: str | None,
        params: Mapping[str, Any] | None = None,
        actions: Iterable[Any] | None = None,
    ) -> Reading:
        """``actions``: objects with ``action_id``, ``action_type``, ``action_version`` and
        ``payload`` (vLLM's ``KvHintAction``)."""
        values: dict[str, Any] = {}
        applied, unknown, invalid = [], [], []
        ours = params.get(PARAMS_KEY) if params else None
        if ours is not None:
            got = self._params(request_id, ours, session_id)
            (invalid if got is None else applied).append("kv_transfer_params")
            values.update(got or {})
        session_id = session_id or values.pop("session_id", None)
        values.pop("session_id", None)
        for action in actions or ():
            action_id = getattr(action, "action_id", "?")
            got = self._action(request_id, action)
            if got is _UNKNOWN:
                unknown.append(action_id)
            elif got is None:
                invalid.append(action_id)
            else:
                applied.append(action_id)
                values.update(got)
        session = SessionId(cache_salt or "", session_id) if session_id else None
        if session is None:
            for name in _NEEDS_SESSION:
                if values.get(name):
                    values.pop(name)
                    self._warn(request_id, f"{name} needs a session id ({_SESSION_SOURCES})")
                    invalid.append(name)
        self.counts.applied += len(applied)
        self.counts.unknown += len(unknown)
        self.counts.invalid += len(invalid)
        if not values and session is None:
            return Reading(NO_DIRECTIVES, tuple(applied), tuple(unknown), tuple(invalid))
        tiers = TierChoice(values.get("load_from"), values.get("store_to"))
        directives = SessionDirectives(
            session, values.get("retain_s"), bool(values.get("release")), bool(values.get("prefetch")), tiers
        )
        return Reading(directives, tuple(applied), tuple(unknown), tuple(invalid))

    def _params(self, request_id: str, ours: Any, session_id: str | None) -> dict[str, Any] | None:
        if not isinstance(ours, Mapping):
            return self._warn(
                request_id, f"kv_transfer_params[{PARAMS_KEY!r}] must be a mapping, got {ours!r}"
            )
        try:
            values = PARAMS.parse(ours)
            self._check_media(values, f"kv_transfer_params[{PARAMS_KEY!r}]")
        except ValueError as exc:
            return self._warn(request_id, str(exc))
        named = values["session_id"]
        if named is not None and session_id is not None and named != session_id:
            return self._warn(
                request_id,
                f"kv_transfer_params[{PARAMS_KEY!r}]['session_id']={named!r} differs from the request's "
                f"session_id {session_id!r}",
            )
        return {k: v for k, v in values.items() if v is not None and v is not False}

    def _action(self, request_id: str, action: Any) -> Any:
        kind = getattr(action, "action_type", None)
        version = getattr(action, "action_version", None)
        schema = ACTIONS.get(kind) if isinstance(kind, str) else None
        if schema is None or version != ACTION_VERSION:
            return _UNKNOWN
        where = f"kv_hints action {getattr(action, 'action_id', '?')!r} ({kind} v{version})"
        payload = getattr(action, "payload", None)
        if not isinstance(payload, Mapping):
            return self._warn(request_id, f"{where}: payload must be a mapping, got {payload!r}")
        try:
            values = schema.parse(payload)
            self._check_media(values, f"{where}: payload")
        except ValueError as exc:
            return self._warn(request_id, f"{where}: {exc}")
        if kind == "kvoffload.retain":
            if values["ttl_s"] is None:
                return self._warn(request_id, f"{where}: payload['ttl_s'] is required")
            return {"retain_s": values["ttl_s"]}
        if kind == "kvoffload.tiers":
            return {k: v for k, v in values.items() if v is not None}
        return {kind.removeprefix("kvoffload."): True}

    def _check_media(self, values: dict[str, Any], where: str) -> None:
        if self.media is None:
            return
        for name in ("load_from", "store_to"):
            bad = sorted((values.get(name) or frozenset()) - self.media)
            if bad:
                raise ValueError(
                    f"{where}[{name!r}] names {bad}, not a tier here (tiers: {sorted(self.media)})"
                )

    def _warn(self, request_id: str, message: str) -> None:
        logger.warning("kvoffload: request %s: %s; ignored", request_id, message)
        return None
