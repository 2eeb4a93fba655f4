"""One model space: the engines serving one (model, tenant), their block tables and groups.

Contract:

* A ``ModelSpace`` has one registered ``block_size`` (the granularity of queries) and one
  ``BlockTable`` per (LoRA name, KV-cache group) its events named; its ``Engine`` s each
  own a slot (``slot * 4 + tier`` are their holder bits).
* ``apply(engine, events, stats)`` applies one batch of wire events of ``engine``, in
  order, and returns whether the batch held an ``AllBlocksCleared``:

  - ``BlockStored`` (or ``kvoffload.index.wire.LazyBlockStored``): its hashes become
    held by the engine in the event's tier (``kvoffload.index.tiers.tier_of``), in the
    table of (``lora_name``, ``group_idx`` or 0); its ``block_size``, a multiple of the
    registered one, sets that holder's stride (0, a placeholder, keeps it); its kind and
    window describe the group; its token ids, if any, are learned
    (``kvoffload.index.tokens``).
  - ``BlockRemoved``: one announcement fewer of each hash (refcounted), in the group's
    table that holds it (removals name no LoRA adapter).
  - ``AllBlocksCleared``: the engine holds nothing any more, in any tier.
  - Counted and skipped: an unknown medium, a ``block_size`` that is not a multiple of
    the registered one, hashes that are neither u64 ints nor bytes.
* ``drop(engine)`` forgets everything the engine holds (O(table sizes)).
* Not thread-safe: ``kvoffload.index.core.BlockIndex`` serializes access.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvoffload.counters import Counters
from kvoffload.events.types import AllBlocksCleared, BlockRemoved, BlockStored
from kvoffload.index.groups import DEFAULT_GROUP, GroupSpec
from kvoffload.index.state import SourceState
from kvoffload.index.table import BlockTable
from kvoffload.index.tiers import BITS_PER_ENGINE, tier_of
from kvoffload.index.tokens import TokenChains
from kvoffload.index.wire import LazyBlockStored, has_tokens
from kvoffload.keys import external_hash

_U64 = 1 << 64


@dataclass
class IndexStats(Counters):
    stored_applied: int = 0  # BlockStored events applied
    removed_applied: int = 0
    cleared_applied: int = 0
    stored_unknown_tier: int = 0  # events skipped: medium/locality the index does not know
    removed_unknown_tier: int = 0
    stored_bad_block_size: int = 0  # skipped: block_size not a multiple of the registered one
    stored_bad_hash: int = 0  # skipped: a block hash neither a u64 int nor bytes
    removed_bad_hash: int = 0
    stored_hashes: int = 0  # block hashes announced stored (with repeats)
    removed_hashes: int = 0  # holds ended by BlockRemoved
    removed_unknown: int = 0  # hashes removed that the engine did not hold
    tokens_learned: int = 0  # blocks whose (parent, tokens) -> hash was learned (not re-announcements)


class Engine:
    """One registered engine (instance id, data-parallel rank) of a model space."""

    __slots__ = ("instance_id", "dp_rank", "slot", "base", "blocks", "state", "space")

    def __init__(self, instance_id: int | str, dp_rank: int, slot: int, space: ModelSpace) -> None:
        self.instance_id = instance_id
        self.dp_rank = dp_rank
        self.slot = slot
        self.base = slot * BITS_PER_ENGINE  # holder bit of tier t is base + t
        self.blocks = [0, 0, 0, 0]  # distinct hashes held, per tier
        self.state = SourceState.FALLBACK
        self.space = space

    @property
    def key(self) -> tuple[int | str, int]:
        return (self.instance_id, self.dp_rank)

    def __repr__(self) -> str:
        return f"Engine({self.instance_id!r}, dp_rank={self.dp_rank}, slot={self.slot}, {self.state})"


class ModelSpace:
    """The engines, tables, groups and learned token chains of one (model, tenant)."""

    def __init__(self, model: str, tenant: str, block_size: int, token_capacity: int) -> None:
        self.model = model
        self.tenant = tenant
        self.block_size = block_size
        self.tables: dict[tuple[str | None, int], BlockTable] = {}
        self.groups: dict[int, GroupSpec] = {}
        self.tokens = TokenChains(token_capacity)
        self.engines: dict[tuple[int | str, int], Engine] = {}
        self.learn_tokens = True

    def apply(self, engine: Engine, events: Sequence[object], stats: IndexStats) -> bool:
        cleared = False
        run: list[np.ndarray] = []  # hashes of consecutive events with the same run key
        run_key: tuple | None = None
        for event in events:
            kind = type(event)
            if kind is LazyBlockStored or kind is BlockStored:
                step = self._stored(engine, event, stats)  # type: ignore[arg-type]
            elif kind is BlockRemoved:
                step = self._removed(engine, event, stats)  # type: ignore[arg-type]
            elif kind is AllBlocksCleared:
                self._flush(engine, run_key, run, stats)
                run, run_key = [], None
                self.drop(engine)
                stats.cleared_applied += 1
                cleared = True
                continue
            else:
                continue
            if step is None:
                continue
            key, hashes = step
            if key != run_key:
                self._flush(engine, run_key, run, stats)
                run, run_key = [], key
            run.append(hashes)
        self._flush(engine, run_key, run, stats)
        return cleared

    def drop(self, engine: Engine) -> None:
        holder_mask = ((1 << BITS_PER_ENGINE) - 1) << engine.base
        for table in self.tables.values():
            table.drop(holder_mask)
        engine.blocks = [0, 0, 0, 0]

    def group_spec(self, group: int) -> GroupSpec:
        return self.groups.get(group, DEFAULT_GROUP)

    # -- event application ---------------------------------------------------------------
    # Each event is checked and turned into (run key, uint64 hashes); consecutive events
    # of one run key reach the table as one array, so a batch costs a few numpy calls.

    def _stored(
        self, engine: Engine, event: BlockStored, stats: IndexStats
    ) -> tuple[tuple, np.ndarray] | None:
        tier = tier_of(event.medium, event.locality)
        if tier is None:
            stats.stored_unknown_tier += 1
            return None
        hashes = _u64_array(event.block_hashes)
        if hashes is None:
            stats.stored_bad_hash += 1
            return None
        size = event.block_size
        stride = 0
        if size:
            if size < 0 or size % self.block_size:
                stats.stored_bad_block_size += 1
                return None
            stride = size // self.block_size
        group = event.group_idx or 0
        lora = event.lora_name
        table = self._table(lora, group)
        bit = engine.base + tier
        if stride > 1:
            table.strides[bit] = stride
        elif stride == 1 and table.strides:
            table.strides.pop(bit, None)
        stats.stored_applied += 1
        stats.stored_hashes += len(hashes)
        if event.kv_cache_spec_kind is not None:
            spec = self.groups.get(group)
            described = (event.kv_cache_spec_kind, event.kv_cache_spec_sliding_window)
            if spec is None or (spec.kind, spec.sliding_window) != described:
                self.groups[group] = GroupSpec(*described)
        if size and self.learn_tokens and has_tokens(event.token_ids):
            parent = event.parent_block_hash
            if parent is not None and type(parent) is not int:
                parent = _u64(parent)
            stats.tokens_learned += self.tokens.learn(
                parent, event.token_ids, size, hashes.tolist(), event.extra_keys
            )
        return ("stored", lora, group, tier), hashes

    def _removed(
        self, engine: Engine, event: BlockRemoved, stats: IndexStats
    ) -> tuple[tuple, np.ndarray] | None:
        tier = tier_of(event.medium, event.locality)
        if tier is None:
            stats.removed_unknown_tier += 1
            return None
        hashes = _u64_array(event.block_hashes)
        if hashes is None:
            stats.removed_bad_hash += 1
            return None
        stats.removed_applied += 1
        return ("removed", None, event.group_idx or 0, tier), hashes

    def _flush(self, engine: Engine, key: tuple | None, run: list[np.ndarray], stats: IndexStats) -> None:
        if key is None or not run:
            return
        op, lora, group, tier = key
        hashes = run[0] if len(run) == 1 else np.concatenate(run)
        bit = engine.base + tier
        if op == "stored":
            engine.blocks[tier] += self.tables[lora, group].store(hashes, bit)
            return
        # A removal names no LoRA adapter: it ends the holds of the group's tables in turn
        # (an adapter's hashes differ from the base model's, so one table holds each).
        tables = [t for (_, g), t in self.tables.items() if g == group and (t.holders >> bit) & 1]
        released = 0
        unknown = len(hashes)
        for i, table in enumerate(tables):
            rest: list[int] | None = [] if i + 1 < len(tables) else None
            ended, unknown = table.remove(hashes, bit, rest)
            released += ended
            if not rest:
                break
            hashes = np.array(rest, dtype=np.uint64)
        engine.blocks[tier] -= released
        stats.removed_hashes += released
        stats.removed_unknown += unknown

    def _table(self, lora: str | None, group: int) -> BlockTable:
        key = (lora, group)
        table = self.tables.get(key)
        if table is None:
            table = self.tables[key] = BlockTable()
        return table


def _u64(value: object) -> int | None:
    if type(value) is int:
        return value if 0 <= value < _U64 else None  # type: ignore[operator]
    if isinstance(value, (bytes, bytearray)):
        return external_hash(bytes(value))
    return None


def _u64_array(hashes: Sequence[object]) -> np.ndarray | None:
    """``hashes`` as uint64, raw hash bytes converted; ``None`` if one is neither."""
    if not hashes:
        return np.zeros(0, dtype=np.uint64)
    if type(hashes[0]) is int and type(hashes[-1]) is int:
        try:
            return np.array(hashes, dtype=np.uint64)
        except (OverflowError, TypeError, ValueError):
            pass
    out = [_u64(h) for h in hashes]
    return None if None in out else np.array(out, dtype=np.uint64)
