"""What crosses between vLLM's scheduler and worker processes each step.

``KVOffloadMetadata`` (scheduler -> worker) carries the step's ``StepPlan``.
``KVOffloadWorkerMetadata`` (worker -> scheduler) carries finished jobs as
``{job_id: success}``; with several workers a job counts as successful only if it
succeeded on every worker, and it is complete once every worker has reported it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from kvoffload.scheduler import StepPlan


@dataclass
class KVOffloadMetadata(KVConnectorMetadata):
    plan: StepPlan
    # The step schedules no tokens: no forward pass runs, so the worker may wait a little
    # for its loads in flight (``idle_wait_s``) instead of letting the engine spin.
    idle: bool = False
    # Load jobs whose requests run in this very step (``sync_load_budget_bytes``): the
    # worker finishes them before the forward pass and reports no ``finished_recving``.
    sync_loads: frozenset[int] = frozenset()


@dataclass
class KVOffloadWorkerMetadata(KVConnectorWorkerMetadata):
    # job id -> (number of workers reporting, all succeeded)
    finished: dict[int, tuple[int, bool]] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, KVOffloadWorkerMetadata):
            raise TypeError(f"cannot aggregate {type(other).__name__} into KVOffloadWorkerMetadata")
        merged = dict(self.finished)
        for job_id, (count, ok) in other.finished.items():
            prev_count, prev_ok = merged.get(job_id, (0, True))
            merged[job_id] = (prev_count + count, prev_ok and ok)
        return KVOffloadWorkerMetadata(merged)
