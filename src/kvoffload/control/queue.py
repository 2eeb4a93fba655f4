"""Commands from other threads, run on the engine's scheduler thread.

The scheduler-side objects are single-threaded. A control thread (the HTTP endpoint)
``submit``s a function and waits for its result; the engine's adapter calls ``drain`` at
the start of each step, on its scheduler thread, which runs every pending function in
order. An idle engine takes no steps (vLLM's loop blocks until a request arrives), so a
submitter not served within ``grace_s`` runs the pending functions itself while holding
the adapter's ``serial`` lock, the lock the adapter holds for each of its calls: still
one at a time with everything the scheduler side does. ``TimeoutError`` when neither
happened within ``timeout`` (the command is then dropped unrun, unless already running);
an exception raised by a function is re-raised to its submitter, never into the engine.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

DEFAULT_GRACE_S = 0.05


class _Pending:
    __slots__ = ("fn", "done", "result", "error", "cancelled")

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None
        self.cancelled = False


def _left(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())


class ControlQueue:
    def __init__(self, serial: threading.Lock | None = None, grace_s: float = DEFAULT_GRACE_S) -> None:
        self._pending: deque[_Pending] = deque()
        self._serial = serial
        self._grace_s = grace_s

    def __len__(self) -> int:
        return len(self._pending)

    def submit(self, fn: Callable[[], Any], timeout: float) -> Any:
        """``fn()``'s result, run as the module docstring says."""
        item = _Pending(fn)
        self._pending.append(item)
        deadline = time.monotonic() + timeout
        served = item.done.wait(min(self._grace_s, timeout))
        if not served and self._serial is not None and self._serial.acquire(timeout=_left(deadline)):
            try:
                self.drain()
            finally:
                self._serial.release()
        if not item.done.wait(_left(deadline)):
            item.cancelled = True  # skipped if still pending; one already running finishes
            raise TimeoutError(f"the engine did not take the command within {timeout:g} s")
        if item.error is not None:
            raise item.error
        return item.result

    def drain(self) -> int:
        """Run every pending function (the caller is the scheduler thread, or holds
        ``serial``); how many ran."""
        ran = 0
        while self._pending:
            try:
                item = self._pending.popleft()
            except IndexError:
                break
            if item.cancelled:
                continue
            try:
                item.result = item.fn()
            except Exception as exc:  # the submitter's error, never the engine's
                item.error = exc
            item.done.set()
            ran += 1
        return ran
