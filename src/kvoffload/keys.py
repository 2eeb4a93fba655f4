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
* Extra keys keep tenants apart. vLLM 0.32 mixes into a block's hash, in this order, a
  LoRA adapter (``("lora", name, path)``, every block), the multimodal items the block
  overlaps (``("mm", identifier, item_offset - block_start)``) and the request's cache
  salt (``("cache_salt", salt)``, first block only); a block with none hashes ``None``.
  ``block_extra_keys`` builds that tuple and ``hash_request(..., cache_salt=, lora_name=,
  lora_path=, mm_features=)`` uses it per block, so two requests with the same tokens and
  another salt or adapter never share a hash. ``event_extra_keys`` gives the untagged form
  KV events carry (salt and LoRA name bare, ``(identifier, offset)`` for an item).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, NewType

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


class MMPlaceholder(NamedTuple):
    """A multimodal item in a prompt: its hash ``identifier`` (vLLM's ``mm_hash``) and the
    token positions ``[offset, offset + length)`` its placeholder occupies."""

    identifier: str
    offset: int
    length: int


ExtraKeysOf = Callable[[int, int], "tuple[Any, ...] | None"]


def block_extra_keys(
    start: int,
    end: int,
    *,
    cache_salt: str | None = None,
    lora_name: str | None = None,
    lora_path: str | None = None,
    mm_features: Sequence[MMPlaceholder | tuple[str, int, int]] = (),
) -> tuple[Any, ...] | None:
    """The extra keys vLLM 0.32 hashes with the block of tokens ``[start, end)``.

    ``mm_features`` are sorted by offset. vLLM hashes an adapter's path with its name (a
    name pointed at other weights must not reuse KV), so ``lora_name`` needs ``lora_path``.
    """
    if (lora_name is None) != (lora_path is None):
        raise ValueError(
            f"lora_name and lora_path go together (vLLM hashes both), got {lora_name!r}, {lora_path!r}"
        )
    keys: list[tuple[Any, ...]] = []
    if lora_name is not None:
        keys.append(("lora", lora_name, lora_path))
    for identifier, offset, length in mm_features:
        if offset >= end:
            break
        if start >= offset + length:
            continue  # the item ended before this block
        keys.append(("mm", identifier, offset - start))
        if offset + length > end:
            break  # the item runs on into the next block
    if cache_salt and start == 0:
        keys.append(("cache_salt", cache_salt))
    return tuple(keys) if keys else None


def event_extra_keys(keys: tuple[Any, ...] | None) -> tuple[Any, ...] | None:
    """One block's extra keys in the untagged form ``BlockStored.extra_keys`` carries."""
    if keys is None:
        return None
    return tuple(key[1:] if key[0] == "mm" else key[1] for key in keys)


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
        *,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        lora_path: str | None = None,
        mm_features: Sequence[MMPlaceholder | tuple[str, int, int]] = (),
        start_token: int = 0,
    ) -> list[bytes]:
        """Hashes of the full blocks of ``token_ids``; a trailing partial block is left out.

        ``cache_salt``, ``lora_name``/``lora_path`` and ``mm_features`` give each block the
        extra keys vLLM 0.32 gives it (``block_extra_keys``); ``extra_keys`` instead mixes
        one fixed tuple into every block (not both). ``parent_hash`` continues an existing
        chain whose next block starts at token ``start_token`` of the request.
        """
        if extra_keys is not None and (cache_salt or lora_name is not None or mm_features):
            raise ValueError("give either extra_keys or cache_salt/lora_name/mm_features, not both")
        features = [MMPlaceholder(*f) for f in mm_features]

        def keys_of(start: int, end: int) -> tuple[Any, ...] | None:
            return block_extra_keys(
                start, end, cache_salt=cache_salt, lora_name=lora_name, lora_path=lora_path,
                mm_features=features,
            )  # fmt: skip

        fixed = extra_keys is not None or not (cache_salt or lora_name is not None or features)
        return self.hash_chain(
            token_ids, block_size, (lambda s, e: extra_keys) if fixed else keys_of, parent_hash, start_token
        )

    def hash_chain(
        self,
        token_ids: Sequence[int],
        block_size: int,
        extra_keys_of: ExtraKeysOf | None = None,
        parent_hash: bytes | None = None,
        start_token: int = 0,
    ) -> list[bytes]:
        """``hash_request`` with each block's extra keys from ``extra_keys_of(start, end)``
        (token positions in the request: ``token_ids[0]`` is token ``start_token``)."""
        positive_int("block_size", block_size)
        if not isinstance(start_token, int) or start_token < 0:
            raise ValueError(f"start_token must be an int >= 0, got {start_token!r}")
        hashes: list[bytes] = []
        parent = parent_hash
        for start in range(0, len(token_ids) - block_size + 1, block_size):
            first = start_token + start
            extra = None if extra_keys_of is None else extra_keys_of(first, first + block_size)
            parent = self.hash_block(parent, token_ids[start : start + block_size], extra)
            hashes.append(parent)
        return hashes


def hash_request(
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: tuple[Any, ...] | None = None,
    seed: str = DEFAULT_HASH_SEED,
    **per_block: Any,
) -> list[bytes]:
    """Hashes of the full blocks of ``token_ids`` with a ``BlockHasher(seed)``;
    ``per_block``: ``cache_salt``, ``lora_name``, ``lora_path``, ``mm_features``."""
    return BlockHasher(seed).hash_request(token_ids, block_size, extra_keys, **per_block)
