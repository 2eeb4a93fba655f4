"""``NodeCalls``: one command per key name, pipelined per server node, each node behind
its own circuit breaker.

A standalone server is one node. On a Redis Cluster the names are grouped by the node
that owns their slot (the client's slot map) and each group goes to its node in one
pipeline, so a dead master fails only its own keys: the others are served. A node whose
breaker is open is not called (its names fail at once). Failures are returned, not
raised: ``run`` gives, per name, the reply or a ``NodeDown`` (also for a command the
server refused, e.g. ``OOM``: the server answered, so the breaker stays closed).

A pipeline is one ``send`` of every packed command and one read of the replies, on a
connection taken from the client's pool: redis-py's own pipeline sends each large value
separately, and every send gives up the GIL and waits to take it back; on an engine
thread that spins on its scheduler loop, that wait (up to the interpreter's switch
interval, 5 ms) was paid per block.

A caller may also pass ``streamed(stream, indices) -> replies``: the node's batch then
runs on a ``RespStream`` over the socket of a connection borrowed from redis-py's pool
(connected, authenticated, TLS negotiated, database selected by redis-py), so the worker
can send values from the host pool and read them into it without copies. Where redis-py's
connection exposes no socket, ``command`` is used as above. Either way the connection is
dropped after any exception, and a ``ServerError`` reply is a ``NodeDown`` of its name.

On a standalone server, a ``Lane`` (``kvoffload.tiers.redis.lanes``) runs a worker's
batches on a connection of its own, from ``pool()``: it reports what happens to them here
(``failed``: the breaker counts it and the client is made again; ``answered``).

Thread-safe: the redis-py clients are, and breakers are created under a lock.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Sequence
from typing import Any

from kvoffload.tiers.redis.breaker import CircuitBreaker
from kvoffload.tiers.redis.client import redact
from kvoffload.tiers.redis.resp import RespStream, ServerError

Command = Callable[[bytes, int], tuple]  # command(name, index) -> ("SET", name, value, ...)
Streamed = Callable[[RespStream, list[int]], list[Any]]  # one reply per index, in order


class NodeDown:
    """The reply for a name whose node could not be asked."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = redact(reason)  # it ends up in results and logs: no credentials

    def __repr__(self) -> str:
        return f"NodeDown({self.reason!r})"


