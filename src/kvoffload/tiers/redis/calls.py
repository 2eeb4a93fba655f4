"""``NodeCalls``: one command per key name, pipelined per server node, each node behind
its own circuit breaker.

A standalone server is one node. On a Redis Cluster the names are grouped by the node
that owns their slot (the client's slot map) and each group goes to its node in one
pipeline, so a dead master fails only its own keys: the others are served. A node whose
breaker is open is not called (its names fail at once). Failures are returned, not
raised: ``run`` gives, per name, the reply or a ``NodeDown``.

Thread-safe: the redis-py clients are, and breakers are created under a lock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from kvoffload.tiers.redis.breaker import CircuitBreaker
from kvoffload.tiers.redis.client import redact

Add = Callable[[Any, bytes, int], None]  # add(pipeline, name, index)


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

    def _client_or_raise(self):
        client = self._client
        if client is None:
            with self._lock:
                if self._client is None:
                    self._client = self._connect()
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

    def run(self, names: Sequence[bytes], add: Add) -> list[Any]:
        """Per name, the reply of the command ``add`` queued for it, or a ``NodeDown``."""
        replies: list[Any] = [None] * len(names)
        # A cluster client talks to the cluster when it is made (to map the slots): that
        # has a breaker of its own. A standalone client connects on its first command.
        entry = self.breaker("cluster") if self.cluster and self._client is None else None
        if entry is not None and not entry.allow():
            return [NodeDown("no connection to the cluster (circuit open)")] * len(names)
        try:
            groups = self._groups(names)
        except Exception as exc:  # noqa: BLE001 - cannot connect or map slots
            self._client = None
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
                pipe = connection.pipeline(transaction=False)
                for i in indices:
                    add(pipe, names[i], i)
                results = pipe.execute()
            except Exception as exc:  # noqa: BLE001 - network, timeout, server errors
                breaker.failure(exc)
                if not self.cluster:
                    self._client = None
                down = NodeDown(f"{type(exc).__name__}: {exc}")
                for i in indices:
                    replies[i] = down
                continue
            breaker.success()
            for i, result in zip(indices, results):
                replies[i] = result
        return replies
