"""Step building and store planning: the ``StepPlan`` of each engine step.

3. ``build_step(scheduled, preempted, running)``: returns the ``StepPlan``: planned loads,
   and stores of every offloaded block whose tokens are computed once this step has run.
   ``running`` is the cheap form of a ``StepRequest`` for the bulk of a decode step:
   ``(req_id, num_computed_tokens)`` of a request that got no new device blocks, no
   states and no replaced block table; a request is looked at further only once its
   computed tokens reach its next offloaded block's end (so a step of a thousand
   decoding requests costs a dict lookup and a comparison for most of them).

Reuse filter: with ``store_threshold=n > 1`` a block is offered for storing only once
``n`` requests asked for it (``kvoffload.scheduler.reuse``); the blocks held back are
counted in ``stats.skipped_stores``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from kvoffload.keys import OffloadKey
from kvoffload.scheduler.base import SchedulerBase
from kvoffload.scheduler.state import RequestState
from kvoffload.scheduler.types import StepPlan, StepRequest, TransferJob
from kvoffload.specs import DeviceLoadStoreSpec

_NEVER = float("inf")


def _device_spec(block_ids: list[int], sizes: list[int], indices: list[int]) -> DeviceLoadStoreSpec:
    """``DeviceLoadStoreSpec(block_ids, sizes, indices)`` without its checks of outside
    input (about 20 us, most of a one-block store's planning on the engine's step): the
    lists built above are non-negative ints whose sizes add up to the ids."""
    spec = DeviceLoadStoreSpec.__new__(DeviceLoadStoreSpec)
    spec.block_ids = np.array(block_ids, dtype=np.int64)
    spec.group_sizes = np.array(sizes, dtype=np.int64)
    spec.block_indices = np.array(indices, dtype=np.int64)
    return spec


class Stores(SchedulerBase):
    """``build_step`` of the ``OffloadingScheduler``."""

    def build_step(
        self,
        scheduled: Iterable[StepRequest],
        preempted: Iterable[str] = (),
        running: Iterable[tuple[str, int]] = (),
    ) -> StepPlan:
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
            elif (
                not step.states
                and step.num_computed_tokens < state.next_store
                and state.stored_blocks == state.next_store_from
            ):
                continue  # nothing new to store (as for ``running``)
            job = self._plan_store(step.req_id, state, step.num_computed_tokens, step.states)
            if job is not None:
                plan.stores.append(job)
        requests = self._requests
        for req_id, computed in running:
            state = requests.get(req_id)
            if state is None:
                continue
            if computed > state.computed_tokens:
                state.computed_tokens = computed
            # a store is possible only past the next block's end (with the counts it was
            # worked out from unchanged)
            if computed < state.next_store and state.stored_blocks == state.next_store_from:
                continue
            job = self._plan_store(req_id, state, computed)
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
        self._next_store(state)
        if len(self._offloaded) > 1:
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
        return TransferJob(job, req_id, True, _device_spec(device_ids, sizes, indices), out.store_spec)

    def _next_store(self, state: RequestState) -> None:
        """The computed tokens below which ``_plan_store`` of a request that only ran finds
        nothing new: the end of its next offloaded block in any group (never, with
        ``offload_prompt_only``, past the prompt). A lower bound: crossing it only means
        looking."""
        stored = state.stored_blocks
        prompt = state.request.num_prompt_tokens
        ends = []
        for g in self._offloaded:
            group = self.groups[g]
            if group.is_state:  # states come with their step (StepRequest.states)
                continue
            end = (stored[g] + 1) * self._tokens[g]
            if not (self.offload_prompt_only and end > prompt):
                ends.append(end)
        state.next_store = min(ends, default=_NEVER)
        state.next_store_from = list(stored)

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
