"""Block keys: chained token-block hashes and the per-group offload key.

Contract:

* An ``OffloadKey`` is ``block_hash + group_idx.to_bytes(4, "big")``: one block of one
  KV-cache group. The same token block stored for two groups gives two keys.
* ``external_hash(block_hash)`` is the unsigned 64-bit integer routers see on the wire:
  the last eight bytes of the hash, big-endian.
* ``BlockHasher`` hashes *full* token blocks into a chain. Each block hash is
  ``sha256(cbor((parent_hash or NONE_HASH, tuple(token_ids), extra_keys)))`` with
  canonical CBOR, and ``NONE_HASH = sha256(cbor(seed))``: vLLM's ``sha256_cbor``
  construction, so equal tokens give equal hashes in every process and machine, and in a
  vLLM engine using that algorithm with the same seed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any, NewType

import cbor2

from kvoffload.validation import positive_int

OffloadKey = NewType("OffloadKey", bytes)

GROUP_BYTES = 4
DEFAULT_HASH_SEED = "vllm-none-hash"
_U64_MASK = (1 << 64) - 1


def make_offload_key(block_hash: bytes, group_idx: int) -> OffloadKey:
    """The key of ``block_hash`` in KV-cache group ``group_idx`` (0 <= idx < 2**32)."""
    if not 0 <= group_idx < 1 << 32:
        raise ValueError(f"group_idx must be in [0, 2**32), got {group_idx!r}")
    return OffloadKey(bytes(block_hash) + group_idx.to_bytes(GROUP_BYTES, "big"))


def key_block_hash(key: bytes) -> bytes:
    """The block hash part of an offload key."""
    _check_key(key)
    return key[:-GROUP_BYTES]


def key_group(key: bytes) -> int:
    """The KV-cache group index of an offload key."""
    _check_key(key)
    return int.from_bytes(key[-GROUP_BYTES:], "big")


def external_hash(block_hash: bytes) -> int:
    """The unsigned 64-bit form of a block hash that routers index."""
    return int.from_bytes(block_hash, "big") & _U64_MASK


def _check_key(key: bytes) -> None:
    if not isinstance(key, (bytes, bytearray)) or len(key) <= GROUP_BYTES:
        raise ValueError(f"not an offload key (bytes longer than {GROUP_BYTES}): {key!r}")


def sha256_cbor(value: Any) -> bytes:
    """``sha256`` of the canonical CBOR encoding of ``value``."""
    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


class BlockHasher:
    """Hashes full token blocks into a prefix chain.

    ``none_hash`` is the parent of a request's first block; it is derived from ``seed``
    so that every process with the same seed agrees on every hash.
    """

    def __init__(self, seed: str = DEFAULT_HASH_SEED) -> None:
        if not isinstance(seed, str):
            raise TypeError(f"hash seed must be a str, got {seed!r}")
        self.seed = seed
        self.none_hash = sha256_cbor(seed)

    def hash_block(
        self,
        parent_hash: bytes | None,
        token_ids: Sequence[int],
        extra_keys: tuple[Any, ...] | None = None,
    ) -> bytes:
        """The hash of one block given its parent's hash (``None`` for the first)."""
        parent = self.none_hash if parent_hash is None else parent_hash
        return sha256_cbor((parent, tuple(token_ids), extra_keys))

    def hash_request(
        self,
        token_ids: Sequence[int],
        block_size: int,
        extra_keys: tuple[Any, ...] | None = None,
        parent_hash: bytes | None = None,
    ) -> list[bytes]:
        """Hashes of the full blocks of ``token_ids``; a trailing partial block is left out.

        ``extra_keys`` (e.g. a LoRA name or multimodal hashes) is mixed into every block.
        ``parent_hash`` continues an existing chain.
        """
        positive_int("block_size", block_size)
        hashes: list[bytes] = []
        parent = parent_hash
        for start in range(0, len(token_ids) - block_size + 1, block_size):
            parent = self.hash_block(parent, token_ids[start : start + block_size], extra_keys)
            hashes.append(parent)
        return hashes


def hash_request(
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: tuple[Any, ...] | None = None,
    seed: str = DEFAULT_HASH_SEED,
) -> list[bytes]:
    """Hashes of the full blocks of ``token_ids`` with a ``BlockHasher(seed)``."""
    return BlockHasher(seed).hash_request(token_ids, block_size, extra_keys)
