"""``KVOffloadConnector``: kvoffload as a vLLM v1 KV connector.

Enable with::

    kv_transfer_config={"kv_connector": "KVOffloadConnector",
                        "kv_connector_module_path": "kvoffload.integrations.vllm",
                        "kv_role": "kv_both",
                        "kv_connector_extra_config": {"cpu_bytes_to_use": 4 << 30}}

The connector is a thin adapter: the scheduler role delegates to ``SchedulerSide`` (an
``OffloadingScheduler`` over the tiers' manager) and to ``SessionSide`` (requests' session
directives, the control endpoint; each of vLLM's scheduler-side calls holds the lock its
commands take while the engine idles), the worker role to ``WorkerSide`` (the tiers'
worker); both halves are built by ``kvoffload.tiers.factory`` from one config.
Loads are asynchronous: a request with offloaded hits waits until its load finished, then
runs with those tokens computed.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any

import torch
import vllm
from vllm.distributed.kv_events import KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from kvoffload.integrations.vllm.config import parse_extra_config
from kvoffload.integrations.vllm.metadata import KVOffloadMetadata, KVOffloadWorkerMetadata
from kvoffload.integrations.vllm.scheduler_side import SchedulerSide
from kvoffload.integrations.vllm.sessions import SessionSide
from kvoffload.integrations.vllm.stats import (
    KVOffloadConnectorStats,
    KVOffloadPromMetrics,
    SchedulerMetrics,
    cache_hit_sources,
)
from kvoffload.integrations.vllm.worker_side import WorkerSide

logger = logging.getLogger(__name__)


# vLLM releases the connector is tested with (tests/integrations/vllm/test_vllm_versions.py, and the CPU
# build's engine end to end for 0.32)
TESTED_VLLM = ("0.32", "0.33", "0.34")


def check_vllm_version(version: str) -> bool:
    """Whether ``version`` is a tested release; logs a warning naming it when not."""
    if ".".join(version.split(".")[:2]) in TESTED_VLLM:
        return True
    logger.warning(
        "kvoffload: vLLM %s is outside the releases KVOffloadConnector is tested with (%s)",
        version,
        ", ".join(TESTED_VLLM),
    )
    return False


def warn_failure_policy(config: Any, kv_transfer_config: Any) -> bool:
    """With a lower tier, loads can fail (a corrupt block on disk, a Redis server lost
    mid-load): under vLLM's default policy ``fail`` such a request ends in an error.
    Logs a warning saying so; returns whether it did."""
    policy = getattr(kv_transfer_config, "kv_load_failure_policy", "recompute")
    if not config.tiers.secondary_tiers or policy != "fail":
        return False
    logger.warning(
        "kvoffload: with secondary_tiers a load can fail, and kv_load_failure_policy='fail' ends such a "
        "request in an error; set kv_load_failure_policy='recompute' to recompute it instead"
    )
    return True


def _serial(method: Callable) -> Callable:
    """A scheduler-side call of vLLM's, under the connector's lock: a session control that
    runs while the engine idles (``kvoffload.control.queue``) never runs inside one."""

    @functools.wraps(method)
    def call(self: KVOffloadConnector, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return method(self, *args, **kwargs)

    return call


class KVOffloadConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        if role == KVConnectorRole.SCHEDULER:
            check_vllm_version(vllm.__version__)
        if kv_cache_config is None:
            raise ValueError("KVOffloadConnector needs vLLM's kv_cache_config")
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        config = parse_extra_config(extra, vllm_config.cache_config.block_size)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._scheduler_metrics: SchedulerMetrics | None = None
        self._sessions: SessionSide | None = None
        self._lock = threading.Lock()
        if role == KVConnectorRole.SCHEDULER:
            warn_failure_policy(config, vllm_config.kv_transfer_config)
            self._scheduler = SchedulerSide(vllm_config, kv_cache_config, config)
            self._sessions = SessionSide(vllm_config, self._scheduler, config, self._lock)
            names = [tier.type_name for tier in config.tiers.secondary_tiers]
            self._scheduler_metrics = SchedulerMetrics(
                self._scheduler.scheduler, names, self._scheduler.config_info, self._sessions.reader
            )
        else:
            self._worker = WorkerSide(vllm_config, kv_cache_config, config)

    # -- worker role ---------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker_side().register_kv_caches(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        self._worker_side().handle_preemptions(_plan(kv_connector_metadata))

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        self._worker_side().start_loads(_plan(meta), meta.sync_loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads finish before their request is scheduled

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None  # stores copy whole blocks after the forward pass

    def wait_for_save(self) -> None:
        self._worker_side().start_stores(_plan(self._get_connector_metadata()))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        meta = self._connector_metadata  # bound for the step (vLLM binds it before this call)
        sending, recving = self._worker_side().get_finished(
            idle=isinstance(meta, KVOffloadMetadata) and meta.idle
        )
        return sending or None, recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """``get_finished``'s sets, plus the requests whose load failed on a model with
        several KV-cache groups (``failed_recving``; also in ``finished_recving``)."""
        sending, recving = self.get_finished(finished_req_ids)
        failed = self._worker.take_failed_requests() if self._worker is not None else set()
        return KVConnectorTransferResults(set(sending or ()), set(recving or ()), failed)

    def build_connector_worker_meta(self) -> KVOffloadWorkerMetadata | None:
        return self._worker.build_worker_meta() if self._worker is not None else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors() if self._worker is not None else set()

    def shutdown(self) -> None:
        if self._scheduler_metrics is not None:
            self._scheduler_metrics.close()
        if self._worker is not None:
            self._worker.shutdown()
        if self._sessions is not None:
            self._sessions.close()
        if self._scheduler is not None:
            self._scheduler.manager.close()  # e.g. the disk tier's lock on its namespace

    # -- scheduler role ------------------------------------------------------------------

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        null = gpu_block_pool.null_block.block_id
        if self._scheduler is not None and null != self._scheduler.scheduler.null_block_id:
            raise ValueError(
                f"vLLM's null block is {null}, kvoffload assumed {self._scheduler.scheduler.null_block_id}"
            )

    @_serial
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        side = self._scheduler_side()
        return side.get_num_new_matched_tokens(
            request, num_computed_tokens, self._sessions.directives(request)
        )

    @_serial
    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._scheduler_side().update_state_after_alloc(request, blocks, num_external_tokens)

    @_serial
    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        side = self._scheduler_side()
        self._sessions.drain()  # control commands first, on the scheduler thread
        return side.build_connector_meta(scheduler_output)

    @_serial
    def update_connector_output(self, connector_output: Any) -> None:
        self._scheduler_side().update_connector_output(connector_output)

    @_serial
    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """The ``kv_transfer_params`` returned: the request's session directives, when it had any."""
        return self._finished(request)

    @_serial
    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._finished(request)

    def _finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        delay_free = self._scheduler_side().request_finished(request)
        return delay_free, self._sessions.finished(request.request_id)

    def has_pending_push_work(self) -> bool:
        """True while session prefetches are queued or in flight: vLLM then steps an engine
        with no request, so they are issued and finish before the next turn arrives."""
        return self._sessions is not None and self._sessions.pending_work()

    @_serial
    def take_events(self) -> Iterable[KVCacheEvent]:
        return self._scheduler_side().take_events()

    @_serial
    def reset_cache(self) -> bool | None:
        return self._scheduler_side().reset_cache()

    @_serial
    def get_external_cache_hit_sources(self, request: Any, num_external_tokens: int) -> dict[Any, int]:
        """Tokens of the request's load by where they were found: ``host``, ``disk`` (promoted
        from the disk tier for it), ``external_unspecified`` (the shared tier)."""
        if num_external_tokens == 0:
            return {}
        return cache_hit_sources(self._scheduler_side().scheduler.load_sources(request.request_id))

    # -- metrics (both roles) ------------------------------------------------------------

    def get_kv_connector_stats(self) -> KVOffloadConnectorStats | None:
        if self._worker is not None:
            return self._worker.metrics.take_stats()
        if self._scheduler_metrics is not None:
            return self._scheduler_metrics.take_stats(self._scheduler_side().changes)
        return None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVOffloadConnectorStats:
        return KVOffloadConnectorStats(data=data) if data is not None else KVOffloadConnectorStats()

    @classmethod
    def build_prom_metrics(
        cls, vllm_config: Any, metric_types: Any, labelnames: list[str], per_engine_labelvalues: Any
    ) -> KVOffloadPromMetrics:
        return KVOffloadPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def offload_stats(self):
        """The offloading scheduler's counters (``SchedulerStats``), scheduler role only."""
        return self._scheduler_side().scheduler.stats

    @property
    def requires_kv_delivery(self) -> bool:
        """No: kvoffload is a best-effort cache. A preempted request's stores are waited
        for before its blocks are reused (``handle_preemptions``), and a store that did
        not happen is only a later miss, so vLLM need not recompute the request's output."""
        return False

    @classmethod
    def supports_lookahead_block_hashes(cls, kv_transfer_config: Any) -> bool:
        """No (vLLM 0.34 asks): kvoffload keys blocks by the hashes of tokens a request
        already has and has not been checked with vLLM's lookahead hashes (which cover
        tokens not yet decided), so it does not claim to support them."""
        return False

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        # Block dimension outermost in every layer's view: each block's page is one
        # contiguous run of bytes, which the transfer layout needs.
        return "LBHNC"

    # -- helpers -------------------------------------------------------------------------

    def _scheduler_side(self) -> SchedulerSide:
        if self._scheduler is None:
            raise RuntimeError("scheduler-side call on a worker-role KVOffloadConnector")
        return self._scheduler

    def _worker_side(self) -> WorkerSide:
        if self._worker is None:
            raise RuntimeError("worker-side call on a scheduler-role KVOffloadConnector")
        return self._worker


def _plan(metadata: KVConnectorMetadata):
    if not isinstance(metadata, KVOffloadMetadata):
        raise TypeError(f"expected KVOffloadMetadata, got {type(metadata).__name__}")
    return metadata.plan