class NodeCalls:
    def __init__(self, connect: Callable[[], Any], label: str, cluster: bool = False) -> None:
        self._connect = connect
        self.label = label
        self.cluster = cluster
        self._client = None
        self._lock = threading.Lock()
        self._breakers: dict[str, CircuitBreaker] = {}
        self.streamed_batches = 0  # node batches run on a RespStream (the rest: redis-py commands)
        self.command_batches = 0

    def breaker(self, node: str) -> CircuitBreaker:
        breaker = self._breakers.get(node)
        if breaker is None:
            with self._lock:
                breaker = self._breakers.setdefault(node, CircuitBreaker(f"{self.label} node {node}"))
        return breaker

    @property
    def down(self) -> bool:
        """Every node known is down (its breaker open): calls would fail at once."""
        breakers = list(self._breakers.values())
        return bool(breakers) and all(b.is_open for b in breakers)

    @property
    def outages(self) -> int:
        return sum(b.outages for b in list(self._breakers.values()))

    def pool(self) -> Any:
        """The standalone server's connection pool (the client made if need be)."""
        return self._client_or_raise().connection_pool

    def answered(self, batches: int = 1) -> None:
        """``batches`` streamed batches ran on a lane's connection and were answered."""
        self.breaker("server").success()
        with self._lock:
            self.streamed_batches += batches

    def failed(self, exc: BaseException) -> None:
        """A batch on a lane's connection failed: counted as ``run`` counts a failed call."""
        self.breaker("server").failure(exc)
        self._drop_client()

    def _drop_client(self) -> None:
        """Forget the client after a failure; the next call makes a new one. Its idle
        connections are closed now; one in use stays open for its holder, which closes it
        on its own failure or gives it back (a lane's C code writes to its descriptor: a
        descriptor closed under it could be reused by another socket or file)."""
        with self._lock:
            client, self._client = self._client, None
        if client is not None and not self.cluster:
            client.connection_pool.disconnect(inuse_connections=False)

    def _client_or_raise(self):
        client = self._client
        if client is None:
            with self._lock:
                if self._client is None:
                    self._client = self._connect()
                    if not self.cluster:
                        # a dropped client must not close the connections still in use
                        # when it is collected (``_drop_client``)
                        self._client.auto_close_connection_pool = False
                client = self._client
        return client

    def _groups(self, names: Sequence[bytes]) -> dict[str, tuple[Any, list[int]]]:
        client = self._client_or_raise()
        if not self.cluster:
            return {"server": (client, list(range(len(names))))}
        groups: dict[str, tuple[Any, list[int]]] = {}
        for i, name in enumerate(names):
            node = client.get_node_from_key(name)
            groups.setdefault(node.name, (node.redis_connection, []))[1].append(i)
        return groups

    def run(
        self,
        names: Sequence[bytes],
        command: Command,
        streamed: Streamed | None = None,
    ) -> list[Any]:
        """Per name, the reply to ``command(name, index)`` (or ``streamed``'s), or a ``NodeDown``."""
        replies: list[Any] = [None] * len(names)
        # A cluster client talks to the cluster when it is made (to map the slots): that
        # has a breaker of its own. A standalone client connects on its first command.
        entry = self.breaker("cluster") if self.cluster and self._client is None else None
        if entry is not None and not entry.allow():
            return [NodeDown("no connection to the cluster (circuit open)")] * len(names)
        try:
            groups = self._groups(names)
        except Exception as exc:  # noqa: BLE001 - cannot connect or map slots
            self._drop_client()
            if entry is not None:
                entry.failure(exc)
            return [NodeDown(f"{type(exc).__name__}: {exc}")] * len(names)
        if entry is not None:
            entry.success()
        for node, (connection, indices) in groups.items():
            breaker = self.breaker(node)
            if not breaker.allow():
                for i in indices:
                    replies[i] = NodeDown(f"node {node} is down (circuit open)")
                continue
            try:
                results, on_stream = _batch(connection, names, indices, command, streamed)
            except Exception as exc:  # noqa: BLE001 - network, timeout, server errors
                breaker.failure(exc)
                if not self.cluster:
                    self._drop_client()
                down = NodeDown(f"{type(exc).__name__}: {exc}")
                for i in indices:
                    replies[i] = down
                continue
            breaker.success()
            with self._lock:
                self.streamed_batches += on_stream
                self.command_batches += not on_stream
            for i, result in zip(indices, results):
                replies[i] = result
        return replies


def stream_socket(connection: Any) -> socket.socket | None:
    """The socket of a redis-py ``connection`` that a ``RespStream`` can run on, if it has one."""
    sock = getattr(connection, "_sock", None)
    return sock if isinstance(sock, socket.socket) else None


def refused(replies: list[Any], indices: list[int]) -> list[Any]:
    if len(replies) != len(indices):
        raise RuntimeError(f"{len(replies)} replies to a batch of {len(indices)}")
    return [
        NodeDown(f"the server refused: {r.message}") if isinstance(r, ServerError) else r for r in replies
    ]


def _batch(
    client: Any,
    names: Sequence[bytes],
    indices: list[int],
    command: Command,
    streamed: Streamed | None,
) -> tuple[list[Any], bool]:
    """The replies to the batch of ``indices`` on a connection of ``client``'s pool, one
    each (a command the server refused gives a ``NodeDown``), and
    whether it ran on a ``RespStream``. Connection errors raise (the connection is dropped)."""
    from redis.exceptions import ResponseError

    pool = client.connection_pool
    connection = pool.get_connection()
    try:
        sock = stream_socket(connection) if streamed is not None else None
        if sock is not None:
            return refused(streamed(RespStream(sock), indices), indices), True
        packed = connection.pack_commands([command(names[i], i) for i in indices])
        connection.send_packed_command([b"".join(packed)])
        replies = []
        for _ in indices:
            try:
                replies.append(connection.read_response())
            except ResponseError as exc:
                replies.append(NodeDown(f"the server refused: {exc}"))
        return replies, False
    except BaseException:
        connection.disconnect()
        raise
    finally:
        pool.release(connection)
