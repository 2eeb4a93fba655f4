"""``BlockKeys``: the block arithmetic of one engine's KV-cache groups.

Group ``g`` has offloaded blocks of ``tokens[g]`` tokens; the engine's chained hashes are
of ``hash_block_size``-token blocks, so offloaded block ``j`` of ``g`` is keyed by the
hash that ends at token ``(j + 1) * tokens[g]`` and by ``g``. Requests whose engine does
not hash are hashed here (tokens and ``extra_keys``). Device blocks equal to
``null_block_id`` (sliding-window positions outside the window) are skipped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import repeat
from typing import Any

import numpy as np

from kvoffload.keys import GROUP_BYTES, BlockHasher, OffloadKey, make_offload_key
from kvoffload.scheduler.types import RequestView
from kvoffload.specs import DeviceLoadStoreSpec

ExtraKeys = Callable[[Any, int, int], "tuple[Any, ...] | None"]


def device_spec(block_ids: list[int], sizes: list[int], indices: list[int]) -> DeviceLoadStoreSpec:
    """``DeviceLoadStoreSpec(block_ids, sizes, indices)`` without its checks of outside
    input (20-50 us, most of a one-block store's planning on the engine's step): the
    scheduler's own lists are non-negative ints whose sizes add up to the ids."""
    spec = DeviceLoadStoreSpec.__new__(DeviceLoadStoreSpec)
    spec.block_ids = np.array(block_ids, dtype=np.int64)
    spec.group_sizes = np.array(sizes, dtype=np.int64)
    spec.block_indices = np.array(indices, dtype=np.int64)
    return spec


class BlockKeys:
    def __init__(
        self,
        tokens: Sequence[int],
        hash_block_size: int,
        hasher: BlockHasher,
        extra_keys: ExtraKeys,
        null_block_id: int | None,
    ) -> None:
        self.tokens = list(tokens)
        self.hash_block_size = hash_block_size
        self.null_block_id = null_block_id
        self._hasher = hasher
        self._extra_keys = extra_keys

    def hashes(self, request: RequestView) -> Sequence[bytes]:
        hashes = request.block_hashes
        if hashes is None:  # an engine that does not hash: hash the tokens ourselves
            hashes = self._hasher.hash_chain(
                request.all_token_ids, self.hash_block_size, lambda s, e: self._extra_keys(request, s, e)
            )
        return hashes

    def first_present(self, device_ids: Sequence[int], start: int, end: int) -> int:
        """The first index in ``[start, end)`` whose device block is not the null block."""
        while start < end and start < len(device_ids) and device_ids[start] == self.null_block_id:
            start += 1
        return start

    def num_full(self, hashes: Sequence[bytes], g: int) -> int:
        """How many whole offloaded blocks of group ``g`` the hashed tokens make."""
        return len(hashes) * self.hash_block_size // self.tokens[g]

    def hash_at(self, hashes: Sequence[bytes], g: int, j: int) -> bytes:
        return hashes[(j + 1) * self.tokens[g] // self.hash_block_size - 1]

    def request_keys(
        self, known: list[OffloadKey], hashes: Sequence[bytes], g: int, start: int, end: int
    ) -> list[OffloadKey]:
        """Keys of blocks ``[start, end)`` of group ``g``; ``known`` (the request's keys of
        ``g`` from block 0, extended here) makes each once: a request's hashes only grow."""
        if len(known) < end:
            known += self.keys(hashes, g, len(known), end)
        return known[start:end]

    def keys(self, hashes: Sequence[bytes], g: int, start: int, end: int) -> list[OffloadKey]:
        step = self.tokens[g] // self.hash_block_size
        if start >= end:
            return []
        # ``make_offload_key`` once, for its checks and the group suffix; the rest append
        # the same suffix (``OffloadKey`` is ``bytes`` at run time) in one C loop. A
        # request's keys are made on the engine's step, once each.
        first = make_offload_key(hashes[(start + 1) * step - 1], g)
        suffix = first[-GROUP_BYTES:]
        rest = hashes[(start + 2) * step - 1 : end * step : step]
        try:
            return [first, *map(bytes.__add__, rest, repeat(suffix))]
        except TypeError:  # hashes that are not ``bytes`` (e.g. ``bytearray``)
            return [first] + [bytes(h) + suffix for h in rest]
