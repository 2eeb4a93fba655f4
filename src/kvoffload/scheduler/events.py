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
  An event whose keys are each a run of one block (a decode step's blocks of many requests)
  is converted in one pass with its hashes read as arrays, into exactly the events of
  finding its runs one by one (``one_block_runs = False`` keeps that path;
  ``tests/scheduler/test_event_runs.py`` compares them).
* ``BlockRemoved`` for every eviction, one event per group.
* ``AllBlocksCleared`` when the scheduler resets the tier.

Tiers: a record stays while its key is in the primary (CPU) tier, so the secondary tiers
it is written through to (which copy it while the primary holds it pinned) announce it
self-described too; it is dropped when the primary drops the key. A key announced with no
record (e.g. a block promoted from below after a restart) gets the placeholder form.
Secondary media go on the wire as vLLM 0.32 names them (``WIRE_TIERS``): the local-disk
tier is ``medium="STORAGE"``, ``locality="LOCAL"`` (no ownership); the shared Redis tier
``medium="STORAGE"``, ``locality="REMOTE"``, ``ownership="redis"``; the Mooncake tier the same
with ``ownership="mooncake"``, the object-storage tier with ``ownership="s3"``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import repeat
from operator import eq, is_, itemgetter, ne
from typing import Any

import numpy as np

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
    "OBJECT": ("STORAGE", "REMOTE", "s3"),
}


# What a stored key's BlockStored says is kept as a plain tuple (parent block hash or
# None, the request's token sequence, start, end, extra keys in tagged form or None): one
# is recorded per stored block on the scheduler's thread, so it allocates nothing more;
# tokens are sliced when announced.
_Record = tuple[bytes | None, Sequence[int], int, int, "tuple[Any, ...] | None"]
_UNKNOWN: _Record = (None, (), 0, 0, None)
_PARENT = itemgetter(0)
_EXTRA = itemgetter(4)


