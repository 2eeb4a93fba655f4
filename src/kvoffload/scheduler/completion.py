"""Completion and ends: job outcomes, finished requests, the tier's events and reset.

4. ``complete_jobs(results)``: completes loads (unpin) and stores (loadable, or rolled back).
   A promotion's success pins the keys of the loads still chained on it
   (``kvoffload.scheduler.chains``); a chained load unpins only what was pinned, so the
   two may be reported in either order (several workers report a load in the call that
   completes its promotion, in any order).
5. ``request_finished(req_id)`` (finished or aborted): ``True`` when the engine must hold
   the request's device blocks until its jobs complete (listed in the next plan's
   ``hold_blocks``); ``take_freeable()`` then names the requests whose blocks may be freed.
   Once no job of it is in flight the manager hears ``on_request_finished`` with the
   request's keys, those its stores inserted and those its loads reused (the contract in
   ``kvoffload.manager`` says exactly when it fires, on every path).
"""

from __future__ import annotations

from collections.abc import Iterable

from kvoffload.events.types import KVEvent
from kvoffload.manager import prefix_order
from kvoffload.scheduler.base import SchedulerBase
from kvoffload.scheduler.state import RequestState


class Completion(SchedulerBase):
    """``complete_jobs``, ``request_finished``, ``take_events`` and ``reset`` of the
    ``OffloadingScheduler``."""

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
                if self._chains:
                    for keys in self._chains.promoted(job.token, success).values():
                        self.manager.prepare_load(keys)  # loadable now: pinned for its load
            elif job.is_store:
                parts = job.parts if job.parts is not None else [(job.req_id, job.keys)]
                if success and self._store_limits:
                    self._limit_stores(parts)
                self.manager.complete_store(job.keys, success)
                if success:
                    self.stats.blocks_stored += len(job.keys)
                    requests = self._requests
                    for req_id, keys in parts:
                        owner = requests.get(req_id)
                        if owner is not None:
                            owner.inserted.update(keys)
                else:
                    self.stats.failed_stores += 1  # store jobs, one for several requests' blocks
                    self._events.forget(job.keys)
            else:
                self.manager.complete_load(
                    self._chains.pinned(job_id, job.keys) if self._chains else job.keys
                )
                if success:
                    self.stats.blocks_loaded += len(job.keys)
                    if state is not None:
                        state.reused.update(job.keys)
                else:
                    self.stats.failed_loads += 1
                    self.stats.failed_load_tokens += job.tokens
                    if state is not None:
                        state.load_failed = True
            if job.parts is not None:
                requests = self._requests
                for req_id, _ in job.parts:
                    state = requests.get(req_id)
                    if state is not None:
                        state.jobs.discard(job_id)
                        if state.finished and not state.jobs:
                            self._job_ended(req_id, job_id)
            elif state is not None:
                self._job_ended(job.req_id, job_id)

    def _job_ended(self, req_id: str, job_id: int) -> None:
        """A job of request ``req_id`` ended: a finished request with none left is freeable."""
        state = self._requests.get(req_id)
        if state is None:
            return
        state.jobs.discard(job_id)
        if state.finished and not state.jobs:
            del self._requests[req_id]
            self._freeable.add(req_id)
            self._finish(state)
            self._forget(req_id)

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
            self.manager.complete_load(
                self._chains.pinned(load.job_id, job.keys) if self._chains else job.keys
            )
            self.stats.tokens_loaded -= job.tokens
            self.stats.loads_planned -= 1
            for medium, count in state.load_sources.items():
                self.tokens_by_source[medium] -= count
            state.jobs.discard(load.job_id)
        if not state.jobs:
            del self._requests[req_id]
            self._finish(state)
            self._forget(req_id)
            return False
        state.finished = True
        self._hold[req_id] = sorted(state.jobs)
        return True

    def take_freeable(self) -> set[str]:
        """Finished requests whose held device blocks may now be freed."""
        freeable, self._freeable = self._freeable, set()
        return freeable

    # -- events and reset ----------------------------------------------------------------

    def take_events(self) -> list[KVEvent]:
        """Wire events (``BlockStored``/``BlockRemoved``/``AllBlocksCleared``, or the
        ``event_classes`` given for them) since the last call."""
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
        self._chains.clear()
        for state in self._requests.values():
            state.stored_blocks = [0] * len(self.groups)
            state.loaded_range = []
            self._store_at[state.request.request_id] = self._store_start(state.context)
            self._quiet = None
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

    def _finish(self, state: RequestState) -> None:
        """Tell the manager the request ended (once per ``on_new_request``)."""
        if not state.announced:
            return
        state.announced = False
        hashes = self._blocks.hashes(state.request)
        computed = self._computed_tokens(state.request.request_id, state)
        key_groups = []
        for g, tokens in enumerate(self._tokens):
            if not self.groups[g].offloaded:
                key_groups.append([])
                continue
            blocks = max(computed // tokens, state.loaded_blocks[g])
            key_groups.append(
                self._blocks.request_keys(
                    state.keys[g], hashes, g, 0, min(self._blocks.num_full(hashes, g), blocks)
                )
            )
        # the sets are the request's own: it is forgotten (or they are replaced) after this
        self.manager.on_request_finished(
            state.context, key_groups, state.inserted, state.reused - state.inserted
        )
        if state.context.directives.session is not None:
            self.sessions.on_finished(state.context, prefix_order(state.context, key_groups))
