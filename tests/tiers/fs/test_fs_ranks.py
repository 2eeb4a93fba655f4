"""The disk tier under tensor parallelism: each rank's share of a block lives in its own
namespace, in the slot one scheduler-side manager handed out. A manager given the other
ranks' namespaces locks them all and rebuilds only the blocks every rank holds intact in
the same slot; the others are left out (``partial_at_start``), never loadable."""

from __future__ import annotations

import numpy as np
import pytest

from kvoffload.keys import make_offload_key
from kvoffload.manager import LookupResult
from kvoffload.tiers.fs.block_io import BlockFiles
from kvoffload.tiers.fs.format import Geometry
from kvoffload.tiers.fs.manager import FSOffloadingManager
from kvoffload.tiers.fs.namespace import namespace_digest

BLOCK = 8192


def k(i: int) -> bytes:
    return make_offload_key(i.to_bytes(32, "big"), 0)


def write(root, namespace: str, blocks: dict[int, int]) -> None:
    """``blocks``: slot -> key id, written into ``root/namespace``."""
    (root / namespace).mkdir(exist_ok=True)
    files = BlockFiles(str(root / namespace), Geometry(BLOCK), namespace_digest(namespace))
    try:
        for slot, i in blocks.items():
            files.write(slot, k(i), [np.full(BLOCK, i, dtype=np.uint8)])
    finally:
        files.close()


def test_only_blocks_every_rank_holds_in_the_same_slot_are_rebuilt(tmp_path):
    write(tmp_path, "rank0", {0: 1, 1: 2, 2: 3, 5: 5})
    write(tmp_path, "rank1", {0: 1, 3: 3, 4: 4, 5: 5})
    m = FSOffloadingManager(tmp_path, "rank0", BLOCK, 8 * Geometry(BLOCK).stored_block_bytes, "lru", True,
                            rank_namespaces=["rank1"])  # fmt: skip
    try:
        # 1 and 5: both ranks, same slot; 2: rank 0 only; 3: other slots; 4: rank 1 only
        assert [m.lookup(k(i)) for i in range(1, 6)] == [
            LookupResult.HIT, LookupResult.MISS, LookupResult.MISS, LookupResult.MISS, LookupResult.HIT,
        ]  # fmt: skip
        counters = m.counters()
        assert (counters.rebuilt, counters.partial_at_start) == (2, 3)
        (event,) = m.take_events()
        assert sorted(event.keys) == [k(1), k(5)] and not event.removed
        # a partial block's slots are free again: new stores may take them
        out = m.prepare_store([k(10 + i) for i in range(6)])
        assert sorted(out.store_spec.block_ids.tolist()) == [1, 2, 3, 4, 6, 7]
        # every rank's namespace is locked, by this one manager
        for name in ("rank0", "rank1"):
            with pytest.raises(ValueError, match="in use by another disk-tier manager"):
                FSOffloadingManager(tmp_path, name, BLOCK, 8 * Geometry(BLOCK).stored_block_bytes)
    finally:
        m.close()
    FSOffloadingManager(tmp_path, "rank1", BLOCK, 8 * Geometry(BLOCK).stored_block_bytes).close()  # released


def test_a_missing_rank_namespace_leaves_every_block_out(tmp_path):
    write(tmp_path, "rank0", {0: 1, 1: 2})
    m = FSOffloadingManager(tmp_path, "rank0", BLOCK, 4 * Geometry(BLOCK).stored_block_bytes,
                            rank_namespaces=["rank1"])  # fmt: skip
    try:
        assert m.stats().used == 0 and m.counters().partial_at_start == 2
    finally:
        m.close()