class EventConverter:
    """Turns tier events into wire events, using what the scheduler remembered per key."""

    def __init__(
        self,
        groups: Sequence[KVGroup],
        blocks_per_offload_block: int,
        mode: str = "self_describing",
        primary_medium: str = "CPU",
        classes: Mapping[type, type] | None = None,
    ):
        """``classes``: the types to build instead of ``BlockStored``, ``BlockRemoved`` and
        ``AllBlocksCleared`` (an engine's own, taking the same fields positionally)."""
        if mode not in EVENT_MODES:
            raise ValueError(f"kv_events must be one of {EVENT_MODES}, got {mode!r}")
        self.mode = mode
        self.primary_medium = primary_medium
        self._groups = list(groups)
        self._factor = blocks_per_offload_block
        self._pending: dict[OffloadKey, _Record] = {}
        # False: every event's runs found and built one by one (the reference path)
        self.one_block_runs = True
        classes = classes or {}
        self._stored_type = classes.get(BlockStored, BlockStored)
        self._removed_type = classes.get(BlockRemoved, BlockRemoved)
        self._cleared_type = classes.get(AllBlocksCleared, AllBlocksCleared)

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

    def remember_all(self, keys: Sequence[OffloadKey], records: Sequence[_Record]) -> None:
        """``remember`` of each key, its arguments as one tuple each, in one call."""
        self._pending.update(zip(keys, records))

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
        return self._cleared_type()

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
        removed = self._removed_type
        return [removed(hashes, medium, group, locality, ownership) for group, hashes in by_group.items()]

    def _stored(self, event: OffloadingEvent) -> list[BlockStored]:
        keys = event.keys
        pending = self._pending
        infos = list(map(pending.get, keys, repeat(_UNKNOWN)))
        wire = WIRE_TIERS.get(event.medium, (event.medium, None, None))
        if (
            self.one_block_runs
            and len(keys) > 1
            and self.mode == "self_describing"
            and not any(map(is_, infos, repeat(_UNKNOWN)))
        ):
            out = self._one_block_events(keys, infos, wire)
            if out is not None:
                return out
        out = []
        run: list[tuple[bytes, tuple]] = []
        run_group = b""  # the group suffix of the run's keys
        for key, info in zip(keys, infos):
            group = key[-GROUP_BYTES:]
            block_hash = key[:-GROUP_BYTES]
            # a run continues with the next block of a chain (its parent is the previous
            # block), or with another block of no record (announced as placeholders)
            if run and (
                group != run_group
                or (run[-1][1] is not _UNKNOWN if info is _UNKNOWN else info[0] != run[-1][0])
            ):
                out.append(self._stored_event(run, int.from_bytes(run_group, "big"), wire))
                run = []
            run.append((block_hash, info))
            run_group = group
        if run:
            out.append(self._stored_event(run, int.from_bytes(run_group, "big"), wire))
        return out

    def _one_block_events(
        self, keys: Sequence[OffloadKey], infos: list[_Record], wire: tuple[str, str | None, str | None]
    ) -> list[BlockStored] | None:
        """``_stored_event`` of each key's run of one block (a decode step's blocks of many
        requests), with the hashes read as arrays; ``None`` (for the general pass) unless
        every key is one of a known group and no key's parent may be the key before it."""
        count, size = len(keys), len(keys[0])
        rows = _rows(keys, size)
        if rows is None or size < GROUP_BYTES + 8 or (rows[:, -GROUP_BYTES:] != rows[0, -GROUP_BYTES:]).any():
            return None
        group = int.from_bytes(keys[0][-GROUP_BYTES:], "big")
        if group >= len(self._groups):
            return None
        spec = self._groups[group]
        hashes = _low64(rows, size - GROUP_BYTES)  # (``external_hash``: the low 64 bits)
        parents = list(map(_PARENT, infos))
        rows = None if any(map(is_, parents, repeat(None))) else _rows(parents, len(parents[0]))
        if rows is not None and len(parents[0]) >= 8:
            parents = _low64(rows, len(parents[0]))
        else:
            parents = [None if p is None else int.from_bytes(p[-8:], "big") for p in parents]
        if any(map(eq, parents[1:], hashes)):  # perhaps the next block of a chain
            return None
        tokens = [t[start:end] for _, t, start, end, _ in infos]
        if not all(map(is_, map(type, tokens), repeat(list))):
            tokens = [t if type(t) is list else list(t) for t in tokens]
        extra_keys = list(map(_EXTRA, infos))
        if extra_keys.count(None) == count:
            loras = extras = repeat(None)
        else:
            loras = map(_lora_name, extra_keys)
            extras = [None if e is None else [event_extra_keys(e)] for e in extra_keys]
        return list(
            map(
                self._stored_type,
                [[h] for h in hashes],
                parents,
                tokens,
                repeat(spec.block_size * self._factor),
                repeat(None),
                repeat(wire[0]),
                loras,
                extras,
                repeat(group),
                repeat(spec.kind),
                repeat(spec.sliding_window),
                repeat(wire[1]),
                repeat(wire[2]),
            )
        )

    def _stored_event(
        self, run: list[tuple[bytes, tuple]], group: int, wire: tuple[str, str | None, str | None]
    ) -> BlockStored:
        medium, locality, ownership = wire
        spec = self._groups[group] if group < len(self._groups) else None
        # (``external_hash``: the low 64 bits of each hash)
        hashes = [int.from_bytes(h[-8:], "big") for h, _ in run]
        first = run[0][1]
        if self.mode == "placeholder" or spec is None or first is _UNKNOWN:
            return self._stored_type(
                hashes, None, [], 0, None, medium, None, None, group, None, None, locality, ownership
            )
        parent, token_ids, start, end, extra_keys = first
        if len(run) == 1:
            tokens = token_ids[start:end]
            extra = None if extra_keys is None else [event_extra_keys(extra_keys)]
        else:
            tokens = []
            for _, info in run:
                tokens += info[1][info[2] : info[3]]
            extra = [event_extra_keys(info[4]) for _, info in run]
            if not any(e is not None for e in extra):
                extra = None
        return self._stored_type(
            hashes,
            None if parent is None else int.from_bytes(parent[-8:], "big"),
            tokens if type(tokens) is list else list(tokens),
            spec.block_size * self._factor,
            None,
            medium,
            _lora_name(extra_keys),
            extra,
            group,
            spec.kind,
            spec.sliding_window,
            locality,
            ownership,
        )


def _lora_name(extra_keys: tuple[Any, ...] | None) -> str | None:
    # a chain's blocks share the adapter (it is in every block's hash), so the first tells
    for key in extra_keys or ():
        if key[0] == "lora":
            return key[1]
    return None


def _rows(items: Sequence[bytes], size: int) -> np.ndarray | None:
    """The items (bytes of ``size`` each) as the rows of an array; ``None`` if any is not."""
    if any(map(ne, map(len, items), repeat(size))):  # (lengths that only add up are not rows)
        return None
    return np.frombuffer(b"".join(items), np.uint8).reshape(len(items), size)


def _low64(rows: np.ndarray, end: int) -> list[int]:
    """Each row's bytes ``[end - 8, end)`` as a big-endian unsigned int."""
    return np.ascontiguousarray(rows[:, end - 8 : end]).view(">u8").ravel().tolist()


def _split(key: OffloadKey) -> tuple[int, bytes]:
    return int.from_bytes(key[-GROUP_BYTES:], "big"), key[:-GROUP_BYTES]
