"""The block index: which engine (instance, DP rank) holds which block in which tier.

Contract:

* Engines are registered per model space (``model``, ``tenant``) with the space's block
  size (``add_engine``; the first engine of a space sets it, a different one later is a
  ``ValueError`` naming it; registering the same (instance, rank) twice is one too).
  ``remove_engine`` forgets an engine and its entries; a space with no engine left is
  dropped.
* ``apply(engine, events)`` applies one batch of the engine's wire events
  (``kvoffload.index.space``); ``clear(engine)`` drops its entries (a publisher restart).
  Both, and every query, hold one lock: any number of ingesting threads and query
  threads may share an index.
* ``query_hashes(model, tenant, hashes, lora_name)`` scores a prompt given as the chained
  block hashes of its blocks of the space's block size (u64; negative values are read as
  the two's complement of an i64, as Dynamo sends them). ``query_tokens(model, tenant,
  token_ids, lora_name, cache_salt)`` finds those hashes first: from the chains learned
  from events' token ids (``kvoffload.index.tokens``), completed by hashing the tokens
  with ``kvoffload.keys.BlockHasher(hash_seed)`` (vLLM's ``sha256_cbor`` chain; the cache
  salt mixed into the first block as vLLM does) where the learned chains are silent and
  never contradict it. With a LoRA adapter only learned chains are used (vLLM mixes the
  adapter's path into its hashes); ``hash_seed=None`` turns hashing off.
* A query of an unknown space raises ``LookupError``. The answer (``QueryResult``) has,
  for every engine of the space, its cumulative prefix lengths per tier in blocks
  (``kvoffload.index.scoring``), the tier-weighted length and its source state.
"""

from __future__ import annotations

import heapq
import threading
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from kvoffload.index.scoring import GroupMasks, Levels, prefix_levels, weighted
from kvoffload.index.space import Engine, IndexStats, ModelSpace
from kvoffload.index.state import SourceState
from kvoffload.index.tiers import TIER_NAMES, TierWeights
from kvoffload.index.tokens import DEFAULT_CAPACITY
from kvoffload.keys import DEFAULT_HASH_SEED, BlockHasher, external_hash
from kvoffload.validation import non_negative_int, positive_int

_M64 = (1 << 64) - 1


class EngineMatch(NamedTuple):
    instance_id: int | str
    dp_rank: int
    levels: Levels  # cumulative blocks: device, host, disk, shared
    weighted: float  # tier-weighted blocks
    state: SourceState
    held: tuple[int, int, int, int]  # blocks the engine holds per tier (not only this prompt's)


@dataclass
class QueryResult:
    model: str
    tenant: str
    block_size: int
    num_blocks: int
    matches: list[EngineMatch] = field(default_factory=list)


