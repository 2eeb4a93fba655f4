"""``type: "redis"`` in ``secondary_tiers``: a Redis/Valkey server shared by engine replicas.

The keys of its entry are declared once, in ``REDIS_KEYS`` (kind of value, default,
meaning; README's shared-tier table is generated from it by ``scripts/config_tables.py``);
errors name the key and the value, and a URL is shown without its password.

Start-up: parsing checks values only; building the tier reads the password and its
manager pings the server. Configuration errors (bad URL, unset ``password_env``, named)
fail the engine start; a server that cannot be reached is not an error: the tier starts
degraded (logged once), answers misses, and serves once the server answers. The shared
cache is an optimisation, so its outage must not stop an engine from serving.
Credentials the server rejects are a configuration error and fail the start.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kvoffload.settings import BOOL, POSITIVE_INT, POSITIVE_SECONDS, REQUIRED, Key, Schema, custom, text
from kvoffload.tiers.redis.calls import NodeCalls
from kvoffload.tiers.redis.client import ServerSettings, check_url, connect, redact
from kvoffload.tiers.redis.format import KeyNames
from kvoffload.tiers.secondary import TierContext
from kvoffload.tiers.shared_store_tier import MAX_INDEX_BLOCKS, NAME, PROBE_TIMEOUT, SharedStoreTierType
from kvoffload.worker import OffloadingWorker

if TYPE_CHECKING:
    from kvoffload.tiers.redis.lookups import RemoteLookups
    from kvoffload.tiers.redis.manager import RedisOffloadingManager

log = logging.getLogger("kvoffload.tiers.redis")

_URL = custom("`redis://`, `rediss://` or `unix://` URL", lambda where, value: check_url(value))
_VARIABLE = text("variable name", "name an environment variable", bool)

REDIS_KEYS = Schema((
    Key("url", _URL, REQUIRED,
        "`redis://[user:password@]host:port/db`, `rediss://` for TLS, `unix:///path/to.sock`; shown only "
        "with its password hidden",
        hint="e.g. 'redis://127.0.0.1:6379/0'"),
    Key("cluster", BOOL, False, "the URL names one node of a Redis Cluster"),
    Key("password_env", _VARIABLE, None,
        "the environment variable holding the password (instead of putting it in the URL), read when the "
        "tier is built: unset, it fails start-up naming the variable; never logged"),
    Key("bytes_to_use", POSITIVE_INT, None,
        "the most bytes of values this engine keeps on the server (with tensor parallelism every rank's "
        "share of a block counted); the blocks it wrote are deleted when its index evicts them. Without it "
        "the index holds up to `max_index_blocks` blocks, nothing is deleted, and the server's `maxmemory` "
        "policy bounds the store",
        shown_default="none"),
    MAX_INDEX_BLOCKS,
    Key("namespace", NAME, "kvoffload",
        "the first part of every key name, to keep kvoffload's keys (or one deployment's) apart on a shared "
        "server; the layout namespace derived from the blocks' identity follows it"),
    Key("ttl_s", POSITIVE_INT, None, "expiry of stored blocks, seconds", shown_default="none"),
    Key("io_threads", POSITIVE_INT, 2, "the worker's threads"),
    Key("connect_timeout_s", POSITIVE_SECONDS, 1.0, "bound of connecting to the server"),
    Key("timeout_s", POSITIVE_SECONDS, 2.0, "bound of every call"),
    PROBE_TIMEOUT,
    Key("reconcile_interval_s", POSITIVE_SECONDS, 30.0,
        "how often the index is checked against the server (what keyspace notifications did not tell)"),
), unknown="unknown key(s) {unknown} for the redis tier; known: {known}",
   missing="the redis tier needs {key!r}{hint}")  # fmt: skip


class RedisTierType(SharedStoreTierType):
    type_name = "redis"

    def __init__(self, server: ServerSettings, options: Mapping[str, Any]) -> None:
        """``options``: every key of ``REDIS_KEYS``, parsed."""
        self.server = server
        self.bytes_to_use: int | None = options["bytes_to_use"]
        self.max_index_blocks: int = options["max_index_blocks"]
        self.prefix: str = options["namespace"]
        self.ttl: int | None = options["ttl_s"]
        self.io_threads: int = options["io_threads"]
        self.probe_timeout: float = options["probe_timeout_s"]
        self.reconcile_interval: float = options["reconcile_interval_s"]

    @classmethod
    def parse(cls, options: Mapping[str, Any]) -> RedisTierType:
        values = REDIS_KEYS.parse(options)
        server = ServerSettings(values["url"], values["cluster"], values["password_env"],
                                values["connect_timeout_s"], values["timeout_s"])  # fmt: skip
        return cls(server, values)

    def _connect(self):
        return connect(self.server)

    def _check_password(self) -> None:
        """An unset ``password_env`` is a configuration error (read here, not when parsing)."""
        try:
            self.server.password()
        except ValueError as exc:
            raise ValueError(f"redis tier {self.server.shown}: {exc}") from None

    def _check_server(self) -> None:
        """Refuse rejected credentials; tolerate an unreachable server (logged)."""
        import redis

        try:
            connect(self.server).ping()
        except redis.AuthenticationError as exc:
            raise ValueError(f"redis at {self.server.shown!r} rejected the credentials: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - unreachable, timeout, refused
            log.warning(
                "redis tier: %s is unreachable at start-up (%s); starting without it, "
                "it serves once the server answers", self.server.shown, redact(str(exc)),
            )  # fmt: skip

    def _manager_type(self) -> type[RedisOffloadingManager]:
        from kvoffload.tiers.redis.manager import RedisOffloadingManager

        return RedisOffloadingManager

    def _lookups(self, names: Sequence[KeyNames]) -> RemoteLookups:
        from kvoffload.tiers.redis.lookups import RemoteLookups

        calls = NodeCalls(self._connect, f"redis tier {self.server.shown} (lookups)", self.server.cluster)
        notifications = not self.server.cluster  # per node on a cluster: reconciliation instead
        return RemoteLookups(self._connect, names, calls, notifications=notifications)

    def build_manager(self, context: TierContext, eviction_policy: str) -> RedisOffloadingManager:
        self._check_password()
        self._check_server()
        return super().build_manager(context, eviction_policy)

    def build_worker(self, context: TierContext, host_pool: Any) -> OffloadingWorker:
        from kvoffload.tiers.redis.worker import RedisWorker

        self._check_password()
        calls = NodeCalls(self._connect, f"redis tier {self.server.shown} (transfers)", self.server.cluster)
        worker = RedisWorker(host_pool, calls, self._names(context), io_threads=self.io_threads, ttl=self.ttl)
        return self._checked(worker, context)
