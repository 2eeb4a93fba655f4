"""``JobRunner``: run one transfer job on a worker and wait for its result, from any thread.

kvoffload's workers are asynchronous (``submit``, then ``poll`` hands out whatever
finished); SGLang's storage calls are synchronous and come from several threads at once
(its prefetch thread loads while its backup thread stores). A runner gives each job a
fresh id, submits it, and waits for that job's own result: whichever thread polls keeps
the other threads' results for them. It never gives up on a job it submitted: a worker
finishes every job (a tier's own timeouts and breakers bound a job), and a load reported
back before its copy ended could let SGLang reuse a host page the copy still writes.

``run(src, dst)`` returns the ``TransferResult``. A ``submit`` that raises (a bad spec, a
closed worker) becomes a failed result naming the error. Each finished job is also
reported to ``meter`` (a ``kvoffload.metrics.TransferMeter``) with its blocks.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from typing import Any

from kvoffload.specs import LoadStoreSpec
from kvoffload.worker import OffloadingWorker, TransferResult

_WAIT_S = 0.05  # one wait for a job's result; then the results polled are checked again


class JobRunner:
    def __init__(self, worker: OffloadingWorker, meter: Any = None) -> None:
        self.worker = worker
        self.meter = meter
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._done: dict[int, TransferResult] = {}

    def run(self, src: LoadStoreSpec, dst: LoadStoreSpec, blocks: int) -> TransferResult:
        with self._lock:
            job_id = next(self._ids)
        meter = self.meter
        if meter is not None:
            meter.started(src.medium, dst.medium)
        start = time.perf_counter()
        try:
            self.worker.submit(job_id, src, dst)
        except Exception as exc:  # (a closed worker, a spec the tier refuses)
            result = TransferResult(job_id, False, 0, 0.0, "submit", f"{type(exc).__name__}: {exc}")
        else:
            result = self._wait(job_id)
        if meter is not None:
            seconds = result.seconds or time.perf_counter() - start
            meter.finished(src.medium, dst.medium, result.success, result.bytes, seconds, blocks)
        return result

    def _wait(self, job_id: int) -> TransferResult:
        while True:
            with self._lock:
                for result in self.worker.poll():
                    self._done[result.job_id] = result
                result = self._done.pop(job_id, None)
            if result is not None:
                return result
            with contextlib.suppress(TimeoutError):
                self.worker.wait([job_id], timeout=_WAIT_S)
