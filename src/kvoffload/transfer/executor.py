"""The contract between ``TransferEngine`` and its copy executors (one per device kind).

A job reaches an executor as *pieces* ``(tensor, device_rows, host_rows)``: for one layout
tensor, device block ``device_rows[i]`` pairs with host sub-block ``host_rows[i]``. A store
copies device -> host, a load host -> device.

* ``ready_event()`` is called on the submitting thread; what it returns travels with the
  job to ``run`` (CUDA: an event recorded on the caller's stream, so the copies start after
  the work queued so far; ``None`` where nothing needs ordering).
* ``new_state()`` is called once per engine worker thread, on that thread, before its first
  job; the state (CUDA: a side stream) is passed to every ``run`` of that thread.
* ``run(store, pieces, state, ready)`` copies every piece and returns the copy seconds, or
  raises: the engine turns an exception into a failed result at once. A job whose ``run``
  raised has unspecified destination rows and touched nothing else, and none of its
  copies may still be running when ``run`` raises (an asynchronous executor fences its
  stream first): the caller may hand the destination to new data as soon as it hears.
* ``close()`` releases the executor's own threads or handles.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

Piece = tuple[int, np.ndarray, np.ndarray]  # (tensor index, device rows, host rows)


class Executor(Protocol):
    def ready_event(self) -> Any: ...

    def new_state(self) -> Any: ...

    def run(self, store: bool, pieces: Sequence[Piece], state: Any, ready: Any) -> float: ...

    def close(self) -> None: ...
