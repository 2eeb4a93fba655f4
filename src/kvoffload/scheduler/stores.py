"""Step building and store planning: the ``StepPlan`` of each engine step.

3. ``build_step(scheduled, preempted, running)``: returns the ``StepPlan``: planned loads,
   and stores of every offloaded block whose tokens are computed once this step has run.
   ``running`` is the cheap form of a ``StepRequest`` for the bulk of a decode step: a
   ``RunningRequests`` (parallel lists: ids, computed tokens, new device blocks or
   ``None``) or ``(req_id, num_computed_tokens)`` pairs (no new device blocks), of
   requests with no states and no replaced block table. A request is looked at only once
   its computed tokens reach its next offloaded block's end: a step of a thousand decoding
   requests where none does runs a few C loops over the lists and no Python per request.

Stores of one step are reserved together: one ``prepare_store`` for the blocks of every
request (group-major), one ``TransferJob`` of them all (``req_id`` ``""`` when it holds
blocks of several requests; the scheduler knows each request's part, and each request
counts the job among its own). Where the tier cannot take them all at once, each request's
blocks are reserved on their own, as a prefix (see ``_reserve``). A request with states
(Mamba) gets its own job. Where the running requests that reached a block end are many and
their blocks one group's, they are planned in one pass (``kvoffload.scheduler.running``),
with exactly this outcome.

A request that loaded blocks from the tier is not offered them for storing again: they
are in the tier already (``RequestState.loaded_range``).

Tier choice (``kvoffload.sessions.TierChoice``): a request that stores nowhere is never
offered anything (its store bound is never); one that stores to some lower tiers only
has its blocks written through to those alone (the tiered manager's
``limit_write_through``, said just before its store job completes).

Reuse filter: with ``store_threshold=n > 1`` a block is offered for storing only once
``n`` requests asked for it (``kvoffload.scheduler.reuse``); the blocks held back are
counted in ``stats.skipped_stores``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import compress, repeat
from operator import is_not

from kvoffload.keys import OffloadKey
from kvoffload.scheduler.blocks import device_spec
from kvoffload.scheduler.passes import advance_below, append_blocks, note_running
from kvoffload.scheduler.running import _NEVER, Flat, RunningStores, _one
from kvoffload.scheduler.state import RequestState
from kvoffload.scheduler.types import RunningRequests, StepPlan, StepRequest, TransferJob

# (group, offloaded block, key, device blocks)
Candidate = tuple[int, int, OffloadKey, Sequence[int]]
# (request id, its state, its hashes, its candidates)
Offer = tuple[str, RequestState, Sequence[bytes], list[Candidate]]


class Stores(RunningStores):
    """``build_step`` of the ``OffloadingScheduler``."""

    # False: every step's running requests go through the full pass (the reference path)
    quiet_steps = True

    def build_step(
        self,
        scheduled: Iterable[StepRequest],
        preempted: Iterable[str] = (),
        running: RunningRequests | Iterable[tuple[str, int]] = (),
    ) -> StepPlan:
        plan = StepPlan(loads=self._pending_loads)
        self._pending_loads = []
        for transfer in self.manager.take_transfers():
            job_id = self._new_job("", False, [], transfer.token)
            plan.transfers.append(TransferJob(job_id, "", False, transfer.src_spec, transfer.dst_spec))
        offers: list[Offer] = []
        store_at = self._store_at
        flat_group = self._flat_group()
        for step in scheduled:
            state = self._requests.get(step.req_id)
            if state is None:
                continue
            computed = step.num_computed_tokens
            self._computed_tokens(step.req_id, state)
            state.computed_tokens = max(state.computed_tokens, computed)
            if step.new_block_ids is not None:
                self._flush_fenced(step.new_block_ids)
                if step.replace_block_ids:
                    state.block_ids = [list(ids) for ids in step.new_block_ids]
                else:
                    for ids, new in zip(state.block_ids, step.new_block_ids):
                        ids.extend(new)
            if step.states:  # its own job (a state's device block is fenced by it)
                job = self._own_job(self._offer(step.req_id, state, computed, step.states))
                if job is not None:
                    plan.stores.append(job)
            elif computed >= store_at.get(step.req_id, 0):
                offers.append(self._offer(step.req_id, state, computed))
        if not isinstance(running, RunningRequests):
            pairs = list(running)
            running = RunningRequests([p[0] for p in pairs], [p[1] for p in pairs])
        ids, computed = running.req_ids, running.computed
        new_block_ids = running.new_block_ids
        if new_block_ids is not None and new_block_ids.count(None) != len(new_block_ids):
            self._append_blocks(ids, new_block_ids)  # (most decode steps give none: one C scan)
        if ids:
            reached = self._note_running(ids, computed)
            if reached:
                pairs = [(ids[i], computed[i]) for i in reached]
                if flat_group is None:
                    requests = self._requests
                    for req_id, tokens in pairs:
                        offers.append(self._offer(req_id, requests[req_id], tokens))
                else:  # one pass over them all (kvoffload.scheduler.running)
                    flat = Flat()
                    for offer in offers:
                        self._add_offer(flat, offer)
                    offers = []
                    self._offer_running(flat, pairs)
                    plan.stores += self._store_flat(flat)
        plan.stores += self._store_jobs([offer for offer in offers if offer[3]])
        for req_id in preempted:
            state = self._requests.get(req_id)
            if state is not None:
                self._computed_tokens(req_id, state)
                if state.jobs:
                    self._flush[req_id] = sorted(state.jobs)
        plan.hold_blocks, self._hold = self._hold, {}
        plan.flush, self._flush = self._flush, {}
        return plan

    def _note_running(self, ids: Sequence[str], computed: Sequence[int]) -> list[int]:
        """The computed tokens of the running requests noted (a running request's only grow
        but for rejected draft tokens, whose KV never counted); the indices of those that
        reached their next store bound.

        One C loop over the ids and the scheduler's tables (``passes.note_running``), unless
        the step is quiet: the same ids as the last pass, no store bound written since, and
        none of them advanced by the pass's slack (the least gap to a bound then). Then
        nobody reached, and the counts are kept to be folded in when read."""
        quiet = self._quiet if self.quiet_steps else None
        if quiet is not None and quiet[0] == ids and advance_below(computed, quiet[1], quiet[2]):
            self._unfolded = (quiet[0], list(computed))
            return []
        self._fold_running()
        known = self._running_computed
        reached, slack = note_running(ids, computed, known, self._store_at)
        if len(known) > len(self._requests):  # ids of requests it does not know
            for req_id in [r for r in known if r not in self._requests]:
                del known[req_id]
        self._quiet = None if reached else (list(ids), list(computed), slack)
        return reached

    def _append_blocks(self, ids: Sequence[str], new_block_ids: Sequence) -> None:
        """The device blocks a decode step gave some of the running requests."""
        if not self._fenced:
            append_blocks(ids, new_block_ids, self._requests)  # (one loop)
            return
        requests = self._requests
        for req_id, new in compress(zip(ids, new_block_ids), map(is_not, new_block_ids, repeat(None))):
            state = requests.get(req_id)
            if state is not None:
                self._flush_fenced(new)
                for have, more in zip(state.block_ids, new):
                    have += more

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

    def _offer(
        self, req_id: str, state: RequestState, num_computed_tokens: int, states: Iterable = ()
    ) -> Offer:
        """The blocks of the request to store now, in group-major order (its
        ``stored_blocks`` move past them, and its next store bound with them); none for
        a request whose tier choice stores nowhere."""
        if state.context.directives.tiers.stores_nowhere:
            return req_id, state, (), []
        hashes = self._blocks.hashes(state.request)
        candidates: list[Candidate] = []
        f = self.blocks_per_offload_block
        prompt = state.request.num_prompt_tokens
        decoding = num_computed_tokens > prompt
        if self.offload_prompt_only:
            num_computed_tokens = min(num_computed_tokens, prompt)
        for g, block, end_tokens in states or ():
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
        null = self.null_block_id
        blocks = self._blocks
        reuse = self._reuse.active
        stored = state.stored_blocks
        for g, tokens, volatile in self._block_groups:
            start = stored[g]
            complete = num_computed_tokens // tokens
            if decoding and volatile:
                complete -= 1  # a draft layer's last block is rewritten until the next one is
            device = state.block_ids[g]
            end = min(complete, blocks.num_full(hashes, g), len(device) // f)
            if end <= start:
                continue
            keys = blocks.request_keys(state.keys[g], hashes, g, start, end)
            if reuse:
                # blocks its match did not touch (it generated them) are asked for now, once
                self._reuse.count(keys[max(0, state.touched_blocks[g] - start) :])
            stored[g] = end
            lo, hi = state.loaded_range[g] if state.loaded_range else (0, 0)
            for a, b in ((start, min(end, lo)), (max(start, hi), end)) if lo < hi else ((start, end),):
                if a >= b:
                    continue
                if f == 1 and null not in device[a:b]:
                    group_keys = keys[a - start : b - start]
                    candidates += zip(repeat(g), range(a, b), group_keys, map(_one, device[a:b]))
                    continue
                candidates += [
                    (g, j, key, device[j * f : (j + 1) * f])
                    for j, key in zip(range(a, b), keys[a - start : b - start])
                    if null not in device[j * f : (j + 1) * f]
                ]
        self._next_store(req_id, state)
        if len(self._offloaded) > 1:
            candidates.sort(key=lambda c: c[0])  # group-major, as the host spec lists host blocks
        if self._reuse.active:
            allowed = [c for c in candidates if self._reuse.allows(c[2])]
            self.stats.skipped_stores += len(candidates) - len(allowed)
            candidates = allowed
        return req_id, state, hashes, candidates

    def _store_jobs(self, offers: list[Offer]) -> list[TransferJob]:
        """One job for the offers of several requests, reserved in one call; each on its
        own (``_own_job``) where the tier cannot take them all."""
        if len(offers) < 2:
            return [job for job in map(self._own_job, offers) if job is not None]
        candidates = [(c, offer) for offer in offers for c in offer[3]]
        if len(self._offloaded) > 1:
            candidates.sort(key=lambda pair: pair[0][0])  # stable: each request's order kept
        out = self.manager.prepare_store([c[2] for c, _ in candidates])
        if out is None:
            return [job for job in map(self._own_job, offers) if job is not None]
        return self._picked_job(out, candidates)

    def _picked_job(self, out, candidates: list[tuple[Candidate, Offer]]) -> list[TransferJob]:
        """The job of the candidates the tier reserved (``out``), in one call for all."""
        chosen = set(out.keys_to_store)
        parts: dict[str, list[OffloadKey]] = {}
        picked: list[tuple[Candidate, Offer]] = []
        for c, offer in candidates:
            if c[2] in chosen:
                chosen.discard(c[2])  # a key two requests offer is stored once (the first's)
                picked.append((c, offer))
                parts.setdefault(offer[0], []).append(c[2])
        if not picked:
            return []
        keys, spec = self._device_side(picked)
        if len(parts) == 1:
            req_id = next(iter(parts))
            return [TransferJob(self._new_job(req_id, True, keys), req_id, True, spec, out.store_spec)]
        job = self._new_job("", True, keys)
        self._jobs[job].parts = list(parts.items())
        for req_id in parts:
            self._requests[req_id].jobs.add(job)
        return [TransferJob(job, "", True, spec, out.store_spec)]

    def _own_job(self, offer: Offer) -> TransferJob | None:
        """The store job of one request's offer (its blocks reserved as a prefix)."""
        req_id, _, _, candidates = offer
        if not candidates:
            return None
        out, kept = self._reserve(candidates)
        # Blocks the tier had no room for are not stored and not offered again.
        self.stats.declined_stores += len(candidates) - len(kept)
        if out is None or not out.keys_to_store:
            return None
        chosen = set(out.keys_to_store)
        keys, spec = self._device_side([(c, offer) for c in kept if c[2] in chosen])
        job = self._new_job(req_id, True, keys)
        for g, _, key, ids in kept:
            if self.groups[g].is_state and key in chosen:
                for block in ids:
                    self._fenced.setdefault(block, set()).add(job)
        return TransferJob(job, req_id, True, spec, out.store_spec)

    def _device_side(self, picked: list[tuple[Candidate, Offer]]):
        """The keys and the device spec of the reserved candidates (group-major, in the
        order of the tier's ``keys_to_store``); what each key's ``BlockStored`` says."""
        f = self.blocks_per_offload_block
        device_ids: list[int] = []
        sizes = [0] * len(self.groups)
        indices = [0] * len(self.groups)
        keys: list[OffloadKey] = []
        remember = self._remember
        for (g, j, key, ids), (_, state, hashes, _) in picked:
            if sizes[g] == 0:
                # (only its offset in an offloaded block counts: 0, stores being of whole ones)
                indices[g] = j * f
            device_ids += ids
            sizes[g] += f
            keys.append(key)
            remember(state, hashes, g, j, key)
        return keys, device_spec(device_ids, sizes, indices)

    def _next_store(self, req_id: str, state: RequestState) -> None:
        """The computed tokens below which ``_offer`` of a request that only ran finds
        nothing new: the end of its next offloaded block in any group (never, with
        ``offload_prompt_only``, past the prompt). A lower bound: crossing it only means
        looking."""
        stored = state.stored_blocks
        ends = [(stored[g] + 1) * tokens for g, tokens, _ in self._block_groups]
        if self.offload_prompt_only:
            prompt = state.request.num_prompt_tokens
            ends = [end for end in ends if end <= prompt]
        self._store_at[req_id] = min(ends, default=_NEVER)
        self._quiet = None

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
