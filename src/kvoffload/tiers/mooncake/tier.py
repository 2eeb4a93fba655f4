"""``type: "mooncake"`` in ``secondary_tiers``: a Mooncake Store shared by engine replicas.

The keys of its entry are declared once, in ``MOONCAKE_KEYS`` (README's Mooncake table is
generated from it by ``scripts/config_tables.py``); errors name the key and the value.

Start-up: parsing checks values only. Building the tier starts a client per side (the
scheduler's, client-only, for lookups; each worker's, contributing ``segment_bytes`` of
memory to the store and registering the host pool) and never waits for the master: a
master that cannot be reached is not an error, the tier starts degraded (logged once),
answers misses, and serves once the master answers (``MooncakeStore``).

Tensor parallelism: each rank's share of a block is its own object (its name's namespace
derives from the rank's identity, ``TierContext.rank_identity``); the manager holds a
block only when every rank's object exists, and its byte budget counts every rank's.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kvoffload.settings import (
    NON_NEGATIVE_INT,
    POSITIVE_INT,
    POSITIVE_SECONDS,
    REQUIRED,
    Key,
    Schema,
    one_of,
    text,
)
from kvoffload.tiers.mooncake.objects import SLOT_BYTES
from kvoffload.tiers.mooncake.store import ClientSettings, MooncakeStore
from kvoffload.tiers.redis.format import KeyNames
from kvoffload.tiers.secondary import TierContext
from kvoffload.tiers.shared_store_tier import MAX_INDEX_BLOCKS, NAME, PROBE_TIMEOUT, SharedStoreTierType
from kvoffload.worker import OffloadingWorker

if TYPE_CHECKING:
    from kvoffload.tiers.mooncake.lookups import MooncakeLookups
    from kvoffload.tiers.mooncake.manager import MooncakeOffloadingManager


def _address(value: str) -> bool:
    match = re.fullmatch(r"[^\s:]+:(\d+)", value)
    return match is not None and 0 < int(match[1]) < 65536


_ADDRESS = text("`host:port`", "be 'host:port' with a port in [1, 65535]", _address)
_URL = text(
    "`http://host:port/metadata`", "be an http:// URL", lambda v: re.fullmatch(r"http://\S+", v) is not None
)
_HOST = text(
    "host name or address", "be a host name or address", lambda v: re.fullmatch(r"[^\s:/]+", v) is not None
)

MOONCAKE_KEYS = Schema((
    Key("master", _ADDRESS, REQUIRED, "the `mooncake_master`'s RPC address", hint="e.g. '10.0.0.5:50051'"),
    Key("metadata", one_of("p2p", "http"), "p2p",
        "how clients find each other's memory: `p2p` (Mooncake's P2P handshake, no server) or `http` "
        "(an HTTP metadata server, `metadata_server`)"),
    Key("metadata_server", _URL, None, "the HTTP metadata server's URL, with `metadata: http` only"),
    Key("protocol", one_of("tcp", "rdma"), "tcp",
        "the transfer protocol (`rdma` is passed through, untested here)"),
    Key("rdma_devices", text("device list", "be a string", lambda v: True), "",
        "RDMA devices for `protocol: rdma` (e.g. `mlx5_0`), passed through", shown_default="none"),
    Key("local_hostname", _HOST, "127.0.0.1",
        "the address other clients reach this process's memory at: set it to this host's address when "
        "`segment_bytes` > 0 and engines on other hosts share the store"),
    Key("segment_bytes", NON_NEGATIVE_INT, 0,
        "memory each worker process contributes to the store (0: client only; the store's memory is then "
        "the segment holders'/other clients')"),
    Key("local_buffer_bytes", NON_NEGATIVE_INT, 16 << 20,
        "the client's own transfer buffer (loads and stores go through the registered host pool instead)"),
    Key("bytes_to_use", POSITIVE_INT, None,
        "the most bytes of objects this engine keeps in the store (with tensor parallelism every rank's "
        "share counted); the blocks it wrote are removed when its index evicts them. Without it the index "
        "holds up to `max_index_blocks` blocks, nothing is removed, and the store's own eviction bounds it",
        shown_default="none"),
    MAX_INDEX_BLOCKS,
    Key("namespace", NAME, "kvoffload",
        "the first part of every object name, to keep kvoffload's objects (or one deployment's) apart in a "
        "shared store; the layout namespace derived from the blocks' identity follows it"),
    Key("io_threads", POSITIVE_INT, 2, "the worker's threads (each with its own batches in flight)"),
    Key("batch_blocks", POSITIVE_INT, 256, "blocks per batched put or get"),
    Key("connect_timeout_s", POSITIVE_SECONDS, 1.0,
        "bound of the TCP check that the master answers before a client is set up (Mooncake's own setup "
        "retries for about 90 s against a dead master, so it runs only after this check, off the engine's "
        "threads)"),
    PROBE_TIMEOUT,
    Key("reconcile_interval_s", POSITIVE_SECONDS, 30.0,
        "how often the index is checked against the store (its evictions; it sends no notifications)"),
    Key("retry_max_s", POSITIVE_SECONDS, 10.0,
        "the longest wait between tries of a master that is down (the breaker's backoff cap; a client not "
        "set up yet tries every `min(2, retry_max_s)` s)"),
), unknown="unknown key(s) {unknown} for the mooncake tier; known: {known}",
   missing="the mooncake tier needs {key!r}{hint}")  # fmt: skip


class MooncakeTierType(SharedStoreTierType):
    type_name = "mooncake"
    # The host pool keeps each block's object header right before its payload
    # (``kvoffload.tiers.mooncake.objects``): an object is then one buffer.
    host_row_prefix_bytes = SLOT_BYTES

    def __init__(self, options: Mapping[str, Any]) -> None:
        """``options``: every key of ``MOONCAKE_KEYS``, parsed (and checked together)."""
        self.options = dict(options)
        self.prefix: str = options["namespace"]
        self.bytes_to_use: int | None = options["bytes_to_use"]
        self.max_index_blocks: int = options["max_index_blocks"]
        self.probe_timeout: float = options["probe_timeout_s"]
        self.reconcile_interval: float = options["reconcile_interval_s"]
        metadata = options["metadata_server"] if options["metadata"] == "http" else "P2PHANDSHAKE"
        self.client = ClientSettings(
            master=options["master"],
            metadata_server=metadata,
            protocol=options["protocol"],
            rdma_devices=options["rdma_devices"],
            local_hostname=options["local_hostname"],
            segment_bytes=options["segment_bytes"],
            local_buffer_bytes=options["local_buffer_bytes"],
            connect_timeout=options["connect_timeout_s"],
        )

    @classmethod
    def parse(cls, options: Mapping[str, Any]) -> MooncakeTierType:
        values = MOONCAKE_KEYS.parse(options)
        if values["metadata"] == "http" and values["metadata_server"] is None:
            raise ValueError("the mooncake tier has metadata='http' but no 'metadata_server' URL")
        if values["metadata"] == "p2p" and values["metadata_server"] is not None:
            raise ValueError(
                f"metadata_server={values['metadata_server']!r} is given but metadata='p2p' uses none; "
                "set metadata='http' to use it"
            )
        return cls(values)

    def _store(self, side: str, segment_bytes: int) -> MooncakeStore:
        settings = ClientSettings(**{**self.client.__dict__, "segment_bytes": segment_bytes})
        retry = self.options["retry_max_s"]
        return MooncakeStore(settings, f"mooncake tier {self.client.master} ({side})",
                             retry=min(2.0, retry), max_delay=retry)  # fmt: skip

    def _manager_type(self) -> type[MooncakeOffloadingManager]:
        from kvoffload.tiers.mooncake.manager import MooncakeOffloadingManager

        return MooncakeOffloadingManager

    def _lookups(self, names: Sequence[KeyNames]) -> MooncakeLookups:
        from kvoffload.tiers.mooncake.lookups import MooncakeLookups

        return MooncakeLookups(self._store("lookups", 0), names)

    def build_worker(self, context: TierContext, host_pool: Any) -> OffloadingWorker:
        from kvoffload.tiers.mooncake.worker import MooncakeWorker

        store = self._store(f"transfers, rank {context.rank}", self.client.segment_bytes)
        try:
            options = self.options
            worker = MooncakeWorker(host_pool, store, self._names(context), io_threads=options["io_threads"],
                                    batch_blocks=options["batch_blocks"])  # fmt: skip
        except BaseException:
            store.close()
            raise
        return self._checked(worker, context)
