"""``type: "redis"`` in ``secondary_tiers``: a Redis/Valkey server shared by engine replicas.

Keys of its entry (errors name the key and the value; a URL is shown without password):

* ``url`` (required): ``redis://[user:password@]host:port/db``, ``rediss://`` for TLS,
  ``unix:///path/to.sock``.
* ``cluster`` (default false): the URL names one node of a Redis Cluster.
* ``password_env``: the name of an environment variable holding the password (instead of
  putting it in the URL).
* ``bytes_to_use``: the most bytes of values this engine keeps on the server (with
  tensor parallelism, every rank's share of a block counted: each rank stores its share
  under a name of its own); the blocks it wrote are deleted there when its index evicts
  them. Without it the index holds up to
  ``max_index_blocks`` blocks and nothing is deleted: the server's ``maxmemory`` policy
  bounds the store.
* ``max_index_blocks`` (default 1,000,000): blocks the local index tracks without a budget.
* ``namespace`` (default ``"kvoffload"``): the first part of every key name, to keep
  kvoffload's keys (or one deployment's) apart on a shared server; the layout namespace
  derived from the blocks' identity follows it.
* ``ttl_s``: optional expiry of stored blocks, seconds.
* ``connect_timeout_s`` (default 1.0), ``timeout_s`` (default 2.0): bounds of every call.
* ``probe_timeout_s`` (default 1.0): a lookup still unanswered after this is a miss.
* ``reconcile_interval_s`` (default 30): how often the index is checked against the server.
* ``io_threads`` (default 2): the worker's threads.

Start-up: configuration errors (bad URL, unset ``password_env``) fail the engine start;
a server that cannot be reached is not an error: the tier starts degraded (logged once),
answers misses, and serves once the server answers. The shared cache is an optimisation,
so its outage must not stop an engine from serving. Credentials the server rejects are
a configuration error and fail the start.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from kvoffload.manager import OffloadingManager
from kvoffload.tiers.redis.calls import NodeCalls
from kvoffload.tiers.redis.client import ServerSettings, check_url, connect, redact
from kvoffload.tiers.redis.format import KeyNames, redis_namespace, value_bytes
from kvoffload.tiers.secondary import SecondaryTierType, TierContext
from kvoffload.validation import positive_int
from kvoffload.worker import OffloadingWorker

log = logging.getLogger("kvoffload.tiers.redis")

_SECONDS = {"connect_timeout_s": 1.0, "timeout_s": 2.0, "probe_timeout_s": 1.0, "reconcile_interval_s": 30.0}
_KNOWN = ("url", "cluster", "password_env", "bytes_to_use", "max_index_blocks", "namespace", "ttl_s",
          "io_threads", *_SECONDS)  # fmt: skip


def _seconds(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{key} must be a positive number of seconds, got {value!r}")
    return float(value)


class RedisTierType(SecondaryTierType):
    type_name = "redis"

    def __init__(self, server: ServerSettings, options: Mapping[str, Any]) -> None:
        self.server = server
        self.bytes_to_use: int | None = options.get("bytes_to_use")
        self.max_index_blocks: int = options.get("max_index_blocks", 1_000_000)
        self.prefix: str = options.get("namespace", "kvoffload")
        self.ttl: int | None = options.get("ttl_s")
        self.io_threads: int = options.get("io_threads", 2)
        self.seconds = {key: options.get(key, default) for key, default in _SECONDS.items()}

    @classmethod
    def parse(cls, options: Mapping[str, Any]) -> RedisTierType:
        unknown = sorted(set(options) - set(_KNOWN))
        if unknown:
            raise ValueError(f"unknown key(s) {unknown} for the redis tier; known: {list(_KNOWN)}")
        if "url" not in options:
            raise ValueError("the redis tier needs 'url' (e.g. 'redis://127.0.0.1:6379/0')")
        url = check_url(options["url"])
        cluster = options.get("cluster", False)
        if not isinstance(cluster, bool):
            raise ValueError(f"cluster must be true or false, got {cluster!r}")
        password_env = options.get("password_env")
        if password_env is not None and (not isinstance(password_env, str) or not password_env):
            raise ValueError(f"password_env must name an environment variable, got {password_env!r}")
        prefix = options.get("namespace", "kvoffload")
        if not isinstance(prefix, str) or not prefix or any(c in prefix for c in " :\n\r\0"):
            raise ValueError(f"namespace must be a non-empty name without spaces or ':', got {prefix!r}")
        parsed = {"namespace": prefix}
        for key in ("bytes_to_use", "ttl_s", "max_index_blocks", "io_threads"):
            if key in options:
                parsed[key] = positive_int(key, options[key])
        seconds = {key: _seconds(key, options[key]) for key in _SECONDS if key in options}
        server = ServerSettings(url, cluster, password_env, seconds.get("connect_timeout_s", 1.0),
                                seconds.get("timeout_s", 2.0))  # fmt: skip
        server.password()  # an unset password_env is a configuration error
        return cls(server, {**parsed, **seconds})

    def _names(self, context: TierContext, rank: int | None = None) -> KeyNames:
        return KeyNames(self.prefix, redis_namespace(context.rank_identity(rank)))

    def _connect(self):
        return connect(self.server)

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

    def build_manager(self, context: TierContext, eviction_policy: str) -> OffloadingManager:
        from kvoffload.tiers.redis.lookups import RemoteLookups
        from kvoffload.tiers.redis.manager import RedisOffloadingManager

        self._check_server()
        per_block = value_bytes(context.block_bytes) * context.world_size  # every rank's share
        if self.bytes_to_use is not None:
            capacity = self.bytes_to_use // per_block
            if capacity == 0:
                raise ValueError(f"bytes_to_use={self.bytes_to_use} holds no block ({per_block} bytes each)")
        else:
            capacity = self.max_index_blocks
        calls = NodeCalls(self._connect, f"redis tier {self.server.shown} (lookups)", self.server.cluster)
        notifications = not self.server.cluster  # per node on a cluster: reconciliation instead
        names = [self._names(context, rank) for rank in range(context.world_size)]
        lookups = RemoteLookups(self._connect, names, calls, notifications=notifications)
        return RedisOffloadingManager(
            lookups,
            capacity,
            eviction_policy,
            enable_events=True,
            delete_on_evict=self.bytes_to_use is not None,
            probe_timeout=self.seconds["probe_timeout_s"],
            reconcile_interval=self.seconds["reconcile_interval_s"],
        )

    def build_worker(self, context: TierContext, host_pool: Any) -> OffloadingWorker:
        from kvoffload.tiers.redis.worker import RedisWorker

        calls = NodeCalls(self._connect, f"redis tier {self.server.shown} (transfers)", self.server.cluster)
        worker = RedisWorker(host_pool, calls, self._names(context), io_threads=self.io_threads, ttl=self.ttl)
        if worker.block_bytes != context.block_bytes:
            worker.close()
            raise ValueError(
                f"the host pool holds {worker.block_bytes} bytes per block but the tier was sized "
                f"for {context.block_bytes}"
            )
        return worker
