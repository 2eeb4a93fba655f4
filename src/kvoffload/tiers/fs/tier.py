"""``type: "fs"`` in ``secondary_tiers``: the local-disk tier as a configured tier.

The keys of its entry are declared once, in ``FS_KEYS`` (kind of value, default, meaning;
README's disk-tier table is generated from it by ``scripts/config_tables.py``); errors name
the key and the value. Parsing checks values only: ``<root_dir>/<namespace>`` (the
namespace derived from what the blocks' bytes mean, ``TierContext.identity``, one per
rank) is created, mode 0700, and checked writable when the tier's manager or worker is
built, failing with a ``ValueError`` that names ``root_dir``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvoffload.manager import OffloadingManager
from kvoffload.settings import BOOL, FRACTION, PATH, POSITIVE_INT, REQUIRED, Key, Schema
from kvoffload.tiers.fs.namespace import describe, fs_namespace
from kvoffload.tiers.fs.worker import LOAD_THREADS, STORE_THREADS, FSWorker
from kvoffload.tiers.secondary import SecondaryTierType, TierContext
from kvoffload.worker import OffloadingWorker

FS_KEYS = Schema((
    Key("root_dir", PATH, REQUIRED,
        "the folder: blocks go to `<root_dir>/<namespace>`, one namespace per byte layout and rank; created "
        "(missing folders 0700) when the tier is built, and must be writable"),
    Key("bytes_to_use", POSITIVE_INT, REQUIRED,
        "the most bytes of blocks (headers included) this tier keeps, over all ranks' namespaces (each rank "
        "gets an equal share)"),
    Key("min_free_fraction", FRACTION, 0.05,
        "stores are declined while the file system has less free space than this fraction of its size"),
    Key("load_threads", POSITIVE_INT, LOAD_THREADS,
        "the worker's load threads: parallel direct reads keep the device's queue full"),
    Key("store_threads", POSITIVE_INT, STORE_THREADS,
        "the worker's store threads: the file system serialises writes into one file, so more contend "
        "for its lock"),
    Key("fsync", BOOL, False,
        "flush every stored block to the device before it counts as stored (survives power loss, not only "
        "a process crash)"),
    Key("verify_on_start", BOOL, False,
        "check every block's checksum when rebuilding the index at start-up (a full read), not only its "
        "header"),
    Key("direct_reads", BOOL, True,
        "loads read what the page cache does not hold with `O_DIRECT`, straight into the host pool, where "
        "the file system and the pool's row alignment allow it (Linux 6.5+ for `cachestat`); `false` reads "
        "everything through the page cache"),
), unknown="unknown key(s) {unknown} for the fs tier; known: {known}",
   missing="the fs tier needs {key!r}")  # fmt: skip


class FSTierType(SecondaryTierType):
    type_name = "fs"

    def __init__(
        self,
        root_dir: str,
        bytes_to_use: int,
        min_free_fraction: float = 0.05,
        load_threads: int = LOAD_THREADS,
        store_threads: int = STORE_THREADS,
        fsync: bool = False,
        verify_on_start: bool = False,
        direct_reads: bool = True,
    ) -> None:
        self.root_dir = root_dir
        self.bytes_to_use = bytes_to_use
        self.min_free_fraction = min_free_fraction
        self.load_threads = load_threads
        self.store_threads = store_threads
        self.fsync = fsync
        self.verify_on_start = verify_on_start
        self.direct_reads = direct_reads

    @classmethod
    def parse(cls, options: Mapping[str, Any]) -> FSTierType:
        return cls(**FS_KEYS.parse(options))

    def _rank_bytes(self, context: TierContext) -> int:
        """Each rank's part of ``bytes_to_use``."""
        share = self.bytes_to_use // context.world_size
        if share < context.block_bytes:
            raise ValueError(
                f"bytes_to_use={self.bytes_to_use} over {context.world_size} ranks holds no block "
                f"({context.block_bytes} bytes each)"
            )
        return share

    def build_manager(self, context: TierContext, eviction_policy: str) -> OffloadingManager:
        from kvoffload.tiers.fs.manager import FSOffloadingManager

        identities = context.rank_identities()
        return FSOffloadingManager(
            self.root_dir,
            fs_namespace(identities[0]),
            context.block_bytes,
            self._rank_bytes(context),
            eviction_policy,
            enable_events=True,
            verify_on_start=self.verify_on_start,
            info=[describe(identity) for identity in identities],
            rank_namespaces=[fs_namespace(identity) for identity in identities[1:]],
        )

    def build_worker(self, context: TierContext, host_pool: Any) -> OffloadingWorker:
        worker = FSWorker(
            host_pool,
            self.root_dir,
            fs_namespace(context.rank_identity()),
            self._rank_bytes(context),
            load_threads=self.load_threads,
            store_threads=self.store_threads,
            min_free_fraction=self.min_free_fraction,
            fsync=self.fsync,
            direct_reads=self.direct_reads,
        )
        if worker.block_bytes != context.block_bytes:
            worker.close()
            raise ValueError(
                f"the host pool holds {worker.block_bytes} bytes per block but the tier was sized "
                f"for {context.block_bytes}"
            )
        return worker
