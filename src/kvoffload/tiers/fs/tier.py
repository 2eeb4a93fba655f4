"""``type: "fs"`` in ``secondary_tiers``: the local-disk tier as a configured tier.

Keys of its entry (errors name the key and the value):

* ``root_dir`` (required): the folder; blocks go to ``<root_dir>/<namespace>``, the
  namespace derived from what the blocks' bytes mean (``TierContext.identity``) and the
  worker's rank (with tensor parallelism one namespace per rank). It is created if
  needed and must be writable.
* ``bytes_to_use`` (required): the most bytes of blocks (headers included) this tier
  keeps, over all ranks' namespaces (each rank's share gets an equal part).
* ``min_free_fraction`` (default 0.05): stores are declined while the file system has less
  free space than this fraction of its size.
* ``load_threads`` (default 4), ``store_threads`` (default 2): the worker's I/O threads.
* ``fsync`` (default false): flush every stored block to the device before it counts as
  stored (survives power loss, not only a process crash).
* ``verify_on_start`` (default false): check every block's checksum when rebuilding the
  index at start-up (a full read), not only its header.
* ``direct_reads`` (default true): loads read what the page cache does not hold with
  ``O_DIRECT``, straight into the host pool, where the file system and the pool's row
  alignment allow it; false reads everything through the page cache.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from kvoffload.manager import OffloadingManager
from kvoffload.private import make_private_dirs
from kvoffload.tiers.fs.namespace import describe, fs_namespace
from kvoffload.tiers.secondary import SecondaryTierType, TierContext
from kvoffload.validation import positive_int
from kvoffload.worker import OffloadingWorker

# Default I/O threads. Stores: buffered writes into one file are serialised by the file
# system (ext4 takes the inode lock per write), so a second thread only overlaps one
# run's CRC32C and Python with another's write; more contend for the lock and cost CPU
# (BENCHMARKS.md, disk tier run 6: 2 threads stored 0.79 and 0.67 of the baseline where 4
# stored 0.66 and 0.63, at 0.86-0.99x their CPU). Loads: parallel direct reads keep the
# device's queue full.
STORE_THREADS = 2
LOAD_THREADS = 4

_KNOWN = ("root_dir", "bytes_to_use", "min_free_fraction", "load_threads", "store_threads", "fsync",
          "verify_on_start", "direct_reads")  # fmt: skip


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
        unknown = sorted(set(options) - set(_KNOWN))
        if unknown:
            raise ValueError(f"unknown key(s) {unknown} for the fs tier; known: {list(_KNOWN)}")
        for key in ("root_dir", "bytes_to_use"):
            if key not in options:
                raise ValueError(f"the fs tier needs {key!r}")
        root_dir = options["root_dir"]
        if not isinstance(root_dir, (str, os.PathLike)) or not os.fspath(root_dir):
            raise ValueError(f"root_dir must be a path, got {root_dir!r}")
        root_dir = os.fspath(root_dir)
        try:
            make_private_dirs(root_dir)  # folders it creates are 0700; existing ones kept
        except OSError as exc:
            raise ValueError(f"root_dir {root_dir!r} cannot be created: {exc}") from None
        if not os.access(root_dir, os.W_OK | os.X_OK):
            raise ValueError(f"root_dir {root_dir!r} is not writable")
        fraction = options.get("min_free_fraction", 0.05)
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction < 1:
            raise ValueError(f"min_free_fraction must be a number in [0, 1), got {fraction!r}")
        flags = {}
        for key, default in (("fsync", False), ("verify_on_start", False), ("direct_reads", True)):
            flags[key] = options.get(key, default)
            if not isinstance(flags[key], bool):
                raise ValueError(f"{key} must be true or false, got {flags[key]!r}")
        return cls(
            root_dir,
            positive_int("bytes_to_use", options["bytes_to_use"]),
            float(fraction),
            positive_int("load_threads", options.get("load_threads", LOAD_THREADS)),
            positive_int("store_threads", options.get("store_threads", STORE_THREADS)),
            **flags,
        )

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
        from kvoffload.tiers.fs.worker import FSWorker

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
