"""Conversion of a tier's ``OffloadingEvent``s into wire KV events.

Only the scheduler knows, for a key, its KV-cache group, its tokens and its parent, so it
records that (``remember``) when it reserves the store, and this converter fills
``block_size`` from the key's group when the tier announces the key:

* ``BlockStored``: ``block_hashes`` are ``external_hash`` values, ``group_idx`` and
  ``block_size`` (device block size x blocks per offloaded block) from the key's group,
  ``medium`` from the tier. In ``self_describing`` mode (default) it also carries
  ``token_ids`` and ``parent_block_hash`` so routers that re-hash tokens can index it;
  consecutive keys of one chain are announced in one event. ``placeholder`` mode emits
  vLLM's own offloading form: ``block_size=0``, no tokens, no parent.
  Self-described events also carry what besides tokens went into the hashes, as vLLM
  0.32's engine publishes it for its own blocks: ``extra_keys``, one untagged entry per
  block (``kvoffload.keys.event_extra_keys``: LoRA name, ``(mm identifier, offset)``
  pairs, the cache salt on the first block; ``None`` for a block without any), left out
  when no block of the event has any; and ``lora_name`` for an adapter's blocks.
* ``BlockRemoved`` for every eviction, one event per group.
* ``AllBlocksCleared`` when the scheduler resets the tier.

Tiers: a record stays while its key is in the primary (CPU) tier, so the secondary tiers
it is written through to (which copy it while the primary holds it pinned) announce it
self-described too; it is dropped when the primary drops the key. A key announced with no
record (e.g. a block promoted from below after a restart) gets the placeholder form.
Secondary media go on the wire as vLLM 0.32 names them (``WIRE_TIERS``): the local-disk
tier is ``medium="STORAGE"``, ``locality="LOCAL"`` (no ownership); the shared Redis tier
``medium="STORAGE"``, ``locality="REMOTE"``, ``ownership="redis"``; the Mooncake tier the same
with ``ownership="mooncake"``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvoffload.events.types import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kvoffload.keys import GROUP_BYTES, OffloadKey, event_extra_keys, external_hash
from kvoffload.manager import OffloadingEvent
from kvoffload.scheduler.types import KVGroup

EVENT_MODES = ("self_describing", "placeholder")

# tier medium -> (wire medium, locality, ownership); media not listed go out unchanged
WIRE_TIERS: dict[str, tuple[str, str | None, str | None]] = {
    # no ownership: as vLLM 0.32's own fs tier sends them (and as Dynamo's indexer, which
    # drops events that carry one, indexes them: tests/index/test_dynamo_tiers.py)
    "DISK": ("STORAGE", "LOCAL", None),
    "REMOTE": ("STORAGE", "REMOTE", "redis"),
    "MOONCAKE": ("STORAGE", "REMOTE", "mooncake"),
}


# What a stored key's BlockStored says is kept as a plain tuple (parent block hash or
# None, the request's token sequence, start, end, extra keys in tagged form or None): one
# is recorded per stored block on the scheduler's thread, so it allocates nothing more;
# tokens are sliced when announced.
_Record = tuple[bytes | None, Sequence[int], int, int, "tuple[Any, ...] | None"]
_UNKNOWN: _Record = (None, (), 0, 0, None)


class EventConverter:
    """Turns tier events into wire events, using what the scheduler remembered per key."""

    def __init__(
        self,
        groups: Sequence[KVGroup],
        blocks_per_offload_block: int,
        mode: str = "self_describing",
        primary_medium: str = "CPU",
    ):
        if mode not in EVENT_MODES:
            raise ValueError(f"kv_events must be one of {EVENT_MODES}, got {mode!r}")
        self.mode = mode
        self.primary_medium = primary_medium
        self._groups = list(groups)
        self._factor = blocks_per_offload_block
        self._pending: dict[OffloadKey, _Record] = {}

    def remember(
        self,
        key: OffloadKey,
        parent_hash: bytes | None,
        tokens: Sequence[int],
        start: int,
        end: int,
        extra_keys: tuple[Any, ...] | None = None,
    ) -> None:
        """Record what a key's ``BlockStored`` must say, before its store completes: its
        tokens are ``tokens[start:end]``, a range the engine never rewrites, and
        ``extra_keys`` (tagged, as hashed) the rest of what its hash covers."""
        self._pending[key] = (parent_hash, tokens, start, end, extra_keys)

    def knows(self, key: OffloadKey) -> bool:
        return key in self._pending

    def forget(self, keys: Sequence[OffloadKey]) -> None:
        """Drop records of keys whose store failed (they are never announced)."""
        for key in keys:
            self._pending.pop(key, None)

    def clear(self) -> None:
        self._pending.clear()

    def convert(self, events: Sequence[OffloadingEvent]) -> list[KVEvent]:
        out: list[KVEvent] = []
        for event in events:
            if event.removed:
                out.extend(self._removed(event))
            else:
                out.extend(self._stored(event))
        return out

    def cleared(self) -> AllBlocksCleared:
        return AllBlocksCleared()

    def _removed(self, event: OffloadingEvent) -> list[BlockRemoved]:
        if event.medium == self.primary_medium:
            pending = self._pending
            for key in event.keys:
                pending.pop(key, None)
        medium, locality, ownership = WIRE_TIERS.get(event.medium, (event.medium, None, None))
        by_group: dict[int, list[int]] = {}
        for key in event.keys:
            group, block_hash = _split(key)
            by_group.setdefault(group, []).append(external_hash(block_hash))
        return [
            BlockRemoved(hashes, medium, group_idx=group, locality=locality, ownership=ownership)
            for group, hashes in by_group.items()
        ]

    def _stored(self, event: OffloadingEvent) -> list[BlockStored]:
        out: list[BlockStored] = []
        run: list[tuple[bytes, tuple]] = []
        run_group = -1
        pending = self._pending
        wire = WIRE_TIERS.get(event.medium, (event.medium, None, None))
        for key in event.keys:
            group, block_hash = _split(key)
            info = pending.get(key, _UNKNOWN)
            # a run continues with the next block of a chain (its parent is the previous
            # block), or with another block of no record (announced as placeholders)
            if info is _UNKNOWN:
                chained = run and group == run_group and run[-1][1] is _UNKNOWN
            else:
                chained = run and group == run_group and info[0] == run[-1][0]
            if run and not chained:
                out.append(self._stored_event(run, run_group, wire))
                run = []
            run.append((block_hash, info))
            run_group = group
        if run:
            out.append(self._stored_event(run, run_group, wire))
        return out

    def _stored_event(
        self, run: list[tuple[bytes, tuple]], group: int, wire: tuple[str, str | None, str | None]
    ) -> BlockStored:
        medium, locality, ownership = wire
        spec = self._groups[group] if group < len(self._groups) else None
        hashes = [external_hash(h) for h, _ in run]
        if self.mode == "placeholder" or spec is None or run[0][1] is _UNKNOWN:
            return BlockStored(
                hashes,
                None,
                [],
                0,
                None,
                medium,
                None,
                group_idx=group,
                locality=locality,
                ownership=ownership,
            )
        first_parent = run[0][1][0]
        tokens = [t for _, info in run for t in info[1][info[2] : info[3]]]
        extra = [event_extra_keys(info[4]) for _, info in run]
        return BlockStored(
            block_hashes=hashes,
            parent_block_hash=None if first_parent is None else external_hash(first_parent),
            token_ids=tokens,
            block_size=spec.block_size * self._factor,
            lora_id=None,
            medium=medium,
            lora_name=_lora_name(run[0][1][4]),
            extra_keys=extra if any(e is not None for e in extra) else None,
            group_idx=group,
            kv_cache_spec_kind=spec.kind,
            kv_cache_spec_sliding_window=spec.sliding_window,
            locality=locality,
            ownership=ownership,
        )


def _lora_name(extra_keys: tuple[Any, ...] | None) -> str | None:
    # a chain's blocks share the adapter (it is in every block's hash), so the first tells
    for key in extra_keys or ():
        if key[0] == "lora":
            return key[1]
    return None


def _split(key: OffloadKey) -> tuple[int, bytes]:
    return int.from_bytes(key[-GROUP_BYTES:], "big"), key[:-GROUP_BYTES]
