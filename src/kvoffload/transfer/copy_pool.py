"""``CopyPool``: our own threads for CPU copies, sharing each batch of work dynamically.

``run(tasks, fn)`` calls ``fn(*task)`` for every task and returns when all have finished;
the calling thread works too, with ``threads - 1`` helper threads. Tasks are handed out
one at a time from a shared counter, so a thread that the OS deschedules (a busy
machine) delays only the task it holds while the others take the rest. A static split,
such as torch's intra-op pool, waits for its slowest thread instead.

We use our own threads rather than torch's intra-op pool because that pool, entered from
a non-main thread, starts one OpenMP team per calling thread (store and load workers
would each bring one) whose threads spin while waiting: on a loaded machine copies
collapsed to a fraction of a GB/s. Limiting it with ``torch.set_num_threads`` is not an
option: it changes the process-wide default that later threads pick up. The tasks are
numpy copies, which release the GIL and never start threads themselves.

Errors: the first exception a task raises is re-raised by ``run`` once every task that
had started has finished (so nothing still writes when the caller learns of the
failure); tasks not yet started are skipped. Batches from several callers (a store and a
load) may run at once; helpers serve them in arrival order.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence

from kvoffload.validation import positive_int


class _Batch:
    def __init__(self, tasks: Sequence[tuple], fn: Callable[..., None]) -> None:
        self.tasks, self.fn = tasks, fn
        self.error: BaseException | None = None
        self.finished = threading.Event()
        self._lock = threading.Lock()
        self._taken = 0
        self._left = len(tasks)
        if not tasks:
            self.finished.set()

    def drain(self) -> None:
        done = False
        while True:
            with self._lock:  # one acquisition per task: report the last one, take the next
                if done:
                    self._left -= 1
                    if not self._left:
                        self.finished.set()
                if self._taken == len(self.tasks):
                    return
                index = self._taken
                self._taken += 1
            done = True
            if self.error is not None:
                continue  # the batch has failed: skip what is left
            try:
                self.fn(*self.tasks[index])
            except BaseException as exc:  # noqa: BLE001 - handed to the caller of run()
                with self._lock:
                    if self.error is None:
                        self.error = exc


class CopyPool:
    """The calling thread plus ``threads - 1`` daemon helpers."""

    def __init__(self, threads: int, name: str = "kvoffload-copy") -> None:
        self.threads = positive_int("copy threads", threads)
        self._queue: queue.SimpleQueue[_Batch | None] = queue.SimpleQueue()
        self._helpers = [
            threading.Thread(target=self._serve, name=f"{name}-{i}", daemon=True) for i in range(threads - 1)
        ]
        for helper in self._helpers:
            helper.start()

    def run(self, tasks: Sequence[tuple], fn: Callable[..., None]) -> None:
        batch = _Batch(tasks, fn)
        # No more helpers than tasks beyond the caller's first; a helper that arrives
        # after the work is gone returns at once.
        for _ in range(min(len(self._helpers), len(tasks) - 1)):
            self._queue.put(batch)
        batch.drain()
        batch.finished.wait()
        if batch.error is not None:
            raise batch.error

    def _serve(self) -> None:
        while (batch := self._queue.get()) is not None:
            batch.drain()

    def close(self) -> None:
        """Stop the helpers (after the batches already queued). Idempotent."""
        for _ in self._helpers:
            self._queue.put(None)
        for helper in self._helpers:
            helper.join()
        self._helpers = []
