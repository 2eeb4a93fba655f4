"""A real ``redis-server`` for tests: started on a free loopback port in a temporary
folder, no persistence, stopped by its own PID.

``RedisServer(tmp_path, maxmemory=None)``: ``start()`` (also after ``kill()``: the same
port again), ``kill()`` (SIGKILL), ``stop()``, ``url``, ``client()``. Keyspace
notifications of evictions, expiries and deletions are on (``Egx``... see ``EVENTS``)
unless ``notifications=False``. Without a ``redis-server`` binary, tests skip — or fail
under ``CI`` (``make test`` installs it).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time

import pytest

EVENTS = "Egxe"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def require_redis_server() -> str:
    path = shutil.which("redis-server")
    if path is None:
        message = "redis-server is not installed (Debian package redis-server; make test installs it)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return path


class RedisServer:
    def __init__(self, tmp_path, maxmemory: str | None = None, notifications: bool = True):
        self.binary = require_redis_server()
        self.dir = tmp_path
        self.port = free_port()
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


@pytest.fixture
def redis_server(tmp_path):
    server = RedisServer(tmp_path).start()
    yield server
    server.stop()
