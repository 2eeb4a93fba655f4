"""Matching and load planning: which tokens beyond the engine's cache can be loaded.

1. ``match(request, num_computed_tokens, hints)``: how many tokens beyond the engine's own
   cache can be loaded: leading ``HIT``s of every group, whole offloaded blocks, at most all
   prompt tokens but one (the engine must compute one to sample). ``None`` while a needed
   key is ``PENDING`` or ``RETRY`` (ask again next step). The first match announces the
   request to the manager (``on_new_request`` with a ``RequestContext`` carrying the
   engine's ``hints``) and touches the request's blocks, once.
   After a failed load of a request, always 0 for it: the engine recomputes, and a request
   is never sent round the same failing load twice.
   Chained loads (``chain_promotions``, on by default, with a manager that offers them:
   ``kvoffload.tiers.chained``): keys found below the CPU tier are promoted in this very
   step and count as hits, so the load is planned in the step that plans the promotion
   (one round trip instead of two); ``None`` only while a key must still be waited for
   (a store in flight, a tier that cannot tell yet). Not for groups of states.
2. ``on_allocated(req_id, block_ids, num_external_tokens)``: the engine allocated device
   blocks; a load of the matched blocks is planned (its keys pinned) for the next step.
   A chained load's keys still being promoted are pinned when the promotion completes
   (``kvoffload.scheduler.chains``); the worker runs the load after the promotion, and
   fails it unrun when the promotion failed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import partial
from operator import attrgetter
from typing import Any

from kvoffload.cpu import CPUOffloadingManager
from kvoffload.keys import OffloadKey
from kvoffload.manager import LookupResult, OffloadingManager, RequestContext
from kvoffload.scheduler.base import SchedulerBase
from kvoffload.scheduler.blocks import device_spec
from kvoffload.scheduler.chains import LoadChains
from kvoffload.scheduler.sources import tokens_by_source
from kvoffload.scheduler.state import RequestState
from kvoffload.scheduler.types import RequestView, TransferJob
from kvoffload.sessions import NO_DIRECTIVES, SessionDirectives

_ref = attrgetter("ref")


class Loads(SchedulerBase):
    """``match``, ``on_allocated`` and ``load_sources`` of the ``OffloadingScheduler``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Loads chained on promotions (True: one round trip for a lower-tier hit; False:
        # the promotion's outcome first, the load in a later step)
        self.chain_promotions = True
        self._chains = LoadChains()
        # A plain CPU tier's block table: a run of keys is looked up in C loops (and the
        # answers counted as its ``lookup`` would); other managers are asked key by key
        manager = self.manager
        cpu = CPUOffloadingManager
        plain = isinstance(manager, cpu) and type(manager).lookup is cpu.lookup
        self._table = manager.block_table if plain else None
        # every loaded key comes from the manager's own medium (no lower tier to name)
        self._one_source = type(manager).load_source is OffloadingManager.load_source

    # -- matching ----------------------------------------------------------------------

    def match(
        self,
        request: RequestView,
        num_computed_tokens: int,
        hints: Mapping[str, Any] | None = None,
        directives: SessionDirectives | None = None,
    ) -> int | None:
        """``hints``: what the engine passed with the request for offloading (vLLM's
        ``kv_transfer_params``); ``directives``: its session controls, as the integration
        parsed them (``kvoffload.sessions``). The first match's go into the request's
        context (and ``scheduler.sessions`` hears of its arrival)."""
        state = self._state(request, hints, directives)
        state.matched_from = num_computed_tokens
        if state.load_failed:
            return 0
        hashes = self._blocks.hashes(request)
        if not state.touched:
            state.touched = True
            for g in self._offloaded:
                keys = self._blocks.request_keys(
                    state.keys[g], hashes, g, 0, self._blocks.num_full(hashes, g)
                )
                state.touched_blocks[g] = len(keys)
                self._reuse.count(keys)
                self.manager.touch(keys)
        load_from = state.context.directives.tiers.load_from
        lookup = self.manager.lookup if load_from is None else self._lookup_within(load_from)
        if lookup is None:
            return 0  # it may not load from the primary tier: it loads nothing
        # The engine must compute at least one prompt token itself.
        limit = request.num_prompt_tokens - 1
        hit_tokens = limit
        chain = self.chain_promotions and load_from is None and getattr(self.manager, "chain_prefix", None)
        waited: list[tuple[int, int, list[OffloadKey]]] = []  # (group, start, keys looked up)
        for g in self._offloaded:
            if self.groups[g].is_state:
                continue
            tokens = self._tokens[g]
            start = num_computed_tokens // tokens
            end = min(self._blocks.num_full(hashes, g), -(-limit // tokens))
            hits = start
            waiting = False
            keys = self._blocks.request_keys(state.keys[g], hashes, g, start, end)
            looked = len(keys)
            if self._table is not None:
                found = self._leading_hits(keys)
                if found is not None:
                    hit_tokens = min(hit_tokens, (start + found) * tokens)
                    continue
            for j, key in enumerate(keys, start):
                result = lookup(key)
                if result is LookupResult.HIT:
                    if not waiting:
                        hits += 1
                    continue
                if result is LookupResult.MISS:
                    looked = j - start
                    break
                # PENDING or RETRY: ask again next step (or chain a load on the promotion).
                # Looking on lets a tiered manager promote the rest of the prefix in the
                # same batch. A block being promoted is announced by the CPU tier when it
                # lands: say what it holds.
                waiting = True
                if result is LookupResult.PENDING and not self._events.knows(key):
                    self._remember(state, hashes, g, j, key)
            if waiting:
                if not chain:
                    return None
                waited.append((g, start, keys[:looked]))
                continue
            hit_tokens = min(hit_tokens, hits * tokens)
        if waited:
            self.manager.promote_now([key for _, _, keys in waited for key in keys])
            for g, start, keys in waited:
                count, wait = chain(keys)
                if wait:
                    return None
                hit_tokens = min(hit_tokens, (start + count) * self._tokens[g])
        for g in self._states:
            hit_tokens = self._state_hit(state, hashes, g, num_computed_tokens, hit_tokens, lookup)
            if hit_tokens is None:
                return None
        return max(0, hit_tokens - num_computed_tokens)

    def _leading_hits(self, keys: list[OffloadKey]) -> int | None:
        """How many leading keys the CPU tier holds loadable, with the hits and the miss
        counted as ``lookup`` key by key would; ``None`` (nothing counted) where a store
        in flight comes first (the general path then says ``PENDING``)."""
        statuses = list(map(self._table.get, keys))
        end = statuses.index(None) if None in statuses else len(statuses)
        if end and min(map(_ref, statuses[:end])) < 0:
            return None
        self.manager.count_lookups(end, int(end < len(statuses)))
        return end

    def _lookup_within(self, load_from: frozenset[str]) -> Callable[[OffloadKey], LookupResult] | None:
        """The lookup of a request that may load only from the tiers in ``load_from``
        (``kvoffload.sessions.TierChoice``): promoting from those alone; ``None`` when the
        primary tier is not among them."""
        manager = self.manager
        if manager.medium not in load_from:
            return None
        within = getattr(manager, "lookup_within", None)
        return manager.lookup if within is None else partial(within, load_from=load_from)

    def _state_hit(
        self, state: RequestState, hashes, g: int, num_computed_tokens: int, bound: int, lookup
    ) -> int | None:
        """The most tokens up to ``bound`` that end on a stored state of group ``g`` (the
        states before it are not needed), ``num_computed_tokens`` without one; ``None``
        while a later state is on its way."""
        tokens = self._tokens[g]
        start = num_computed_tokens // tokens
        top = min(self._blocks.num_full(hashes, g), bound // tokens)
        keys = self._blocks.request_keys(state.keys[g], hashes, g, start, top)
        for j in range(top - 1, start - 1, -1):
            result = lookup(keys[j - start])
            if result is LookupResult.HIT:
                return (j + 1) * tokens
            if result is not LookupResult.MISS:
                if result is LookupResult.PENDING and not self._events.knows(keys[j - start]):
                    self._remember(state, hashes, g, j, keys[j - start])
                return None
        return num_computed_tokens

    def _state(
        self, request: RequestView, hints: Mapping[str, Any] | None, directives: SessionDirectives | None
    ) -> RequestState:
        state = self._requests.get(request.request_id)
        if state is None:
            n = len(self.groups)
            context = RequestContext(
                request.request_id, hints or {}, tuple(self._tokens), directives or NO_DIRECTIVES
            )
            state = RequestState(request, context, [[] for _ in range(n)], [0] * n, [0] * n)
            state.keys, state.loaded_blocks = [[] for _ in range(n)], [0] * n
            self._requests[request.request_id] = state
            self._store_at[request.request_id] = self._store_start(context)
            store_to = context.directives.tiers.store_to
            if store_to and hasattr(self.manager, "limit_write_through"):
                self._store_limits[request.request_id] = store_to
            self._quiet = None
            self.manager.on_new_request(context)
            self.sessions.on_arrival(context)
        return state

    # -- allocation and loads ------------------------------------------------------------

    def on_allocated(self, req_id: str, block_ids: Sequence[Sequence[int]], num_external_tokens: int) -> None:
        """Record the request's device blocks (all of them, per group); plan the load of
        ``num_external_tokens`` matched tokens that follow the engine-cached ones."""
        state = self._requests.get(req_id)
        if state is None:
            raise KeyError(f"unknown request {req_id!r}: call match() first")
        if len(block_ids) != len(self.groups):
            raise ValueError(f"expected block ids for {len(self.groups)} groups, got {len(block_ids)}")
        state.block_ids = [list(ids) for ids in block_ids]
        num_computed_tokens = state.matched_from
        end_tokens = num_computed_tokens + max(0, num_external_tokens)
        state.computed_tokens = max(state.computed_tokens, end_tokens)
        if num_external_tokens <= 0:
            return
        hashes = self._blocks.hashes(state.request)
        keys: list[OffloadKey] = []
        device_ids: list[int] = []
        sizes: list[int] = []
        indices: list[int] = []
        ranges: list[tuple[int, int, OffloadKey]] = []  # each key's tokens (several media)
        runs: list[tuple[int, int, str]] = []  # each group's tokens (one medium)
        loaded_range = [(0, 0)] * len(self.groups)
        f = self.blocks_per_offload_block
        for g, tokens in enumerate(self._tokens):
            if not self.groups[g].offloaded or (self.groups[g].is_state and end_tokens % tokens):
                sizes.append(0)
                indices.append(0)
                continue
            if self.groups[g].is_state:  # the one state at end_tokens
                j = end_tokens // tokens - 1
                device = state.block_ids[g][j]
                if device == self.null_block_id:
                    raise ValueError(f"request {req_id!r}: group {g} has no device block for its state {j}")
                keys += self._blocks.request_keys(state.keys[g], hashes, g, j, j + 1)
                device_ids.append(device)
                sizes.append(1)
                indices.append(j)
                state.loaded_blocks[g] = max(state.loaded_blocks[g], j + 1)
                continue
            block_size = self.groups[g].block_size
            last = -(-end_tokens // tokens)
            first_device = self._blocks.first_present(
                state.block_ids[g], num_computed_tokens // block_size, last * f
            )
            group_keys = self._blocks.request_keys(state.keys[g], hashes, g, first_device // f, last)
            first = first_device // f
            if self._one_source:
                runs.append((first * tokens, last * tokens, self.manager.medium))
            else:
                ranges += [(j * tokens, (j + 1) * tokens, key) for j, key in enumerate(group_keys, first)]
            loaded_range[g] = (first, last)
            keys += group_keys
            state.loaded_blocks[g] = max(state.loaded_blocks[g], last)
            ids = state.block_ids[g][first_device : last * f]
            device_ids += ids
            sizes.append(len(ids))
            indices.append(first_device)
        chained = getattr(self.manager, "prepare_chained_load", None)
        if chained is not None:
            host_spec, waiting = chained(keys)
        else:
            host_spec, waiting = self.manager.prepare_load(keys), None
        self.stats.tokens_loaded += num_external_tokens
        self.stats.loads_planned += 1
        if not self._one_source:
            source = self.manager.load_source
            runs = [(a, b, source(k)) for a, b, k in ranges]
        state.load_sources = tokens_by_source(runs, num_computed_tokens, end_tokens)
        # blocks in the tier now (pinned) are not offered to it again; not those a chained
        # load still waits for (a failed promotion leaves them out of the tier)
        state.loaded_range = [] if waiting else loaded_range
        for medium, count in state.load_sources.items():
            self.tokens_by_source[medium] = self.tokens_by_source.get(medium, 0) + count
        job = self._new_job(req_id, False, keys)
        self._jobs[job].tokens = num_external_tokens
        if waiting:
            self._chains.add(job, waiting)
        self._pending_loads.append(
            TransferJob(job, req_id, False, host_spec, device_spec(device_ids, sizes, indices))
        )

    def load_sources(self, req_id: str) -> dict[str, int]:
        """The tokens of the request's last planned load per medium they came from
        (``kvoffload.scheduler.sources``); empty for a request that loaded nothing."""
        state = self._requests.get(req_id)
        return dict(state.load_sources) if state is not None else {}
