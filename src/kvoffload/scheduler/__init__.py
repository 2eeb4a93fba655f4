"""The request lifecycle of offloading: which blocks to load and store each step."""

from kvoffload.scheduler.core import OffloadingScheduler, SchedulerStats
from kvoffload.scheduler.events import EVENT_MODES, EventConverter
from kvoffload.scheduler.types import KVGroup, RequestView, StepPlan, StepRequest, TransferJob

__all__ = [
    "EVENT_MODES",
    "EventConverter",
    "KVGroup",
    "OffloadingScheduler",
    "RequestView",
    "SchedulerStats",
    "StepPlan",
    "StepRequest",
    "TransferJob",
]
