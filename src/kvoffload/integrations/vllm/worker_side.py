"""The worker half of ``KVOffloadConnector``: runs each step's plan on the tiers' worker
(an ``OffloadingWorker`` from ``kvoffload.tiers.factory``).

Per step (vLLM's call order): ``handle_preemptions`` waits for the jobs of preempted
requests and submits the step's promotions (before vLLM prepares the step's inputs);
``start_load_kv`` submits loads (before the forward pass); ``wait_for_save``
submits stores (after it, when the blocks hold this step's KV), and with ``sync_stores``
(by default when the KV cache is in host memory) waits for them; ``get_finished`` polls
results and reports requests whose loads finished (``finished_recving``) and held
requests whose jobs all finished (``finished_sending``), without waiting, except in a step
without a forward pass, where it first waits up to ``idle_wait_s`` for the loads and tier
transfers in flight; ``build_worker_meta`` sends the
finished jobs to the scheduler. A failed load is reported so that the engine recomputes
what it did not get: on a model with one KV-cache group by its device blocks
(``get_block_ids_with_load_errors``: the blocks before the first failed one stay computed),
on a model with several by its request (``failed_recving``: vLLM maps block ids back to
requests only when they are unique to one group, and refuses block-level failures there).
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Mapping
from typing import Any

import torch
from vllm.v1.kv_cache_interface import KVCacheConfig

from kvoffload.faults import FaultInjectingWorker
from kvoffload.integrations.vllm.config import OffloadConfig
from kvoffload.integrations.vllm.groups import kv_groups
from kvoffload.integrations.vllm.identity import kv_identity
from kvoffload.integrations.vllm.layout import build_layout, check_layout, host_block_bytes
from kvoffload.integrations.vllm.metadata import KVOffloadWorkerMetadata
from kvoffload.integrations.vllm.stats import WorkerMetrics
from kvoffload.scheduler import StepPlan, TransferJob
from kvoffload.specs import MEDIUM_CPU
from kvoffload.tiers.factory import build_worker
from kvoffload.transfer import KVLayout
from kvoffload.worker import OffloadingWorker

logger = logging.getLogger(__name__)

SYNC_STORES_TIMEOUT_S = 30.0  # the longest a step waits for its stores (sync_stores)


class WorkerSide:
    def __init__(self, vllm_config: Any, kv_cache_config: KVCacheConfig, config: OffloadConfig) -> None:
        self._vllm_config = vllm_config
        self._kv_cache_config = kv_cache_config
        self._config = config
        self.worker: OffloadingWorker | None = None
        self.layout: KVLayout | None = None  # the offloaded pages of vLLM's KV cache
        self._jobs: dict[int, TransferJob] = {}  # submitted, not finished
        self._held: dict[str, set[int]] = {}
        self._finished: dict[int, tuple[int, bool]] = {}
        self._load_errors: set[int] = set()
        self._failed_requests: set[str] = set()  # multi-group models: failed loads by request
        self._per_request = kv_cache_config is not None and len(kv_cache_config.kv_cache_groups) > 1
        self._rejected_loads: set[str] = set()  # requests whose load failed at submit
        self._sync_jobs: set[int] = set()  # loads whose request runs in their step
        self._early: set[int] = set()  # promotions handle_preemptions submitted for this step
        self.metrics = WorkerMetrics()  # every job's outcome, for kvoffload.metrics and vLLM's stats
        # "auto" is decided by the KV cache's device in register_kv_caches
        self.sync_stores = config is not None and config.sync_stores is True

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        interval = self._config.switch_interval_s
        if interval and sys.getswitchinterval() > interval:
            logger.info("kvoffload: switch interval %g s -> %g s", sys.getswitchinterval(), interval)
            sys.setswitchinterval(interval)
        kv_config, tiers = self._kv_cache_config, self._config.tiers
        offloaded = [g for g, group in enumerate(kv_groups(self._vllm_config, kv_config)) if group.offloaded]
        f = tiers.blocks_per_offload_block
        layout = self.layout = build_layout(kv_caches, kv_config, offloaded, len(kv_config.kv_cache_groups))
        if self._config.sync_stores == "auto":
            self.sync_stores = layout.device.type == "cpu"
        per_block = check_layout(layout, host_block_bytes(kv_config, offloaded, f), f)
        identity = kv_identity(self._vllm_config, kv_config, offloaded, f)
        parallel = self._vllm_config.parallel_config
        self.worker = build_worker(tiers, layout, per_block, identity, parallel.rank, parallel.world_size)
        if self._config.faults is not None:  # the fault_injection key: tests and drills only
            self.worker = FaultInjectingWorker(self.worker, self._config.faults)
            logger.warning("kvoffload: fault injection is on: %s", self._config.faults)
        num_blocks = tiers.num_host_blocks(per_block, parallel.world_size)
        logger.info(
            "kvoffload: rank %d: %d host blocks (%.1f MiB) for %s",
            parallel.rank,
            num_blocks,
            num_blocks * per_block / 2**20,
            layout,
        )
        self.metrics.attach(self.worker, [tier.type_name for tier in tiers.secondary_tiers])

    def handle_preemptions(self, plan: StepPlan) -> None:
        """Wait for the jobs of preempted requests, then start the step's promotions: vLLM's
        model runner calls this first in a step and ``start_load_kv`` only once it prepared
        the step's inputs, so the lower tier's read overlaps that preparation. A promotion
        writes only host blocks the scheduler reserved for it (no device block)."""
        jobs = [job for ids in plan.flush.values() for job in ids]
        if jobs and self.worker is not None:
            self.worker.wait(jobs)
        if self.worker is not None:
            promotions = [job for job in plan.transfers if job.dst_spec.medium == MEDIUM_CPU]
            self._submit(promotions)
            self._early.update(job.job_id for job in promotions)

    def start_loads(self, plan: StepPlan, sync_loads: frozenset[int] = frozenset()) -> None:
        """Submit the step's promotions, loads and other transfers, in that order: a load
        the scheduler chained on a promotion (it reads host blocks the promotion fills) is
        held by the worker until the promotion succeeded, and fails unrun if it did not
        (``kvoffload.worker.WorkerRouter``); the promotion must be submitted first for
        that. The loads in ``sync_loads`` (their requests run in this step) are waited
        for, chained ones with their promotions: a failure among them is reported by its
        device blocks (``take_load_errors``), never as ``finished_recving``."""
        for req_id, jobs in plan.hold_blocks.items():
            self._held[req_id] = set(jobs)
        self._sync_jobs.update(sync_loads)
        promotions = [job for job in plan.transfers if job.dst_spec.medium == MEDIUM_CPU]
        early, self._early = self._early, set()
        self._submit([job for job in promotions if job.job_id not in early])  # not in handle_preemptions
        self._submit(plan.loads)
        if sync_loads:
            waiting = [job for job in sync_loads if job in self._jobs]
            try:
                self.worker.wait(waiting, SYNC_STORES_TIMEOUT_S)
            except TimeoutError as exc:  # the step cannot run on KV that is not there
                raise RuntimeError(f"kvoffload: loads of this step still copying: {exc}") from exc
        if len(promotions) < len(plan.transfers):  # write-through: no device block, no hurry
            self._submit([job for job in plan.transfers if job.dst_spec.medium != MEDIUM_CPU])

    def start_stores(self, plan: StepPlan) -> None:
        self._submit(plan.stores)
        if self.sync_stores and plan.stores:
            # The results stay with the worker: get_finished reports them as usual. A copy
            # that does not end in time is left running (reported when it ends), never a
            # step that hangs.
            try:
                self.worker.wait([job.job_id for job in plan.stores], SYNC_STORES_TIMEOUT_S)
            except TimeoutError as exc:
                logger.warning("kvoffload: stores still copying after %gs: %s", SYNC_STORES_TIMEOUT_S, exc)

    def _submit(self, jobs: list[TransferJob]) -> None:
        assert self.worker is not None, "register_kv_caches was not called"
        for job in jobs:
            self._jobs[job.job_id] = job
            try:
                self.worker.submit(job.job_id, job.src_spec, job.dst_spec)
                self.metrics.started(job)
            except Exception as exc:  # noqa: BLE001 - a job that cannot start fails; vLLM must not see it
                # A worker that raises has not taken the job: no result will come for it.
                logger.error("kvoffload: job %d rejected: %s: %s", job.job_id, type(exc).__name__, exc)
                finished = self._finish(job.job_id, False)
                if finished is not None and not finished[1]:
                    # vLLM holds the request until its load is reported, failed or not.
                    self._rejected_loads.add(finished[0])

    def _finish(self, job_id: int, success: bool, result: Any = None) -> tuple[str, bool] | None:
        job = self._jobs.pop(job_id, None)
        if job is None:
            return None
        self.metrics.finished(job, success, result)
        self._finished[job_id] = (1, success)
        sync = job_id in self._sync_jobs
        self._sync_jobs.discard(job_id)
        if not job.req_id:
            return None  # a transfer between tiers: no request waits on it
        if not job.is_store and not success:
            if self._per_request:
                self._failed_requests.add(job.req_id)
            else:
                self._load_errors.update(int(b) for b in job.dst_spec.block_ids)
        if sync:
            return None  # its request is running: vLLM expects no finished_recving
        return job.req_id, job.is_store

    def get_finished(self, idle: bool = False) -> tuple[set[str], set[str]]:
        """``idle``: the step scheduled no tokens (no forward pass): first wait up to
        ``idle_wait_s`` for the loads and tier transfers in flight."""
        recving, self._rejected_loads = self._rejected_loads, set()
        if idle and self.worker is not None and self._config is not None and self._config.idle_wait_s:
            self._wait_idle_step(self._config.idle_wait_s)
        if self.worker is not None:
            # Poll only, never wait (but above). vLLM 0.32 (``KVConnectorModelRunnerMixin.
            # _get_kv_connector_output``) starts asynchronous loads right after launching
            # the forward pass and calls this straight after, before sampling is queued:
            # waiting here for this step's loads would leave the GPU idle for as long as
            # the load outlasts the forward. Starting loads before the forward is only
            # done for synchronous loads, which these are not. A load that finishes later
            # is reported by the next step's poll; its request waits a step, the engine
            # does not.
            for result in self.worker.poll():
                if not result.success:
                    logger.warning(
                        "kvoffload: %s job %d failed: %s", result.direction, result.job_id, result.error
                    )
                finished = self._finish(result.job_id, result.success, result)
                if finished is not None and not finished[1]:
                    recving.add(finished[0])
        sending = {req for req, jobs in self._held.items() if not jobs & self._jobs.keys()}
        for req in sending:
            del self._held[req]
        return sending, recving

    def _wait_idle_step(self, seconds: float) -> None:
        """In a step without a forward pass, requests that wait for a load (or for a
        promotion from a lower tier) keep vLLM's loop stepping as fast as it can, and that
        loop holds a core and the GIL the transfer threads need. Waiting here (the GIL and
        the core released) lets them run; the step loses nothing it would have done, and a
        new request waits at most ``seconds`` more."""
        jobs = [job_id for job_id, job in self._jobs.items() if not job.is_store]
        if jobs:
            with contextlib.suppress(TimeoutError):  # still running: reported by a later step
                self.worker.wait(jobs, seconds)

    def wait_idle(self, timeout: float | None = None) -> None:
        """Block until every job submitted so far has finished (for tests and shutdown)."""
        if self.worker is not None:
            self.worker.wait(list(self._jobs), timeout)

    def build_worker_meta(self) -> KVOffloadWorkerMetadata | None:
        if not self._finished:
            return None
        meta, self._finished = KVOffloadWorkerMetadata(self._finished), {}
        return meta

    def take_load_errors(self) -> set[int]:
        """Device blocks of failed loads (models with one KV-cache group)."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def take_failed_requests(self) -> set[str]:
        """Requests whose load failed (models with several KV-cache groups); each is
        also among the finished ones ``get_finished`` returned in the same step."""
        failed, self._failed_requests = self._failed_requests, set()
        return failed

    def shutdown(self) -> None:
        self.metrics.close()
        if self.worker is not None:
            self.worker.close()
