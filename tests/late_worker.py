"""``LateWorker``: an ``OffloadingWorker`` stand-in whose jobs finish a set delay after
they are submitted, on timer threads (some of them failed, if asked): for tests of what
the vLLM worker side waits for and reports."""

from __future__ import annotations

import threading

from kvoffload.worker import JobBook, TransferResult


class LateWorker:
    """Every job finishes ``delay`` seconds after it is submitted (``fail``: those ids fail)."""

    def __init__(self, delay: float, fail=()) -> None:
        self.delay, self.fail, self.book = delay, set(fail), JobBook()

    def submit(self, job_id, src_spec, dst_spec) -> bool:
        self.book.begin(job_id)

        def done() -> None:
            with self.book.lock:
                ok = job_id not in self.fail
                self.book.finish(TransferResult(job_id, ok, 1, self.delay, "x", None if ok else "injected"))

        threading.Timer(self.delay, done).start()
        return True

    def wait(self, job_ids, timeout=None) -> None:
        self.book.wait(job_ids, timeout)

    def poll(self):
        return self.book.poll()
