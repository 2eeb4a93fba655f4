"""KV events for SGLang's pages in kvoffload's tiers (SGLang publishes none for its L3).

A tier's ``OffloadingEvent`` becomes one wire event per tier and kind, as the vLLM
connector's tiers send theirs (``kvoffload.scheduler.events.WIRE_TIERS``): the disk tier
``medium="STORAGE"``, ``locality="LOCAL"``; the Redis and Mooncake tiers
``locality="REMOTE"`` with their ``ownership``.

Keys: a page's block hash on the wire is the unsigned 64-bit form of the first 16 hex
digits of SGLang's page key (``sglang_hash``): the bits SGLang's own device and host
events carry (``hash_str_to_int64``, a signed int64 there; the wire format here is
unsigned), so a router indexing an SGLang replica's events finds its pages in every tier
under one hash. ``BlockStored`` carries ``block_size`` (the page size), ``parent_block_hash``
where the page's parent is known (the previous page of the chain its store named, kept
while the page is held: ``remember``), and no ``token_ids``: SGLang hands a storage backend
page keys, not tokens. Removals are announced for the keys the tier announced stored.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvoffload.events.types import BlockRemoved, BlockStored, KVEvent
from kvoffload.keys import OffloadKey
from kvoffload.manager import OffloadingEvent
from kvoffload.scheduler.events import WIRE_TIERS

_PARENTS_KEPT = 1 << 20  # parents remembered at most (the oldest forgotten first)


def sglang_hash(key: OffloadKey) -> int:
    """The wire hash of a page key: its first 8 bytes, unsigned (SGLang's
    ``hash_str_to_int64`` of the hex key, modulo 2**64)."""
    return int.from_bytes(key[:8], "big")


class PageEvents:
    """Converts tier events of pages of ``page_size`` tokens into wire events."""

    def __init__(self, page_size: int, media: Sequence[str]) -> None:
        self.page_size = page_size
        self.media = list(media)  # per tier index, the tier's medium
        self._parents: OrderedDict[OffloadKey, OffloadKey] = OrderedDict()

    def remember(self, keys: Sequence[OffloadKey], parent: OffloadKey | None) -> None:
        """``keys`` are one chain whose first page follows ``parent`` (None: the first)."""
        parents = self._parents
        for key in keys:
            if parent is not None:
                parents[key] = parent
                parents.move_to_end(key)
            parent = key
        while len(parents) > _PARENTS_KEPT:
            parents.popitem(last=False)

    def convert(self, events: Sequence[tuple[int, OffloadingEvent]]) -> list[KVEvent]:
        wire: list[KVEvent] = []
        for tier, event in events:
            if not event.keys:
                continue
            medium, locality, ownership = WIRE_TIERS.get(self.media[tier], (self.media[tier], None, None))
            hashes = [sglang_hash(key) for key in event.keys]
            if event.removed:
                for key in event.keys:
                    self._parents.pop(key, None)
                wire.append(BlockRemoved(hashes, medium, locality=locality, ownership=ownership))
                continue
            # one event per run whose pages chain one to the next (a parent is the page before)
            start = 0
            for i in range(1, len(event.keys) + 1):
                if i < len(event.keys) and self._parents.get(event.keys[i]) == event.keys[i - 1]:
                    continue
                parent = self._parents.get(event.keys[start])
                wire.append(
                    BlockStored(
                        hashes[start:i],
                        None if parent is None else sglang_hash(parent),
                        [],
                        self.page_size,
                        None,
                        medium,
                        None,
                        locality=locality,
                        ownership=ownership,
                    )
                )
                start = i
        return wire