class BlockIndex:
    """Engines' blocks per tier, from their KV events; prefix scores out (see module doc)."""

    def __init__(
        self,
        weights: TierWeights | None = None,
        hash_seed: str | None = DEFAULT_HASH_SEED,
        token_chain_capacity: int = DEFAULT_CAPACITY,
    ) -> None:
        if weights is not None and not isinstance(weights, TierWeights):
            raise TypeError(f"weights must be a TierWeights, got {weights!r}")
        positive_int("token_chain_capacity", token_chain_capacity)
        self.weights = weights or TierWeights()
        self._hasher = None if hash_seed is None else BlockHasher(hash_seed)
        self._token_capacity = token_chain_capacity
        self._lock = threading.Lock()
        self._spaces: dict[tuple[str, str], ModelSpace] = {}
        self._free_slots: list[int] = []
        self._next_slot = 0
        self._stats = IndexStats()

    # -- engines -------------------------------------------------------------------------

    def add_engine(
        self, model: str, tenant: str, instance_id: int | str, dp_rank: int, block_size: int
    ) -> Engine:
        positive_int("block_size", block_size)
        non_negative_int("dp_rank", dp_rank)
        with self._lock:
            space = self._spaces.get((model, tenant))
            if space is not None and space.block_size != block_size:
                raise ValueError(
                    f"block_size {block_size} differs from the {space.block_size} that model "
                    f"{model!r} of tenant {tenant!r} is indexed at"
                )
            if space is not None and (instance_id, dp_rank) in space.engines:
                raise ValueError(
                    f"instance {instance_id!r} dp_rank {dp_rank} is already registered "
                    f"for model {model!r} of tenant {tenant!r}"
                )
            if space is None:
                space = self._spaces[model, tenant] = ModelSpace(
                    model, tenant, block_size, self._token_capacity
                )
            if self._free_slots:
                slot = heapq.heappop(self._free_slots)
            else:
                slot = self._next_slot
                self._next_slot += 1
            engine = space.engines[instance_id, dp_rank] = Engine(instance_id, dp_rank, slot, space)
            return engine

    def remove_engine(self, engine: Engine) -> None:
        with self._lock:
            space = engine.space
            if space.engines.get(engine.key) is not engine:
                return
            space.drop(engine)
            del space.engines[engine.key]
            heapq.heappush(self._free_slots, engine.slot)
            if not space.engines:
                del self._spaces[space.model, space.tenant]

    def engines(self) -> list[Engine]:
        with self._lock:
            return [e for space in self._spaces.values() for e in space.engines.values()]

    def set_state(self, engine: Engine, state: SourceState) -> None:
        engine.state = state

    # -- ingestion -----------------------------------------------------------------------

    def apply(self, engine: Engine, events: Sequence[object]) -> bool:
        """Apply one batch of ``engine``'s events; ``True`` if it cleared the engine."""
        with self._lock:
            if engine.space.engines.get(engine.key) is not engine:
                return False  # removed meanwhile
            return engine.space.apply(engine, events, self._stats)

    def clear(self, engine: Engine) -> None:
        with self._lock:
            engine.space.drop(engine)

    def stats(self) -> IndexStats:
        with self._lock:
            return self._stats.snapshot()

    def sizes(self) -> dict[str, int]:
        """Distinct (namespace, hash) entries and holds, for gauges."""
        with self._lock:
            entries = sum(len(t) for s in self._spaces.values() for t in s.tables.values())
            holds = sum(sum(e.blocks) for s in self._spaces.values() for e in s.engines.values())
            return {"entries": entries, "holds": holds, "spaces": len(self._spaces)}

    # -- queries -------------------------------------------------------------------------

    def query_hashes(
        self, model: str, tenant: str, hashes: Sequence[int] | np.ndarray, lora_name: str | None = None
    ) -> QueryResult:
        with self._lock:
            space = self._space(model, tenant)
            groups, engines = self._gather(space, hashes, lora_name)
        return self._score(space, groups, engines, len(hashes))

    def query_tokens(
        self,
        model: str,
        tenant: str,
        token_ids: Sequence[int],
        lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> QueryResult:
        with self._lock:
            space = self._space(model, tenant)
            block_size = space.block_size
            learned = self._learned_hashes(space, token_ids, lora_name, cache_salt)
        hashes = self._complete_by_hashing(learned, token_ids, block_size, lora_name, cache_salt)
        with self._lock:
            space = self._space(model, tenant)
            groups, engines = self._gather(space, hashes, lora_name)
        return self._score(space, groups, engines, len(hashes))

    def dump(self) -> list[dict[str, Any]]:
        """Every space's engines and, per engine, tier, LoRA and group, the hashes held."""
        out = []
        with self._lock:
            for space in self._spaces.values():
                entries = []
                for engine in space.engines.values():
                    for (lora, group), table in space.tables.items():
                        for tier, name in enumerate(TIER_NAMES):
                            bit = engine.base + tier
                            held = list(table.holds(bit))
                            if held:
                                entries.append(
                                    {
                                        "instance_id": engine.instance_id,
                                        "dp_rank": engine.dp_rank,
                                        "tier": name,
                                        "lora_name": lora,
                                        "group_idx": group,
                                        "stride": table.strides.get(bit, 1),
                                        "block_hashes": held,
                                    }
                                )
                out.append(
                    {
                        "model_name": space.model,
                        "tenant_id": space.tenant,
                        "block_size": space.block_size,
                        "groups": {str(g): spec.as_dict() for g, spec in sorted(space.groups.items())},
                        "entries": entries,
                    }
                )
        return out

    # -- internals -----------------------------------------------------------------------

    def _space(self, model: str, tenant: str) -> ModelSpace:
        space = self._spaces.get((model, tenant))
        if space is None:
            raise LookupError(f"no engine is registered for model {model!r} of tenant {tenant!r}")
        return space

    def _gather(
        self, space: ModelSpace, hashes: Sequence[int | None], lora_name: str | None
    ) -> tuple[list[GroupMasks], list[tuple[Engine, SourceState, tuple]]]:
        keys, valid = _query_keys(hashes)
        groups = []
        for (lora, group), table in sorted(space.tables.items(), key=lambda kv: kv[0][1]):
            if lora != lora_name:
                continue
            window = space.group_spec(group).window_blocks(space.block_size)
            groups.append(GroupMasks(table.lookup(keys, valid), window, dict(table.strides)))
        return groups, [(e, e.state, tuple(e.blocks)) for e in space.engines.values()]

    def _score(
        self,
        space: ModelSpace,
        groups: list[GroupMasks],
        engines: list[tuple[Engine, SourceState, tuple]],
        n: int,
    ) -> QueryResult:
        levels = prefix_levels(groups, [e.slot for e, _, _ in engines], n)
        result = QueryResult(space.model, space.tenant, space.block_size, n)
        for engine, state, held in engines:
            got = levels[engine.slot]
            result.matches.append(
                EngineMatch(engine.instance_id, engine.dp_rank, got, weighted(got, self.weights), state, held)
            )
        return result

    def _learned_hashes(
        self, space: ModelSpace, token_ids: Sequence[int], lora: str | None, salt: str | None
    ) -> list[int | None]:
        size = space.block_size
        hashes: list[int | None] = [None] * (len(token_ids) // size)

        def extra(i: int) -> tuple | None:
            keys = ([lora] if lora else []) + ([salt] if salt and i == 0 else [])
            return tuple(keys) if keys else None

        walk_extra = extra if lora or salt else None  # None: the chains' faster walk

        # Coarser chains first, so the registered size's own chain has the last word.
        for learned_size in sorted(space.tokens.block_sizes, reverse=True):
            if learned_size % size:
                continue
            stride = learned_size // size
            chain = space.tokens.chain(token_ids, learned_size, walk_extra)
            hashes[stride - 1 : stride * len(chain) : stride] = chain  # block (k+1)*stride-1
        return hashes

    def _complete_by_hashing(
        self,
        learned: list[int | None],
        token_ids: Sequence[int],
        block_size: int,
        lora: str | None,
        salt: str | None,
    ) -> list[int | None]:
        if self._hasher is None or lora or None not in learned:
            return learned
        hashed: list[int] = []
        parent = None
        for i in range(len(learned)):
            extra = (("cache_salt", salt),) if salt and i == 0 else None
            parent = self._hasher.hash_block(parent, token_ids[i * block_size : (i + 1) * block_size], extra)
            hashed.append(external_hash(parent))
        if any(h is not None and h != mine for h, mine in zip(learned, hashed)):
            return learned  # the engines hash differently: only what they taught us counts
        return [mine if h is None else h for h, mine in zip(learned, hashed)]


def _query_keys(hashes: Sequence[int | None]) -> tuple[np.ndarray, np.ndarray | None]:
    """Query hashes as uint64 (i64 negatives as their two's complement) and which are
    known (``None``: every one; a ``None`` hash matches nothing)."""
    if isinstance(hashes, np.ndarray) and hashes.dtype == np.uint64:
        return hashes, None
    try:
        return np.frombuffer(array("Q", hashes), dtype=np.uint64), None  # faster than np.array
    except (OverflowError, TypeError):
        pass
    try:
        return np.array(hashes, dtype=np.uint64), None
    except (OverflowError, TypeError):
        pass
    valid = np.array([h is not None for h in hashes], dtype=bool)
    keys = np.array([0 if h is None else h & _M64 for h in hashes], dtype=np.uint64)
    return keys, valid
