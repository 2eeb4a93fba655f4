"""Running one job on an ``OffloadingWorker`` the way the tests need it."""

from __future__ import annotations

from kvoffload.worker import OffloadingWorker, TransferResult


def run_job(worker: OffloadingWorker, job_id: int, src, dst, timeout: float) -> TransferResult:
    """Submit one job, wait for it and return its result (the only one pending)."""
    worker.submit(job_id, src, dst)
    worker.wait([job_id], timeout)
    (result,) = worker.poll()
    return result
