"""A real Mooncake Store for tests: a ``mooncake_master`` on free loopback ports in a
temporary folder, optionally a standalone segment holder (``mooncake_client``) and, for the
HTTP metadata mode, a ``mooncake_http_metadata_server``; every process stopped by its own PID.

``MooncakeServer(tmp_path, segment=64 << 20, metadata="p2p")``: ``start()`` (also after
``kill()``: the same ports again), ``kill()`` (SIGKILL of the master only: the holder and
the metadata server live on, as they would in a cluster), ``restart()`` (kill, then start on
the same port; the master starts empty and the holder mounts its segment again),
``stop()``, ``master_address``, ``metadata_server``, ``tier_config(**extra)`` (a
``secondary_tiers`` entry for this store), ``client(segment=0)`` (a raw
``MooncakeDistributedStore`` set up against it, closed by ``stop()``), ``capacity()`` and
``key_count()`` (from the master's metrics). ``segment=0`` starts no holder: then the
store's memory is whatever the clients contribute.

Ports: the master's RPC and metrics listeners and the metadata server bind 127.0.0.1 (the
master's own embedded HTTP metadata server binds 0.0.0.0 whatever it is told, so it is not
used). Mooncake 0.3.13's transfer engine in every client with a segment (the holder, and a
Python client) opens its handshake and TCP data listeners on wildcard addresses; no flag
or variable of that release changes it.

A server a test started and did not stop is stopped after the test all the same
(``stop_leftovers``, called by ``conftest.py``). Without the binaries, the Python module or
``libibverbs.so.1``, tests skip — or fail under ``CI`` (``make mooncake-libs`` installs them).
"""

from __future__ import annotations

import ctypes.util
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from free_ports import free_port

_BIN = Path(sys.executable).parent
_READY_S = 20.0


def _missing() -> str | None:
    for name in ("mooncake_master", "mooncake_client", "mooncake_http_metadata_server"):
        if not os.access(_BIN / name, os.X_OK):
            return f"{name} is not installed beside {sys.executable} (make mooncake-libs installs it)"
    if ctypes.util.find_library("ibverbs") is None:
        return "libibverbs.so.1 is missing (Debian package libibverbs1; make mooncake-libs installs it)"
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        return f"mooncake.store does not import: {exc}"
    return None


def require_mooncake() -> None:
    message = _missing()
    if message is None:
        return
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


_RUNNING: set[MooncakeServer] = set()  # started and not stopped yet


def stop_leftovers() -> list[int]:
    """Stop every store started and not stopped; their masters' RPC ports."""
    left = list(_RUNNING)
    for server in left:
        server.stop()
    return [server.port for server in left]


def _spawn(args: list[str], log: Path) -> subprocess.Popen:
    with open(log, "ab") as out:
        return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def _end(proc: subprocess.Popen | None, sig: int = signal.SIGTERM) -> None:
    if proc is None or proc.poll() is not None:
        return
    os.kill(proc.pid, sig)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)


