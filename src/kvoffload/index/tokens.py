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
* Keys are Python's 64-bit hash of ``(parent, tokens, extra)``, so a collision (about one
  in 2**64 per lookup) could name a wrong hash; a wrong hash can only make a block look
  held when it is not. Memory is bounded: two generations of at most ``capacity / 2``
  entries each; the oldest generation is dropped when the newest fills.
* ``block_sizes`` lists the block sizes events were learned at (a tier offloading several
  device blocks as one announces at a multiple of the device block size).
* Re-announcements are cheap: an event without ``extra_keys`` whose hashes the newest
  generation already learned at that block size teaches nothing new (a chained hash names
  its parent and tokens) and is skipped after one set check (returns 0); anything else is
  learned again, which also moves entries of the oldest generation into the newest.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from msgspec import Raw

from kvoffload.index.wire import token_list
from kvoffload.validation import positive_int

DEFAULT_CAPACITY = 4_000_000


def _key(parent: int | None, tokens: tuple, extra: Any) -> int:
    try:
        return hash((parent, tokens, extra))
    except TypeError:  # extra keys decoded as lists (multimodal pairs) are unhashable
        return hash((parent, tokens, repr(extra)))


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
        if seen is not None and all(map(seen.__contains__, hashes)):  # stops at the first new one
            return 0  # the newest generation has every block of it already
        tokens = token_list(token_ids)
        if tokens is None or len(tokens) != block_size * len(hashes):
            return 0
        if block_size not in self.block_sizes:
            self.block_sizes[block_size] = None
        if seen is None:
            seen = self._seen.setdefault(block_size, set())
        new = self._new
        start = 0
        for i, h in enumerate(hashes):
            end = start + block_size
            key = _key(parent, tuple(tokens[start:end]), None if extra_keys is None else extra_keys[i])
            before = new.get(key)
            if before is not None and before != h:
                seen.discard(before)  # another hash function's chain took this key over
            new[key] = h
            parent = h
            start = end
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
        parent: int | None = None
        tokens = tuple(token_ids)  # one conversion; each block is then a tuple slice
        ends = range(block_size, len(tokens) + 1, block_size)
        if extra is None:
            # ``_key`` inlined: this loop runs once per block of every /query.
            get = new.get
            for end in ends:
                key = hash((parent, tokens[end - block_size : end], None))
                h = get(key)
                if h is None:
                    h = old.get(key)
                    if h is None:
                        break
                out.append(h)
                parent = h
            return out
        for i, end in enumerate(ends):
            key = _key(parent, tokens[end - block_size : end], extra(i))
            h = new.get(key)
            if h is None:
                h = old.get(key)
                if h is None:
                    break
            out.append(h)
            parent = h
        return out

    def clear(self) -> None:
        self._new.clear()
        self._old.clear()
        self._seen.clear()
        self.block_sizes.clear()
