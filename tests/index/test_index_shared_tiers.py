"""The router index counts the blocks of every shared tier (Redis/Valkey, Mooncake Store,
object storage) as the shared tier: kvoffload's scheduler converts their tier events
(media ``"REMOTE"``, ``"MOONCAKE"`` and ``"OBJECT"``) to ``STORAGE``/``REMOTE`` with the
tier named in ``ownership``, and the index files them under ``shared``, and drops them
again on ``BlockRemoved``."""

from __future__ import annotations

import pytest

from kvoffload.index import BlockIndex
from kvoffload.keys import BlockHasher, make_offload_key
from kvoffload.manager import OffloadingEvent
from kvoffload.scheduler.events import EventConverter
from kvoffload.scheduler.types import KVGroup
from kvoffload.specs import MEDIUM_MOONCAKE, MEDIUM_OBJECT, MEDIUM_REMOTE

MODEL, TENANT, BS = "m", "default", 16
TOKENS = list(range(500, 500 + 8 * BS))


@pytest.mark.parametrize(
    "medium, ownership", [(MEDIUM_MOONCAKE, "mooncake"), (MEDIUM_REMOTE, "redis"), (MEDIUM_OBJECT, "s3")]
)
def test_a_shared_tiers_blocks_are_the_shared_tier_of_the_index(medium, ownership) -> None:
    hashes = BlockHasher().hash_request(TOKENS, BS)
    keys = [make_offload_key(h, 0) for h in hashes]
    converter = EventConverter([KVGroup(BS)], 1)
    for i, key in enumerate(keys):
        converter.remember(key, hashes[i - 1] if i else None, TOKENS, i * BS, (i + 1) * BS)
    index = BlockIndex()
    engine = index.add_engine(MODEL, TENANT, "e", 0, BS)

    wire = converter.convert([OffloadingEvent(keys[:2], "CPU", False), OffloadingEvent(keys, medium, False)])
    assert {(e.medium, e.locality, e.ownership) for e in wire[1:]} == {("STORAGE", "REMOTE", ownership)}
    index.apply(engine, wire)
    (match,) = index.query_tokens(MODEL, TENANT, TOKENS).matches
    assert match.levels == (0, 2, 2, 8)  # device, host, disk, shared (cumulative blocks)

    # the tier evicts block 5: the shared run stops there
    index.apply(engine, converter.convert([OffloadingEvent(keys[5:6], medium, True)]))
    (match,) = index.query_tokens(MODEL, TENANT, TOKENS).matches
    assert match.levels == (0, 2, 2, 5)