class MooncakeServer:
    def __init__(self, tmp_path, segment: int = 64 << 20, metadata: str = "p2p"):
        require_mooncake()
        if metadata not in ("p2p", "http"):
            raise ValueError(f"metadata must be 'p2p' or 'http', not {metadata!r}")
        self.dir = Path(tmp_path)
        self.segment = segment
        self.metadata = metadata
        self.port = free_port()
        self.metrics_port = free_port()
        self.holder_port = free_port()
        self.metadata_port = free_port() if metadata == "http" else None
        self.master: subprocess.Popen | None = None
        self.holder: subprocess.Popen | None = None
        self.meta: subprocess.Popen | None = None
        self._clients: list = []

    @property
    def master_address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def metadata_server(self) -> str:
        if self.metadata == "http":
            return f"http://127.0.0.1:{self.metadata_port}/metadata"
        return "P2PHANDSHAKE"

    def tier_config(self, **extra) -> dict:
        config = {"type": "mooncake", "master": self.master_address, "metadata": self.metadata}
        if self.metadata == "http":
            config["metadata_server"] = self.metadata_server
        config.update(extra)
        return config

    # -- processes -------------------------------------------------------------------
    def start(self) -> MooncakeServer:
        _RUNNING.add(self)
        if self.metadata == "http" and (self.meta is None or self.meta.poll() is not None):
            self.meta = _spawn(
                [str(_BIN / "mooncake_http_metadata_server"), "--host", "127.0.0.1",
                 "--port", str(self.metadata_port), "--log-level", "WARNING"],
                self.dir / "metadata.log",
            )  # fmt: skip
            self._wait(lambda: self._http_ok(f"http://127.0.0.1:{self.metadata_port}/metadata?key=probe"),
                       "the HTTP metadata server")  # fmt: skip
        self.master = _spawn(
            [str(_BIN / "mooncake_master"), "--rpc_address=127.0.0.1", f"--rpc_port={self.port}",
             "--metrics_host=127.0.0.1", f"--metrics_port={self.metrics_port}", "--rpc_thread_num=2",
             f"--log_dir={self.dir}", "--logtostderr=false", "--minloglevel=1"],
            self.dir / "master.log",
        )  # fmt: skip
        self._wait(lambda: self._http_ok(self._metrics_url("/health")), "mooncake_master")
        if self.segment:
            if self.holder is None or self.holder.poll() is not None:
                self.holder = _spawn(
                    [str(_BIN / "mooncake_client"), "--host=127.0.0.1", f"--port={self.holder_port}",
                     f"--master_server_address={self.master_address}",
                     f"--metadata_server={self.metadata_server}", "--protocol=tcp",
                     f"--global_segment_size={self.segment}", f"--log_dir={self.dir}",
                     "--logtostderr=false", "--minloglevel=1"],
                    self.dir / "holder.log",
                )  # fmt: skip
            self._wait(lambda: self.capacity() >= self.segment, "the segment holder's mount")
        return self

    def kill(self) -> None:
        """SIGKILL the master (the holder and the metadata server keep running)."""
        _end(self.master, signal.SIGKILL)

    def restart(self) -> MooncakeServer:
        self.kill()
        return self.start()

    def stop(self) -> None:
        with ThreadPoolExecutor(4) as pool:  # a client takes about a second to close
            list(pool.map(lambda client: client.close(), self._clients))
        self._clients.clear()
        for proc in (self.holder, self.master, self.meta):
            _end(proc)
        self.holder = self.master = self.meta = None
        _RUNNING.discard(self)

    def pids(self) -> list[int]:
        return [p.pid for p in (self.master, self.holder, self.meta) if p is not None and p.poll() is None]

    # -- inspection ------------------------------------------------------------------
    def client(self, segment: int = 0, local_buffer: int = 16 << 20):
        """A raw client (closed by ``stop()``; do not close it yourself)."""
        from mooncake.store import MooncakeDistributedStore

        store = MooncakeDistributedStore()
        rc = store.setup("127.0.0.1", self.metadata_server, segment, local_buffer, "tcp", "",
                         self.master_address)  # fmt: skip
        if rc != 0:
            raise RuntimeError(f"a raw Mooncake client failed to set up against {self.master_address}: {rc}")
        self._clients.append(store)
        return store

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(self._metrics_url("/metrics"), timeout=5) as response:
            text = response.read().decode()
        values = {}
        for line in text.splitlines():
            if line and not line.startswith("#") and "{" not in line:
                name, _, value = line.partition(" ")
                values[name] = float(value)
        return values

    def capacity(self) -> int:
        try:
            return int(self.metrics().get("master_total_capacity_bytes", 0))
        except OSError:
            return 0

    def key_count(self) -> int:
        return int(self.metrics()["master_key_count"])

    def _metrics_url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.metrics_port}{path}"

    @staticmethod
    def _http_ok(url: str) -> bool:
        try:
            with urllib.request.urlopen(url, timeout=0.5) as response:
                return response.status < 500
        except urllib.error.HTTPError as exc:
            return exc.code < 500
        except (OSError, json.JSONDecodeError):
            return False

    def _wait(self, ready, what: str) -> None:
        deadline = time.monotonic() + _READY_S
        while time.monotonic() < deadline:
            if ready():
                return
            exited = [
                f"{name} exited with {proc.returncode}"
                for name, proc in (("mooncake_master", self.master), ("the holder", self.holder),
                                   ("the metadata server", self.meta))
                if proc is not None and proc.poll() is not None
            ]  # fmt: skip
            if exited:
                break
            time.sleep(0.05)
        else:
            exited = [f"not within {_READY_S:.0f} s"]
        self.stop()
        raise RuntimeError(
            f"{what} did not come up for the store on 127.0.0.1:{self.port}: {', '.join(exited)}"
            f" (logs in {self.dir})"
        )


@pytest.fixture
def mooncake_server(tmp_path):
    server = MooncakeServer(tmp_path).start()
    yield server
    server.stop()
