"""``type: "s3"`` in ``secondary_tiers``: an S3-compatible bucket shared by engine replicas.

The keys of its entry are declared once, in ``S3_KEYS`` (README's object-tier table is
generated from it by ``scripts/config_tables.py``); errors name the key and the value.

Start-up: parsing checks values only. Building the tier reads the credentials from the
environment (an unset variable fails the start, naming the variable) and the manager
lists one name of the bucket: a bucket that does not exist, or credentials it refuses,
fail the start with a message naming the endpoint and the bucket (never the secret); an
endpoint that does not answer is a degraded start (logged once): the tier misses until it
answers, then serves. The bucket is not created: make it, and its lifecycle rules, as you
make a database's tables.

Tensor parallelism: each rank's share of a block is its own object (its namespace derives
from the rank's identity); the manager holds a block only when every rank's object
exists, and its byte budget counts every rank's.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from kvoffload.settings import (
    BOOL,
    NON_NEGATIVE_INT,
    POSITIVE_INT,
    POSITIVE_SECONDS,
    REQUIRED,
    Key,
    Schema,
    custom,
    text,
)
from kvoffload.tiers.mooncake.objects import SLOT_BYTES
from kvoffload.tiers.redis.format import redis_namespace
from kvoffload.tiers.s3.names import ObjectNames
from kvoffload.tiers.s3.store import ObjectStore, S3Settings
from kvoffload.tiers.secondary import TierContext
from kvoffload.tiers.shared_store_tier import MAX_INDEX_BLOCKS, PROBE_TIMEOUT, SharedStoreTierType
from kvoffload.worker import OffloadingWorker

if TYPE_CHECKING:
    from kvoffload.tiers.s3.lookups import S3Lookups
    from kvoffload.tiers.s3.manager import S3OffloadingManager


def _endpoint(where: str, value: Any) -> str:
    parts = urlsplit(value) if isinstance(value, str) else None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{where} must be an http:// or https:// URL, got {value!r}")
    if parts.username or parts.password:
        raise ValueError(f"{where} must not carry credentials (use access_key_env/secret_key_env)")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(f"{where} must be scheme://host[:port] only, got {value!r}")
    try:
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError:
        raise ValueError(f"{where} has a bad port: {value!r}") from None
    return value.rstrip("/")


def _bucket(value: str) -> bool:
    return re.fullmatch(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]", value) is not None


def _prefix(value: str) -> bool:
    return value == "" or re.fullmatch(r"[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*", value) is not None


_VARIABLE = text("variable name", "name an environment variable", lambda v: bool(re.fullmatch(r"\w+", v)))

S3_KEYS = Schema((
    Key("endpoint", custom("`http(s)://host[:port]`", _endpoint), REQUIRED,
        "the S3 API's URL (`https://s3.us-east-1.amazonaws.com`, a SeaweedFS or MinIO gateway, ...)",
        hint="e.g. 'http://10.0.0.5:8333'"),
    Key("bucket", text("bucket name", "be an S3 bucket name (3-63 of a-z, 0-9, '.', '-')", _bucket), REQUIRED,
        "the bucket (it must exist: the tier does not create it)", hint="e.g. 'kv-cache'"),
    Key("prefix", text("`a/b/c` or empty", "be '/'-separated names of A-Z a-z 0-9 . _ -, or ''", _prefix),
        "kvoffload",
        "the folder of kvoffload's objects in the bucket (objects are "
        "`<prefix>/<namespace>/<key hex>`, the namespace derived from the blocks' identity)"),
    Key("region", text("region name", "be a non-empty region name", bool), "us-east-1",
        "the signing region"),
    Key("access_key_env", _VARIABLE, "AWS_ACCESS_KEY_ID",
        "the environment variable holding the access key id, read when the tier is built (unset: start-up "
        "fails naming it)"),
    Key("secret_key_env", _VARIABLE, "AWS_SECRET_ACCESS_KEY",
        "the environment variable holding the secret key; never logged, never in an error"),
    Key("session_token_env", _VARIABLE, None, "the environment variable holding a session token, if any"),
    Key("virtual_hosted", BOOL, False,
        "address the bucket as `bucket.host` (AWS's style) instead of `host/bucket` (most other servers)"),
    Key("bytes_to_use", POSITIVE_INT, None,
        "the most bytes of objects this engine keeps in the bucket (with tensor parallelism every rank's "
        "share counted); the blocks it wrote are deleted when its index evicts them. Without it the index "
        "holds up to `max_index_blocks` blocks, nothing is deleted, and the bucket's own rules bound it",
        shown_default="none"),
    MAX_INDEX_BLOCKS,
    Key("lifetime_s", POSITIVE_SECONDS, None,
        "objects older than this (by their Last-Modified and this host's clock) are misses and are deleted "
        "when met, so they are stored afresh (a bucket lifecycle rule counts in whole days)",
        shown_default="none"),
    Key("concurrency", POSITIVE_INT, 8,
        "requests in flight per worker (one object per request), and HEADs per batch of lookups"),
    Key("connect_timeout_s", POSITIVE_SECONDS, 1.0, "bound of connecting to the endpoint"),
    Key("timeout_s", POSITIVE_SECONDS, 5.0, "bound of every request, from connecting to the last byte"),
    Key("retries", NON_NEGATIVE_INT, 0,
        "retries of a request that failed without an answer or with a 5xx (the breaker retries the "
        "endpoint; a timed-out put may still land, so a retry of it meets the first one's object)"),
    PROBE_TIMEOUT,
    Key("reconcile_interval_s", POSITIVE_SECONDS, 60.0,
        "how often the index is checked against a listing of the bucket (what other writers, lifecycle "
        "rules or `lifetime_s` deleted; S3 sends no notifications)"),
    Key("retry_max_s", POSITIVE_SECONDS, 10.0,
        "the longest wait between tries of an endpoint that is down (the breaker's backoff cap)"),
), unknown="unknown key(s) {unknown} for the s3 tier; known: {known}",
   missing="the s3 tier needs {key!r}{hint}")  # fmt: skip


class S3TierType(SharedStoreTierType):
    type_name = "s3"
    # The host pool keeps each block's object header right before its payload
    # (``kvoffload.tiers.mooncake.objects.OneBuffer``): a store puts one buffer of the pool.
    host_row_prefix_bytes = SLOT_BYTES

    def __init__(self, options: Mapping[str, Any]) -> None:
        """``options``: every key of ``S3_KEYS``, parsed."""
        self.options = dict(options)
        self.prefix: str = options["prefix"]
        self.bytes_to_use: int | None = options["bytes_to_use"]
        self.max_index_blocks: int = options["max_index_blocks"]
        self.probe_timeout: float = options["probe_timeout_s"]
        self.reconcile_interval: float = options["reconcile_interval_s"]
        self.lifetime: float | None = options["lifetime_s"]
        self.concurrency: int = options["concurrency"]
        self.settings = S3Settings(
            endpoint=options["endpoint"],
            bucket=options["bucket"],
            region=options["region"],
            access_key_env=options["access_key_env"],
            secret_key_env=options["secret_key_env"],
            session_token_env=options["session_token_env"],
            virtual_hosted=options["virtual_hosted"],
            connect_timeout=options["connect_timeout_s"],
            timeout=options["timeout_s"],
            retries=options["retries"],
        )

    @classmethod
    def parse(cls, options: Mapping[str, Any]) -> S3TierType:
        return cls(S3_KEYS.parse(options))

    def _store(self, side: str) -> ObjectStore:
        return ObjectStore(self.settings, f"s3 tier {self.settings.shown} ({side})",
                           max_delay=self.options["retry_max_s"])  # fmt: skip

    def _names(self, context: TierContext, rank: int | None = None) -> ObjectNames:
        return ObjectNames(self.prefix, redis_namespace(context.rank_identity(rank)))

    def _manager_type(self) -> type[S3OffloadingManager]:
        from kvoffload.tiers.s3.manager import S3OffloadingManager

        return S3OffloadingManager

    def _lookups(self, names: Sequence[ObjectNames]) -> S3Lookups:
        from kvoffload.tiers.s3.lookups import S3Lookups

        store = self._store("lookups")
        store.check_access(names[0].folder)
        return S3Lookups(store, names, concurrency=self.concurrency, lifetime=self.lifetime)

    def build_worker(self, context: TierContext, host_pool: Any) -> OffloadingWorker:
        from kvoffload.tiers.s3.worker import S3Worker

        store = self._store(f"transfers, rank {context.rank}")
        worker = S3Worker(host_pool, store, self._names(context), concurrency=self.concurrency,
                          lifetime=self.lifetime)  # fmt: skip
        return self._checked(worker, context)
