"""The index service: a ``BlockIndex`` and the event sources that feed it, by registration.

Contract:

* ``register(Registration)`` validates it (errors are ``ValueError`` naming the field and
  value), adds the engine (instance id, DP rank) to its (model, tenant) space and starts
  an ``EventSource`` on its endpoints. A second registration of the same engine, or one
  whose block size differs from its space's, raises ``RegistrationConflict``.
* ``unregister(instance_id, model_name, tenant_id=None, dp_rank=None)`` stops and removes
  the matching sources (every tenant when ``tenant_id`` is ``None``, every rank when
  ``dp_rank`` is ``None``) and their entries; ``LookupError`` if none matches. Returns the
  removed sources.
* ``close()`` stops every source. Safe to call from any thread; the sources' threads are
  the only ones touching their sockets.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import zmq

from kvoffload.events import endpoints
from kvoffload.index.core import BlockIndex
from kvoffload.index.source import EventSource
from kvoffload.validation import non_negative_int, positive_int

DEFAULT_TENANT = "default"


class RegistrationConflict(ValueError):
    """The engine is registered already, or its block size differs from its model's."""


@dataclass(frozen=True)
class Registration:
    instance_id: int | str
    endpoint: str
    model_name: str
    block_size: int
    tenant_id: str = DEFAULT_TENANT
    dp_rank: int = 0
    replay_endpoint: str | None = None
    topic: str = ""

    def __post_init__(self) -> None:
        check_instance_id(self.instance_id)
        for name in ("endpoint", "model_name", "tenant_id"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name} must be a non-empty string, got {value!r}")
        positive_int("block_size", self.block_size)
        non_negative_int("dp_rank", self.dp_rank)
        if not isinstance(self.topic, str):
            raise ValueError(f"topic must be a string, got {self.topic!r}")
        _check_endpoint("endpoint", self.endpoint)
        if self.replay_endpoint is not None:
            if not isinstance(self.replay_endpoint, str) or not self.replay_endpoint:
                raise ValueError(f"replay_endpoint must be a non-empty string, got {self.replay_endpoint!r}")
            _check_endpoint("replay_endpoint", self.replay_endpoint)


def check_instance_id(value: object) -> int | str:
    if isinstance(value, bool) or not isinstance(value, (int, str)) or value == "":
        raise ValueError(f"instance_id must be an integer or a non-empty string, got {value!r}")
    return value  # type: ignore[return-value]


def _check_endpoint(name: str, value: str) -> None:
    try:
        endpoints.normalize(value)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None


class IndexService:
    """Registrations in, running sources and one shared index (see module doc)."""

    def __init__(
        self,
        index: BlockIndex | None = None,
        *,
        replay_timeout: float = 2.0,
        idle_catch_up: float = 1.0,
        context: zmq.Context | None = None,
    ) -> None:
        if not isinstance(replay_timeout, (int, float)) or replay_timeout <= 0:
            raise ValueError(f"replay_timeout must be a positive number of seconds, got {replay_timeout!r}")
        self.index = index or BlockIndex()
        self._replay_timeout = float(replay_timeout)
        self._idle_catch_up = idle_catch_up
        self._context = context
        self._lock = threading.Lock()
        self._sources: dict[tuple[str, str, int | str, int], tuple[Registration, EventSource]] = {}

    def register(self, reg: Registration) -> EventSource:
        with self._lock:
            key = (reg.model_name, reg.tenant_id, reg.instance_id, reg.dp_rank)
            if key in self._sources:
                raise RegistrationConflict(
                    f"instance {reg.instance_id!r} dp_rank {reg.dp_rank} is already registered "
                    f"for model {reg.model_name!r} of tenant {reg.tenant_id!r}"
                )
            try:
                engine = self.index.add_engine(
                    reg.model_name, reg.tenant_id, reg.instance_id, reg.dp_rank, reg.block_size
                )
            except ValueError as exc:
                raise RegistrationConflict(str(exc)) from None
            try:
                source = EventSource(
                    self.index,
                    engine,
                    reg.endpoint,
                    reg.replay_endpoint,
                    reg.topic,
                    replay_timeout=self._replay_timeout,
                    idle_catch_up=self._idle_catch_up,
                    context=self._context,
                )
            except Exception:
                self.index.remove_engine(engine)
                raise
            self._sources[key] = (reg, source)
        return source.start()

    def unregister(
        self,
        instance_id: int | str,
        model_name: str,
        tenant_id: str | None = None,
        dp_rank: int | None = None,
    ) -> list[tuple[Registration, EventSource]]:
        with self._lock:
            keys = [
                key
                for key in self._sources
                if key[0] == model_name
                and key[2] == instance_id
                and (tenant_id is None or key[1] == tenant_id)
                and (dp_rank is None or key[3] == dp_rank)
            ]
            if not keys:
                what = f"instance {instance_id!r} of model {model_name!r}"
                if tenant_id is not None:
                    what += f" tenant {tenant_id!r}"
                if dp_rank is not None:
                    what += f" dp_rank {dp_rank}"
                raise LookupError(f"{what} is not registered")
            removed = [self._sources.pop(key) for key in keys]
        for _, source in removed:
            source.stop()
            self.index.remove_engine(source.engine)
        return removed

    def sources(self) -> list[tuple[Registration, EventSource]]:
        with self._lock:
            return list(self._sources.values())

    def close(self) -> None:
        with self._lock:
            removed = list(self._sources.values())
            self._sources.clear()
        for _, source in removed:
            source.stop()
            self.index.remove_engine(source.engine)

    def __enter__(self) -> IndexService:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
