"""``LateWorker``: an ``OffloadingWorker`` stand-in whose jobs finish a set delay after
they are submitted, on timer threads (some of them failed, if asked), or, with no delay,
only when the test releases them: for tests of what the vLLM worker side waits for and
reports. It records every ``wait`` call, so that a test can tell what was waited for
without timing the call."""

from __future__ import annotations

import threading

from kvoffload.worker import JobBook, TransferResult


class LateWorker:
    """Every job finishes ``delay`` seconds after it is submitted (``fail``: those ids fail);
    ``delay=None``: a job finishes when ``release(job_id)`` is called. ``waits`` lists each
    ``wait`` call's ``(job ids, timeout)``; ``waiting`` is set when one begins."""

    def __init__(self, delay: float | None, fail=()) -> None:
        self.delay, self.fail, self.book = delay, set(fail), JobBook()
        self.waits: list[tuple[list[int], float | None]] = []
        self.waiting = threading.Event()

    def submit(self, job_id, src_spec, dst_spec) -> bool:
        self.book.begin(job_id)
        if self.delay is not None:
            threading.Timer(self.delay, self.release, (job_id,)).start()
        return True

    def release(self, job_id: int) -> None:
        with self.book.lock:
            ok, seconds = job_id not in self.fail, self.delay or 0.0
            self.book.finish(TransferResult(job_id, ok, 1, seconds, "x", None if ok else "injected"))

    def wait(self, job_ids, timeout=None) -> None:
        self.waits.append((list(job_ids), timeout))
        self.waiting.set()
        self.book.wait(job_ids, timeout)

    def poll(self):
        return self.book.poll()
