"""The engine-agnostic offloading scheduler: which blocks to load and store, each step.

Single-threaded and non-blocking: it only does bookkeeping on an ``OffloadingManager`` and
hands out ``TransferJob``s; the worker side moves the bytes and reports ``(job_id,
success)`` back through ``complete_jobs``.

Blocks. Each KV-cache group ``g`` has a device block size ``B_g``; an offloaded block spans
``F = blocks_per_offload_block`` device blocks, ``T_g = B_g * F`` tokens. The engine's
request hashes are chained hashes of ``hash_block_size``-token blocks; offloaded block
``j`` of group ``g`` is keyed by the hash that ends at token ``(j + 1) * T_g`` (a chained
hash names its whole prefix) and the group index. Only whole offloaded blocks are
offloaded; the trailing partial block never is. Device blocks equal to ``null_block_id``
(what engines put outside a sliding window) are never stored or loaded.

Request lifecycle:

1. ``match(request, num_computed_tokens, hints)``: how many tokens beyond the engine's own
   cache can be loaded: leading ``HIT``s of every group, whole offloaded blocks, at most all
   prompt tokens but one (the engine must compute one to sample). ``None`` while a needed
   key is ``PENDING`` or ``RETRY`` (ask again next step). The first match announces the
   request to the manager (``on_new_request`` with a ``RequestContext`` carrying the
   engine's ``hints``) and touches the request's blocks, once.
   After a failed load of a request, always 0 for it: the engine recomputes, and a request
   is never sent round the same failing load twice.
2. ``on_allocated(req_id, block_ids, num_external_tokens)``: the engine allocated device
   blocks; a load of the matched blocks is planned (its keys pinned) for the next step.
3. ``build_step(scheduled)``: returns the ``StepPlan``: planned loads, and stores of every
   offloaded block whose tokens are computed once this step has run.
4. ``complete_jobs(results)``: completes loads (unpin) and stores (loadable, or rolled back).
5. ``request_finished(req_id)`` (finished or aborted): ``True`` when the engine must hold
   the request's device blocks until its jobs complete (listed in the next plan's
   ``hold_blocks``); ``take_freeable()`` then names the requests whose blocks may be freed.
   Once no job of it is in flight the manager hears ``on_request_finished`` with the
   request's keys, those its stores inserted and those its loads reused (the contract in
   ``kvoffload.manager`` says exactly when it fires, on every path).

Reuse filter: with ``store_threshold=n > 1`` a block is offered for storing only once
``n`` requests asked for it (``kvoffload.scheduler.reuse``); the blocks held back are
counted in ``stats.skipped_stores``.

Tenants: the engine's block hashes already hold what keeps tenants apart (cache salt,
LoRA adapter, multimodal items), so keys taken from them never mix two tenants' blocks.
For an engine that does not hash, the scheduler hashes the tokens with the request's
extra keys (``block_extra_keys``); those also fill ``BlockStored.extra_keys``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from kvoffload.events.types import KVEvent
from kvoffload.keys import BlockHasher, OffloadKey
from kvoffload.manager import LookupResult, OffloadingManager, RequestContext
from kvoffload.scheduler.blocks import BlockKeys
from kvoffload.scheduler.events import EventConverter
from kvoffload.scheduler.reuse import DEFAULT_MEMORY, ReuseFilter
from kvoffload.scheduler.sources import tokens_by_source
from kvoffload.scheduler.state import Job, RequestState, SchedulerStats
from kvoffload.scheduler.types import (
    BlockExtraKeys,
    KVGroup,
    RequestView,
    StepPlan,
    StepRequest,
    TransferJob,
    view_extra_keys,
)
from kvoffload.specs import DeviceLoadStoreSpec
from kvoffload.validation import positive_int


class OffloadingScheduler:
    """Plans loads and stores between an engine's device blocks and one offloading tier."""

    def __init__(
        self,
        manager: OffloadingManager,
        groups: Sequence[KVGroup],
        hash_block_size: int,
        blocks_per_offload_block: int = 1,
        kv_events: str = "self_describing",
        hasher: BlockHasher | None = None,
        null_block_id: int | None = None,
        store_threshold: int = 1,
        store_threshold_memory: int = DEFAULT_MEMORY,
        block_extra_keys: BlockExtraKeys | None = None,
        offload_prompt_only: bool = False,
    ) -> None:
        """``store_threshold``: requests that must ask for a block before it is stored
        (1 = store every block); ``store_threshold_memory``: keys whose count is kept;
        ``block_extra_keys(request, start, end)``: what besides tokens the engine hashes
        into the block ``[start, end)`` (salt, adapter, multimodal items, in
        ``kvoffload.keys`` tagged form); default ``view_extra_keys``;
        ``offload_prompt_only``: store blocks of prompt tokens only, not those generated."""
        if not groups:
            raise ValueError("at least one KV-cache group is needed")
        positive_int("blocks_per_offload_block", blocks_per_offload_block)
        positive_int("hash_block_size", hash_block_size)
        self._offloaded = [g for g, group in enumerate(groups) if group.offloaded]
        if not self._offloaded:
            raise ValueError("no KV-cache group is offloaded")
        self._states = [g for g in self._offloaded if groups[g].is_state]
        if self._states and blocks_per_offload_block != 1:
            raise ValueError(
                f"KV-cache group {self._states[0]} holds recurrent states (one per device block): "
                f"blocks_per_offload_block must be 1, got {blocks_per_offload_block}"
            )
        self._fenced: dict[int, set[int]] = {}  # device block of a state -> store jobs reading it
        for g, group in enumerate(groups):
            if group.offloaded and group.block_size * blocks_per_offload_block % hash_block_size:
                raise ValueError(
                    f"offloaded block of group {g} ({group.block_size} x {blocks_per_offload_block} tokens) "
                    f"is not a multiple of the hash block size {hash_block_size}"
                )
        self.manager = manager
        self.null_block_id = null_block_id
        self.groups = list(groups)
        self.blocks_per_offload_block = blocks_per_offload_block
        self.hash_block_size = hash_block_size
        self._tokens = [group.block_size * blocks_per_offload_block for group in groups]
        self._extra_keys = block_extra_keys or view_extra_keys
        self._blocks = BlockKeys(
            self._tokens, hash_block_size, hasher or BlockHasher(), self._extra_keys, null_block_id
        )
        self._events = EventConverter(groups, blocks_per_offload_block, kv_events)
        self._wire_events: list[KVEvent] = []
        self._requests: dict[str, RequestState] = {}
        self._jobs: dict[int, Job] = {}
        self._stale_jobs: set[int] = set()  # in flight at a reset: outcome not applied
        self._next_job_id = 0
        self._pending_loads: list[TransferJob] = []
        self._hold: dict[str, list[int]] = {}
        self._flush: dict[str, list[int]] = {}
        self._freeable: set[str] = set()
        self._reuse = ReuseFilter(store_threshold, store_threshold_memory)
        self.offload_prompt_only = offload_prompt_only
        self.stats = SchedulerStats()
        self.tokens_by_source: dict[str, int] = {}  # tokens_loaded per source medium (sources.py)

    # -- matching ----------------------------------------------------------------------

    def match(
        self, request: RequestView, num_computed_tokens: int, hints: Mapping[str, Any] | None = None
    ) -> int | None:
        """``hints``: what the engine passed with the request for offloading (vLLM's
        ``kv_transfer_params``); the first match's go into the request's context."""
        state = self._state(request, hints)
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
        # The engine must compute at least one prompt token itself.
        limit = request.num_prompt_tokens - 1
        hit_tokens = limit
        for g in self._offloaded:
            if self.groups[g].is_state:
                continue
            tokens = self._tokens[g]
            start = num_computed_tokens // tokens
            end = min(self._blocks.num_full(hashes, g), -(-limit // tokens))
            hits = start
            waiting = False
            for j, key in enumerate(self._blocks.request_keys(state.keys[g], hashes, g, start, end), start):
                result = self.manager.lookup(key)
                if result is LookupResult.HIT:
                    if not waiting:
                        hits += 1
                    continue
                if result is LookupResult.MISS:
                    break
                # PENDING or RETRY: ask again next step. Looking on lets a tiered manager
                # promote the rest of the prefix in the same batch. A block being promoted
                # is announced by the CPU tier when it lands: say what it holds.
                waiting = True
                if result is LookupResult.PENDING and not self._events.knows(key):
                    self._remember(state, hashes, g, j, key)
            if waiting:
                return None
            hit_tokens = min(hit_tokens, hits * tokens)
        for g in self._states:
            hit_tokens = self._state_hit(state, hashes, g, num_computed_tokens, hit_tokens)
            if hit_tokens is None:
                return None
        return max(0, hit_tokens - num_computed_tokens)

    def _state_hit(
        self, state: RequestState, hashes, g: int, num_computed_tokens: int, bound: int
    ) -> int | None:
        """The most tokens up to ``bound`` that end on a stored state of group ``g`` (the
        states before it are not needed), ``num_computed_tokens`` without one; ``None``
        while a later state is on its way."""
        tokens = self._tokens[g]
        start = num_computed_tokens // tokens
        top = min(self._blocks.num_full(hashes, g), bound // tokens)
        keys = self._blocks.request_keys(state.keys[g], hashes, g, start, top)
        for j in range(top - 1, start - 1, -1):
            result = self.manager.lookup(keys[j - start])
            if result is LookupResult.HIT:
                return (j + 1) * tokens
            if result is not LookupResult.MISS:
                if result is LookupResult.PENDING and not self._events.knows(keys[j - start]):
                    self._remember(state, hashes, g, j, keys[j - start])
                return None
        return num_computed_tokens

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
        ranges: list[tuple[int, int, OffloadKey]] = []
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
            ranges += [(j * tokens, (j + 1) * tokens, key) for j, key in enumerate(group_keys, first)]
            keys += group_keys
            state.loaded_blocks[g] = max(state.loaded_blocks[g], last)
            ids = state.block_ids[g][first_device : last * f]
            device_ids += ids
            sizes.append(len(ids))
            indices.append(first_device)
        host_spec = self.manager.prepare_load(keys)
        self.stats.tokens_loaded += num_external_tokens
        self.stats.loads_planned += 1
        source = self.manager.load_source
        spans = ((a, b, source(k)) for a, b, k in ranges)
        state.load_sources = tokens_by_source(spans, num_computed_tokens, end_tokens)
        for medium, count in state.load_sources.items():
            self.tokens_by_source[medium] = self.tokens_by_source.get(medium, 0) + count
        job = self._new_job(req_id, False, keys)
        self._jobs[job].tokens = num_external_tokens
        self._pending_loads.append(
            TransferJob(job, req_id, False, host_spec, DeviceLoadStoreSpec(device_ids, sizes, indices))
        )

    # -- steps and stores ----------------------------------------------------------------

    def build_step(self, scheduled: Iterable[StepRequest], preempted: Iterable[str] = ()) -> StepPlan:
        plan = StepPlan(loads=self._pending_loads)
        self._pending_loads = []
        for transfer in self.manager.take_transfers():
            job_id = self._new_job("", False, [], transfer.token)
            plan.transfers.append(TransferJob(job_id, "", False, transfer.src_spec, transfer.dst_spec))
        for step in scheduled:
            state = self._requests.get(step.req_id)
            if state is None:
                continue
            state.computed_tokens = max(state.computed_tokens, step.num_computed_tokens)
            if step.new_block_ids is not None:
                self._flush_fenced(step.new_block_ids)
                if step.replace_block_ids:
                    state.block_ids = [list(ids) for ids in step.new_block_ids]
                else:
                    for ids, new in zip(state.block_ids, step.new_block_ids):
                        ids.extend(new)
            job = self._plan_store(step.req_id, state, step.num_computed_tokens, step.states)
            if job is not None:
                plan.stores.append(job)
        for req_id in preempted:
            state = self._requests.get(req_id)
            if state is not None and state.jobs:
                self._flush[req_id] = sorted(state.jobs)
        plan.hold_blocks, self._hold = self._hold, {}
        plan.flush, self._flush = self._flush, {}
        return plan

    def _flush_fenced(self, new_block_ids: Sequence[Sequence[int]]) -> None:
        """A state's device block is the engine's to reuse once the next state is written:
        a store still reading one that is handed out again completes first (``flush``)."""
        if not self._fenced:
            return
        for ids in new_block_ids:
            for block in ids:
                for job_id in self._fenced.pop(block, ()):
                    job = self._jobs.get(job_id)
                    if job is not None:
                        self._flush.setdefault(job.req_id, []).append(job_id)

    def _plan_store(
        self, req_id: str, state: RequestState, num_computed_tokens: int, states: Iterable = ()
    ) -> TransferJob | None:
        hashes = self._blocks.hashes(state.request)
        # (group, offloaded block, key, device blocks)
        candidates: list[tuple[int, int, OffloadKey, Sequence[int]]] = []
        f = self.blocks_per_offload_block
        prompt = state.request.num_prompt_tokens
        decoding = num_computed_tokens > prompt
        if self.offload_prompt_only:
            num_computed_tokens = min(num_computed_tokens, prompt)
        for g, block, end_tokens in states:
            tokens = self._tokens[g]
            j = end_tokens // tokens - 1
            if (
                (end_tokens <= prompt or not self.offload_prompt_only)
                and g in self._states
                and end_tokens % tokens == 0
                and 0 <= j < self._blocks.num_full(hashes, g)
                and block != self.null_block_id
            ):
                key = self._blocks.request_keys(state.keys[g], hashes, g, j, j + 1)[0]
                if all(c[2] != key for c in candidates):
                    candidates.append((g, j, key, [block]))
        for g in self._offloaded:
            if self.groups[g].is_state:
                continue
            tokens = self._tokens[g]
            start = state.stored_blocks[g]
            complete = num_computed_tokens // tokens
            if decoding and self.groups[g].volatile_tail:
                complete -= 1  # a draft layer's last block is rewritten until the next one is
            end = min(complete, self._blocks.num_full(hashes, g), len(state.block_ids[g]) // f)
            if end <= start:
                continue
            device = state.block_ids[g]
            keys = self._blocks.request_keys(state.keys[g], hashes, g, start, end)
            if self._reuse.active:
                # blocks its match did not touch (it generated them) are asked for now, once
                self._reuse.count(keys[max(0, state.touched_blocks[g] - start) :])
            candidates += [
                (g, j, key, device[j * f : (j + 1) * f])
                for j, key in zip(range(start, end), keys)
                if self.null_block_id not in device[j * f : (j + 1) * f]
            ]
            state.stored_blocks[g] = end
        candidates.sort(key=lambda c: c[0])  # group-major, as the host spec lists host blocks
        if self._reuse.active:
            allowed = [c for c in candidates if self._reuse.allows(c[2])]
            self.stats.skipped_stores += len(candidates) - len(allowed)
            candidates = allowed
        if not candidates:
            return None
        out, kept = self._reserve(candidates)
        # Blocks the tier had no room for are not stored and not offered again.
        self.stats.declined_stores += len(candidates) - len(kept)
        if out is None or not out.keys_to_store:
            return None
        candidates = kept
        chosen = set(out.keys_to_store)
        device_ids: list[int] = []
        sizes = [0] * len(self.groups)
        indices = [0] * len(self.groups)
        keys: list[OffloadKey] = []
        fenced: list[int] = []
        for g, j, key, ids in candidates:
            if key not in chosen:
                continue
            if sizes[g] == 0:
                indices[g] = j * f
            device_ids += ids
            sizes[g] += f
            keys.append(key)
            if self.groups[g].is_state:
                fenced += ids
            self._remember(state, hashes, g, j, key)
        job = self._new_job(req_id, True, keys)
        for block in fenced:
            self._fenced.setdefault(block, set()).add(job)
        return TransferJob(job, req_id, True, DeviceLoadStoreSpec(device_ids, sizes, indices), out.store_spec)

    def _reserve(self, candidates: list[tuple[int, int, OffloadKey, Sequence[int]]]):
        """``prepare_store`` of the candidates, or of the leading part by token position
        that the tier can make room for (it refuses a batch whole: halve until it fits,
        as a prefix is what later requests can load). Returns ``(output or None, the
        candidates asked for)``, in the given (group-major) order."""
        out = self.manager.prepare_store([c[2] for c in candidates])
        if out is not None:
            return out, candidates
        tokens = self._tokens
        by_position = sorted(
            range(len(candidates)), key=lambda i: (candidates[i][1] * tokens[candidates[i][0]], i)
        )  # a state with the attention blocks before it
        count = len(candidates) // 2
        while count:
            kept = [candidates[i] for i in sorted(by_position[:count])]
            out = self.manager.prepare_store([c[2] for c in kept])
            if out is not None:
                return out, kept
            count //= 2
        return None, []

    def _remember(self, state: RequestState, hashes, g: int, j: int, key: OffloadKey) -> None:
        """What offloaded block ``j`` of group ``g`` holds, for its ``BlockStored``."""
        tokens = self._tokens[g]
        parent = self._blocks.hash_at(hashes, g, j - 1) if j > 0 else None
        extra = self._extra_keys(state.request, j * tokens, (j + 1) * tokens)
        self._events.remember(key, parent, state.request.all_token_ids, j * tokens, (j + 1) * tokens, extra)

    # -- completions ---------------------------------------------------------------------

    def complete_jobs(self, results: Iterable[tuple[int, bool]]) -> None:
        """Apply ``(job_id, success)`` outcomes; unknown job ids raise ``KeyError``."""
        for job_id, success in results:
            job = self._jobs.pop(job_id, None)
            if job is None:
                raise KeyError(f"unknown transfer job {job_id}")
            state = self._requests.get(job.req_id)
            if job_id in self._stale_jobs:
                # its keys went with the reset; the tier may have reserved them afresh
                self._stale_jobs.discard(job_id)
            elif job.token is not None:
                self.manager.complete_transfer(job.token, success)
                if not success:
                    self.stats.failed_tier_transfers += 1
            elif job.is_store:
                self.manager.complete_store(job.keys, success)
                if success:
                    self.stats.blocks_stored += len(job.keys)
                    if state is not None:
                        state.inserted.update(job.keys)
                else:
                    self.stats.failed_stores += 1
                    self._events.forget(job.keys)
            else:
                self.manager.complete_load(job.keys)
                if success:
                    self.stats.blocks_loaded += len(job.keys)
                    if state is not None:
                        state.reused.update(job.keys)
                else:
                    self.stats.failed_loads += 1
                    self.stats.failed_load_tokens += job.tokens
                    if state is not None:
                        state.load_failed = True
            if state is not None:
                state.jobs.discard(job_id)
                if state.finished and not state.jobs:
                    del self._requests[job.req_id]
                    self._freeable.add(job.req_id)
                    self._finish(state)

    def request_finished(self, req_id: str) -> bool:
        """Whether the engine must hold the request's device blocks until its jobs finish."""
        state = self._requests.get(req_id)
        if state is None:
            return False
        # A load planned but not yet sent will never run: release its pins now. It is
        # cancelled, not failed: nothing was loaded and nothing went wrong.
        for load in [job for job in self._pending_loads if job.req_id == req_id]:
            self._pending_loads.remove(load)
            job = self._jobs.pop(load.job_id)
            self.manager.complete_load(job.keys)
            self.stats.tokens_loaded -= job.tokens
            self.stats.loads_planned -= 1
            for medium, count in state.load_sources.items():
                self.tokens_by_source[medium] -= count
            state.jobs.discard(load.job_id)
        if not state.jobs:
            del self._requests[req_id]
            self._finish(state)
            return False
        state.finished = True
        self._hold[req_id] = sorted(state.jobs)
        return True

    def load_sources(self, req_id: str) -> dict[str, int]:
        """The tokens of the request's last planned load per medium they came from
        (``kvoffload.scheduler.sources``); empty for a request that loaded nothing."""
        state = self._requests.get(req_id)
        return dict(state.load_sources) if state is not None else {}

    def take_freeable(self) -> set[str]:
        """Finished requests whose held device blocks may now be freed."""
        freeable, self._freeable = self._freeable, set()
        return freeable

    # -- events and reset ----------------------------------------------------------------

    def take_events(self) -> list[KVEvent]:
        """Wire events (``BlockStored``/``BlockRemoved``/``AllBlocksCleared``) since the last call."""
        events = self._wire_events + self._events.convert(self.manager.take_events())
        self._wire_events = []
        return events

    def reset(self) -> None:
        """Drop every offloaded block, also while transfers are in flight (as vLLM's own
        offloading connector does: vLLM's pause and sleep fail on a refused reset).

        Jobs in flight keep running: the next plan's ``flush`` makes the worker wait for
        them before that step's jobs, which may reuse their host blocks, start; their
        outcomes are not applied. Requests still running offload their blocks again.
        Refused (``RuntimeError``) only between ``on_allocated`` planning a load and
        ``build_step`` handing it out (inside one engine step): that load would read host
        blocks the reset frees."""
        if self._pending_loads:
            raise RuntimeError(
                f"cannot reset the offloading tier with {len(self._pending_loads)} loads planned but not sent"
            )
        for job_id, job in self._jobs.items():
            if job_id not in self._stale_jobs:
                self._flush.setdefault(job.req_id, []).append(job_id)
        self._stale_jobs.update(self._jobs)
        for state in self._requests.values():
            state.stored_blocks = [0] * len(self.groups)
            self._finish(state)  # no request's lifecycle spans a reset
        self._wire_events += self._events.convert(self.manager.take_events())
        self.manager.reset()
        self.manager.take_events()  # the reset's own removals are said by AllBlocksCleared
        self._events.clear()
        self._wire_events.append(self._events.cleared())
        for state in self._requests.values():
            if not state.finished:  # still running: announced afresh
                state.inserted, state.reused, state.announced = set(), set(), True
                self.manager.on_new_request(state.context)

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    # -- helpers -------------------------------------------------------------------------

    def _state(self, request: RequestView, hints: Mapping[str, Any] | None) -> RequestState:
        state = self._requests.get(request.request_id)
        if state is None:
            n = len(self.groups)
            context = RequestContext(request.request_id, hints or {}, tuple(self._tokens))
            state = RequestState(request, context, [[] for _ in range(n)], [0] * n, [0] * n)
            state.keys, state.loaded_blocks = [[] for _ in range(n)], [0] * n
            self._requests[request.request_id] = state
            self.manager.on_new_request(context)
        return state

    def _finish(self, state: RequestState) -> None:
        """Tell the manager the request ended (once per ``on_new_request``)."""
        if not state.announced:
            return
        state.announced = False
        hashes = self._blocks.hashes(state.request)
        key_groups = []
        for g, tokens in enumerate(self._tokens):
            if not self.groups[g].offloaded:
                key_groups.append([])
                continue
            blocks = max(state.computed_tokens // tokens, state.loaded_blocks[g])
            key_groups.append(
                self._blocks.request_keys(
                    state.keys[g], hashes, g, 0, min(self._blocks.num_full(hashes, g), blocks)
                )
            )
        # the sets are the request's own: it is forgotten (or they are replaced) after this
        self.manager.on_request_finished(
            state.context, key_groups, state.inserted, state.reused - state.inserted
        )

    def _new_job(self, req_id: str, is_store: bool, keys: list[OffloadKey], token: int | None = None) -> int:
        job_id = self._next_job_id
        self._next_job_id += 1
        self._jobs[job_id] = Job(req_id, is_store, keys, token)
        if req_id:
            self._requests[req_id].jobs.add(job_id)
        return job_id
