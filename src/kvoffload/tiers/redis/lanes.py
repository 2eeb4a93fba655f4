"""``Lane``: one connection of a standalone server whose queued batches run back to back
in C, without Python between them.

A job's batch is planned by the thread that submits it (with the GIL it holds anyway) and
queued into the lane's ``_pipelines.JobQueue``; the lane's own thread serves the queue on
its connection without the GIL: each batch goes out the moment the one before it is
answered (a store's CRC32Cs filled in meanwhile), and one answered in full is recorded as
done, for ``collect()`` (the worker's ``poll``/``wait``) to finish in Python later. One
batch is on the wire at a time: the pipeline depth is a job's. A batch queued while another
was queued or on the wire counts in ``back_to_back``.

The lane's thread takes the GIL only for what C does not do, through the callbacks it is
given, each called with the job's ``token`` (whatever ``push_*`` got):

* ``settle(token, stream, result)``: C stopped at a reply not as planned (a missing value,
  a server error): the caller reads the rest of the batch's replies on ``stream`` (the
  connection is mid-batch) and finishes the job. An exception it raises fails the
  connection as below.
* ``failed(token, exc)``: the batch failed (timeout, closed, not RESP): the connection is
  dropped (disconnected, back to its pool); the batches queued behind it were not sent and
  run on a fresh one.
* ``unsent(token)``: the job was taken out of the queue unsent (no connection could be
  made, the server's breaker is open, or the connection is not a plain socket): the caller
  runs it another way.

``close()`` lets the queued batches run, then stops the thread and gives the connection
back. Thread-safe.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from kvoffload.tiers.redis.calls import NodeCalls, stream_socket
from kvoffload.tiers.redis.resp import ProtocolError, RespStream

try:
    from kvoffload.tiers.redis._pipelines import Completions, JobQueue
except ImportError:  # pragma: no cover - depends on the build: no lanes without the C module
    Completions = JobQueue = None

AVAILABLE = JobQueue is not None  # lanes need the C module


class Lane:
    def __init__(
        self,
        calls: NodeCalls,
        completions: Any,
        settle: Callable[[Any, RespStream, tuple], None],
        failed: Callable[[Any, BaseException], None],
        unsent: Callable[[Any], None],
    ) -> None:
        self._calls = calls
        self._queue = JobQueue(completions)
        self._settle, self._failed, self._unsent = settle, failed, unsent
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.usable = True  # False once its connection proved not to be a plain socket (TLS)

    @property
    def back_to_back(self) -> int:
        return self._queue.behind

    def push_get(self, token: Any, request: bytes, plan: list) -> None:
        self._queue.push_get(token, request, plan)
        self._start()

    def push_set(self, token: Any, buffers: list, count: int, checksums: list) -> None:
        self._queue.push_set(token, buffers, count, checksums)
        self._start()

    def collect(self) -> list[tuple[Any, tuple]]:
        """``(token, result)`` of each batch answered in full since the last call, in order."""
        return self._queue.collect()

    def close(self) -> None:
        self._queue.close()
        with self._lock:
            thread = self._thread
        if thread is not None:
            thread.join()

    def _start(self) -> None:
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(
                        target=self._drive, name="kvoffload-redis-lane", daemon=True
                    )
                    self._thread.start()

    def _drive(self) -> None:
        queue, connection, pool = self._queue, None, None
        try:
            while queue.wait_job():
                if connection is None:
                    connection, pool = self._connect()
                    if connection is None:
                        for token in queue.drain():
                            self._unsent(token)
                        continue
                sock = connection._sock
                timeout = sock.gettimeout()
                stream = RespStream(sock)
                while (
                    out := queue.serve(sock.fileno(), -1.0 if timeout is None else float(timeout))
                ) is not None:
                    token, result, error = out
                    if error is None:
                        try:
                            self._settle(token, stream, result)
                            if stream.buffered:
                                raise ProtocolError(
                                    f"{stream.buffered} bytes after the last reply of a batch"
                                )
                            continue
                        except Exception as exc:  # noqa: BLE001 - the connection's state is unknown
                            error = exc
                    connection.disconnect()
                    pool.release(connection)
                    connection = None
                    self._failed(token, error)
                    break
        finally:
            if connection is not None:
                pool.release(connection)

    def _connect(self) -> tuple[Any, Any]:
        """A connection for the queue (connected by redis-py), and its pool; ``(None, None)``
        if the server's breaker is open, none can be made, or it offers no plain socket."""
        if self._calls.breaker("server").is_open:
            return None, None
        try:
            pool = self._calls.pool()
            connection = pool.get_connection()
        except Exception:  # noqa: BLE001 - the jobs run another way, which counts the failure
            return None, None
        sock = stream_socket(connection)
        if sock is None or not RespStream(sock).can_hand_off:  # TLS: C cannot read its descriptor
            self.usable = False
            pool.release(connection)
            return None, None
        return connection, pool
