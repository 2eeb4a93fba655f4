"""Block hashes learned from the token ids that self-describing ``BlockStored`` events carry.

An engine's block hashes depend on its hash function, seed and extra keys (LoRA adapter,
cache salt), which a router cannot always reproduce. Events that carry ``token_ids`` and
``parent_block_hash`` say, for each block, which hash the engine gave a (parent, tokens)
pair; replaying that chain on a prompt's tokens finds the engine's hashes for it.

Contract:

* ``learn(parent, token_ids, block_size, hashes, extra_keys)`` records one event's chain
  (``token_ids`` a list, or still msgpack: ``kvoffload.index.wire``):
  block ``i`` has tokens ``token_ids[i*block_size:(i+1)*block_size]``, parent
  ``hashes[i-1]`` (``parent`` for the first) and extra keys ``extra_keys[i]`` (vLLM's
  untagged per-block values: LoRA name, cache salt on the first block). Events whose token
  count is not ``block_size * len(hashes)`` (or whose encoded token ids are not a list of
  ints) teach nothing (returns 0).
* ``chain(token_ids, block_size, extra)`` walks a prompt's full blocks of ``block_size``
  and returns the known hashes of its leading blocks, stopping at the first unknown one.
  ``extra(i)`` gives block ``i``'s extra keys as the engine would have published them.
* Keys are 64-bit: a mix of the block's tokens (numpy, every block of an event or a
  prompt at once), XORed with the parent hash times an odd constant and with the extra
  keys' Python hash. Not collision resistant against chosen prompts (neither was Python's
  tuple hash): a collision (about one in 2**64 per lookup for ordinary prompts) could
  name a wrong hash, which can only make a block look held when it is not.
* Memory is bounded: two generations of at most ``capacity / 2`` entries each; the
  oldest generation is dropped when the newest fills.
* ``block_sizes`` lists the block sizes events were learned at (a tier offloading several
  device blocks as one announces at a multiple of the device block size).
* Re-announcements are cheap: an event without ``extra_keys`` whose hashes the newest
  generation already learned at that block size teaches nothing new (a chained hash names
  its parent and tokens) and is skipped after one set check (returns 0); anything else is
  learned again, which also moves entries of the oldest generation into the newest.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from msgspec import Raw

from kvoffload.index.wire import token_list
from kvoffload.validation import positive_int

DEFAULT_CAPACITY = 4_000_000


_M64 = (1 << 64) - 1
_PARENT = 0x9E3779B97F4A7C15  # odd: parent * _PARENT is a bijection of the parent
_ROOT = 0x6A09E667F3BCC909  # the parent term of a first block (no parent)
_EXTRA = 0xC2B2AE3D27D4EB4F
_MIX = (np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB))
_WEIGHTS: dict[int, np.ndarray] = {}  # per block size, one odd multiplier per position


def _weights(block_size: int) -> np.ndarray:
    w = _WEIGHTS.get(block_size)
    if w is None:
        rng = np.random.default_rng(block_size)
        w = _WEIGHTS[block_size] = rng.integers(0, 2**63, block_size, dtype=np.uint64) * np.uint64(2) + 1
    return w


def _digests(tokens: Sequence[int], block_size: int, blocks: int) -> np.ndarray:
    """One well-mixed u64 per block of ``block_size`` tokens (numpy, all blocks at once)."""
    n = blocks * block_size
    try:
        flat = np.frombuffer(array("Q", tokens[:n] if len(tokens) != n else tokens), dtype=np.uint64)
    except (OverflowError, TypeError):
        flat = np.array([t & _M64 for t in tokens[:n]], dtype=np.uint64)
    x = flat.reshape(blocks, block_size) * _weights(block_size)
    x ^= x >> np.uint64(29)
    x *= _MIX[0]
    s = x.sum(axis=1, dtype=np.uint64)
    s ^= s >> np.uint64(32)
    s *= _MIX[1]
    s ^= s >> np.uint64(29)
    return s


def _extra_term(extra: Any) -> int:
    if extra is None:
        return 0
    try:
        h = hash(extra)
    except TypeError:  # extra keys decoded as lists (multimodal pairs) are unhashable
        h = hash(repr(extra))
    return ((h & _M64) * _EXTRA + 1) & _M64


class TokenChains:
    """Learned ``(parent, block tokens, extra keys) -> block hash`` (see module doc)."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        positive_int("token_chain_capacity", capacity)
        self._half = max(1, capacity // 2)
        self._new: dict[int, int] = {}
        self._old: dict[int, int] = {}
        # Per block size, the hashes learned into ``_new`` from events without extra keys.
        self._seen: dict[int, set[int]] = {}
        self.block_sizes: dict[int, None] = {}  # ordered set

    def __len__(self) -> int:
        return len(self._new) + len(self._old)

    def learn(
        self,
        parent: int | None,
        token_ids: Sequence[int] | Raw,
        block_size: int,
        hashes: Sequence[int],
        extra_keys: Sequence[Any] | None,
    ) -> int:
        if block_size <= 0 or not hashes:
            return 0
        if extra_keys is not None and len(extra_keys) != len(hashes):
            return 0
        seen = self._seen.get(block_size) if extra_keys is None else None
        if seen is not None and seen.issuperset(hashes):
            return 0  # the newest generation has every block of it already
        tokens = token_list(token_ids)
        if tokens is None or len(tokens) != block_size * len(hashes):
            return 0
        if block_size not in self.block_sizes:
            self.block_sizes[block_size] = None
        if seen is None:
            seen = self._seen.setdefault(block_size, set())
        n = len(hashes)
        terms = np.empty(n, dtype=np.uint64)
        terms[0] = _ROOT if parent is None else (parent * _PARENT) & _M64
        if n > 1:
            terms[1:] = np.array(hashes[:-1], dtype=np.uint64) * np.uint64(_PARENT)
        terms ^= _digests(tokens, block_size, n)
        if extra_keys is not None:
            terms ^= np.array([_extra_term(e) for e in extra_keys], dtype=np.uint64)
        keys = terms.tolist()
        new = self._new
        for before, h in zip(list(map(new.get, keys)), hashes):
            if before is not None and before != h:
                seen.discard(before)  # another hash function's chain took this key over
        new.update(zip(keys, hashes))
        if extra_keys is None:
            seen.update(hashes)
        if len(new) >= self._half:
            self._old = new
            self._new = {}
            self._seen = {}
        return len(hashes)

    def chain(
        self, token_ids: Sequence[int], block_size: int, extra: Callable[[int], Any] | None = None
    ) -> list[int]:
        new, old = self._new, self._old
        out: list[int] = []
        blocks = len(token_ids) // block_size
        if not blocks or not (new or old):
            return out
        digests = _digests(token_ids, block_size, blocks).tolist()
        term = _ROOT
        for i, digest in enumerate(digests):
            key = term ^ digest ^ (_extra_term(extra(i)) if extra else 0)
            h = new.get(key)
            if h is None:
                h = old.get(key)
                if h is None:
                    break
            out.append(h)
            term = (h * _PARENT) & _M64
        return out

    def clear(self) -> None:
        self._new.clear()
        self._old.clear()
        self._seen.clear()
        self.block_sizes.clear()
