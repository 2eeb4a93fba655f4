"""KV event types, field for field what vLLM (0.32) puts on the wire.

Contract:

* ``BlockStored``, ``BlockRemoved`` and ``AllBlocksCleared`` are msgspec structs tagged
  by their class name under ``"type"``; in the default map encoding fields that have no
  default are always written and optional fields are left out while they are ``None``.
  Field order is vLLM's, and it matters: the legacy array encoding is positional.
* ``KVEventBatch(ts, events, data_parallel_rank)`` is always a 3-slot msgpack array
  (also when the rank is ``None``), which every known consumer accepts.
* A block hash is a ``BlockHashValue``: an unsigned 64-bit ``int`` (what routers index,
  see ``kvoffload.keys.external_hash``) or raw hash ``bytes``. ``wire_hash`` converts.
* ``session_id`` is a trailing optional field that vLLM 0.32 added to ``BlockStored``;
  carrying it lets payloads produced by vLLM round-trip through kvoffload unchanged.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from kvoffload.keys import external_hash

BlockHashValue = int | bytes
HashFormat = Literal["u64", "raw"]
HASH_FORMATS: tuple[str, ...] = ("u64", "raw")

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"


class KVCacheEvent(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Base of the wire events; the tag is the class name."""


class BlockStored(KVCacheEvent):
    """Blocks became loadable in ``medium``; ``parent_block_hash`` chains the first one."""

    block_hashes: list[BlockHashValue]
    parent_block_hash: BlockHashValue | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    """Blocks are no longer available in ``medium``."""

    block_hashes: list[BlockHashValue]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """Every block of the publisher is gone (e.g. after a reset)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
EVENT_TYPES: tuple[type[KVCacheEvent], ...] = (BlockStored, BlockRemoved, AllBlocksCleared)


class KVEventBatch(msgspec.Struct, array_like=True, gc=False):
    """The events of one engine step: ``[ts, events, data_parallel_rank]`` on the wire."""

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


def wire_hash(block_hash: bytes, hash_format: HashFormat = "u64") -> BlockHashValue:
    """``block_hash`` as it goes on the wire: its unsigned 64-bit form, or the raw bytes."""
    if hash_format == "u64":
        return external_hash(block_hash)
    if hash_format == "raw":
        return bytes(block_hash)
    raise ValueError(f"hash_format must be one of {HASH_FORMATS}, got {hash_format!r}")
