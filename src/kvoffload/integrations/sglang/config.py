"""The SGLang storage backend's configuration: SGLang's extra config, validated.

SGLang hands a ``dynamic`` HiCache storage backend its
``--hicache-storage-backend-extra-config`` JSON as ``HiCacheStorageConfig.extra_config``.
Besides SGLang's own keys for loading the class (``backend_name``, ``module_path``,
``class_name``) and choosing its interface (``interface_v1``), it takes kvoffload's tier keys
in the shape the vLLM connector takes them (``secondary_tiers``, ``eviction_policy``; each
tier's table as in README), validated by the same schemas, so an error names the key and
the bad value. ``STORAGE_CONFIG`` declares every key once (README's table is generated from
it). Parsing has no side effects.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvoffload.settings import (
    REQUIRED,
    Key,
    Kind,
    Schema,
    custom,
    one_of,
    seconds,
    text,
)
from kvoffload.tiers.factory import EVICTION_POLICY
from kvoffload.tiers.secondary import SecondaryTierType, parse_secondary_tiers

# How long ``batch_exists`` waits at most for a shared tier's background lookups to answer
# about keys it has not seen (a store that is down answers at once: a miss).
DEFAULT_EXISTS_WAIT_S = 2.0


def _tiers(where: str, value: Any) -> tuple[SecondaryTierType, ...]:
    if isinstance(value, (list, tuple)) and not value:
        raise ValueError(f"{where} must name at least one tier (e.g. [{{'type': 'fs', ...}}]), got {value!r}")
    try:
        return parse_secondary_tiers(value)
    except ValueError as exc:
        raise ValueError(f"hicache_storage_backend_extra_config: {exc}") from None


def _endpoint(where: str, value: Any) -> str | None:
    if value is None:
        return None
    if not (isinstance(value, str) and "://" in value):
        raise ValueError(f"{where} must be a ZMQ endpoint such as 'tcp://127.0.0.1:5557', got {value!r}")
    return value


ENDPOINT: Kind = custom("ZMQ endpoint", _endpoint)
PORT = Kind("port in [0, 65535]", "be a port in [0, 65535]",
            lambda v: isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 65535)  # fmt: skip

STORAGE_CONFIG = Schema((
    Key("backend_name", text("name", "be a non-empty string", bool), "kvoffload",
        "SGLang's key: the backend's name in its logs"),
    Key("module_path", one_of("kvoffload.integrations.sglang"), REQUIRED,
        "SGLang's key: `kvoffload.integrations.sglang`"),
    Key("class_name", one_of("KVOffloadStorage"), REQUIRED, "SGLang's key: `KVOffloadStorage`"),
    Key("interface_v1", one_of(0, 1, True, False), 0,
        "SGLang's key: `1` makes SGLang call the zero-copy methods (`batch_get_v1`/`batch_set_v1`: the tiers "
        "read and write its host pool's pages in place); `0` the whole-page ones (one copy through a staging "
        "buffer)"),
    Key("secondary_tiers", custom("list of tier entries", _tiers), REQUIRED,
        "the tiers that hold SGLang's pages, fastest first (a page is written to each, read from the first "
        "that holds it): `[{\"type\": \"fs\", \"root_dir\": \"/nvme/kv\", \"bytes_to_use\": 500 << 30}, "
        "{\"type\": \"redis\", \"url\": \"redis://10.0.0.5:6379/0\"}]`, each with its table's keys; "
        "`bytes_to_use` is the total over the tensor-parallel ranks, as for vLLM",
        hint="e.g. [{'type': 'fs', 'root_dir': ..., 'bytes_to_use': ...}]"),
    EVICTION_POLICY,
    Key("exists_wait_s", seconds(0, 30), DEFAULT_EXISTS_WAIT_S,
        "the longest `batch_exists` waits for a shared tier to answer about pages it has not seen (a store "
        "that is down answers at once: a miss)"),
    Key("kv_events_endpoint", ENDPOINT, None,
        "where the pages' `BlockStored`/`BlockRemoved` events are published (ZMQ PUB, bound; by the first "
        "tensor-parallel rank; a data-parallel rank adds its rank to the port as vLLM does); none: no "
        "events"),
    Key("kv_events_replay_endpoint", ENDPOINT, None,
        "the publisher's replay endpoint (ZMQ ROUTER, bound), for subscribers that missed events"),
    Key("kv_events_topic", text("string", "be a string", lambda v: True), "",
        "the events' topic frame", shown_default="empty"),
    Key("metrics_port", PORT, None,
        "serve kvoffload's Prometheus metrics on 127.0.0.1 at this port plus the tensor-parallel rank (0: a "
        "free port, logged); none: not served (the metrics are still registered in "
        "`kvoffload.metrics.REGISTRY`)"),
    Key("namespace_extra", custom("mapping", lambda where, v: _mapping(where, v)), None,
        "anything else that changes a page's bytes and SGLang does not tell the backend (e.g. a "
        "quantisation), added to the tiers' namespace"),
), where="hicache_storage_backend_extra_config[{key!r}]",
   unknown="unknown key(s) {unknown} in hicache_storage_backend_extra_config; known: {known}",
   missing="hicache_storage_backend_extra_config needs {key!r}{hint}")  # fmt: skip


def _mapping(where: str, value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise ValueError(f"{where} must be a mapping with string keys, got {value!r}")
    return dict(value)


@dataclass(frozen=True)
class StorageSettings:
    """The validated extra config (see ``STORAGE_CONFIG`` for each field)."""

    secondary_tiers: tuple[SecondaryTierType, ...]
    eviction_policy: str = "lru"
    interface_v1: bool = False
    exists_wait_s: float = DEFAULT_EXISTS_WAIT_S
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    kv_events_topic: str = ""
    metrics_port: int | None = None
    namespace_extra: Mapping[str, Any] | None = None

    @classmethod
    def parse(cls, extra_config: Mapping[str, Any] | None) -> StorageSettings:
        if extra_config is None:
            raise ValueError(
                "the kvoffload backend needs hicache_storage_backend_extra_config with 'secondary_tiers'"
            )
        if not isinstance(extra_config, Mapping):
            raise ValueError(f"hicache_storage_backend_extra_config must be a mapping, got {extra_config!r}")
        values = STORAGE_CONFIG.parse(extra_config)
        return cls(
            secondary_tiers=values["secondary_tiers"],
            eviction_policy=values["eviction_policy"],
            interface_v1=bool(values["interface_v1"]),
            exists_wait_s=values["exists_wait_s"],
            kv_events_endpoint=values["kv_events_endpoint"],
            kv_events_replay_endpoint=values["kv_events_replay_endpoint"],
            kv_events_topic=values["kv_events_topic"],
            metrics_port=values["metrics_port"],
            namespace_extra=values["namespace_extra"],
        )
