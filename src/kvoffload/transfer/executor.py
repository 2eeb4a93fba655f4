"""The contract between ``TransferEngine`` and its copy executors (one per device kind).

A job reaches an executor as *pieces* ``(tensor, device_rows, host_rows)``: for one layout
tensor, device block ``device_rows[i]`` pairs with host sub-block ``host_rows[i]``. A store
copies device -> host, a load host -> device.

* ``ready_event()`` is called on the submitting thread; what it returns travels with the
  job to ``run`` (CUDA: an event recorded on the caller's stream, so the copies start after
  the work queued so far; ``None`` where nothing needs ordering).
* ``new_state()`` is called once per engine worker thread, on that thread, before its first
  job; the state (CUDA: its side streams and buffers) is passed to every ``launch`` of that
  thread.
* ``launch(store, pieces, state, ready)`` starts (or does) every copy of the job and
  returns a handle; ``finish(handle)`` waits for them and returns the copy seconds. Either
  may raise: the engine turns an exception into a failed result at once. A job that
  raised has unspecified destination rows and touched nothing else, and none of its
  copies may still be running when the exception leaves the executor (an asynchronous
  executor fences its streams first): the caller may hand the destination to new data as
  soon as it hears.
* ``jobs_in_flight``: how many jobs one worker thread may have launched and not finished.
  With more than one, the worker launches the next queued job before it waits for the
  oldest, so one job's planning and launches overlap another's copies; jobs still finish
  in launch order. An executor whose ``launch`` does the copies itself says 1.
* ``close()`` releases the executor's own threads or handles.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

Piece = tuple[int, np.ndarray, np.ndarray]  # (tensor index, device rows, host rows)


class Executor(Protocol):
    jobs_in_flight: int

    def ready_event(self) -> Any: ...

    def new_state(self) -> Any: ...

    def launch(self, store: bool, pieces: Sequence[Piece], state: Any, ready: Any) -> Any: ...

    def finish(self, handle: Any) -> float: ...

    def close(self) -> None: ...
