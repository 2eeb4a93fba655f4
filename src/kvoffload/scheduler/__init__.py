"""The request lifecycle of offloading: which blocks to load and store each step.

Pure bookkeeping: importing it loads neither torch nor pyzmq."""

from kvoffload._lazy import lazy_exports

_EXPORTS = {
    "OffloadingScheduler": "kvoffload.scheduler.core",
    "SchedulerStats": "kvoffload.scheduler.state",
    "SessionRegistry": "kvoffload.scheduler.sessions",
    "SessionStats": "kvoffload.scheduler.sessions",
    "EVENT_MODES": "kvoffload.scheduler.events",
    "EventConverter": "kvoffload.scheduler.events",
    "KVGroup": "kvoffload.scheduler.types",
    "RequestView": "kvoffload.scheduler.types",
    "RunningRequests": "kvoffload.scheduler.types",
    "StepPlan": "kvoffload.scheduler.types",
    "StepRequest": "kvoffload.scheduler.types",
    "TransferJob": "kvoffload.scheduler.types",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
