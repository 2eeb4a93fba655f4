"""Dynamo's standalone KV indexer (``ai-dynamo-runtime==1.6.1``) for agreement tests, run
from a virtual environment of its own, never the project's.

* ``dynamo_python()`` returns the interpreter of that environment, building it once:
  ``python -m venv`` and ``pip install ai-dynamo-runtime==1.6.1`` (a 75 MB wheel plus
  pydantic and uvloop) into ``$KVOFFLOAD_DYNAMO_VENV`` or
  ``~/.cache/kvoffload-test/dynamo-venv``. A present environment whose ``dynamo`` reports
  the pinned version is reused as it is; anything else there (an interrupted build) is
  removed and built again. Builds hold a file lock beside it, so concurrent test
  processes build it once.
* When the environment cannot be built (no network, no package index, pip failing) it
  raises ``DynamoUnavailable`` with pip's last lines; the tests turn that into a skip with
  the reason. Such a skip is kept under ``CI`` (its reason is not the import-skip that
  ``tests/conftest.py`` turns into a failure): the package comes from a registry the CI
  machine may not reach, which says nothing about kvoffload's own install. Set
  ``KVOFFLOAD_REQUIRE_DYNAMO=1`` to make it a failure instead.
* ``DynamoIndexer`` runs ``python -m dynamo.indexer`` (HTTP; the Mooncake-RFC endpoints
  ``/register``, ``/unregister``, ``/workers``, ``/query``, ``/query_by_hash``, ``/dump``,
  ``/metrics``, ``/health``) on a free port as a subprocess, and stops it by its own PID.
  It needs no etcd or NATS (its "HTTP-only mode"). It has no option for the address and
  binds 0.0.0.0; the tests talk to it on 127.0.0.1.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from free_ports import free_port

DYNAMO_VERSION = "1.6.1"
DYNAMO_REQUIREMENT = f"ai-dynamo-runtime=={DYNAMO_VERSION}"
_BUILD_TIMEOUT_S = 900


class DynamoUnavailable(RuntimeError):
    """Dynamo's environment could not be built; the message says why."""


def venv_dir() -> Path:
    env = os.environ.get("KVOFFLOAD_DYNAMO_VENV")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "kvoffload-test" / "dynamo-venv"


def required() -> bool:
    return os.environ.get("KVOFFLOAD_REQUIRE_DYNAMO", "") not in ("", "0")


def _installed_version(python: Path) -> str | None:
    if not python.exists():
        return None
    probe = "import importlib.metadata as m, dynamo.llm; print(m.version('ai-dynamo-runtime'))"
    try:
        out = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _tail(text: str, lines: int = 8) -> str:
    return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:])


def _run(cmd: list[str], what: str) -> None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise DynamoUnavailable(f"{what} took more than {_BUILD_TIMEOUT_S} s") from None
    except OSError as exc:
        raise DynamoUnavailable(f"{what} could not run: {exc}") from None
    if out.returncode != 0:
        raise DynamoUnavailable(f"{what} failed (exit {out.returncode}): {_tail(out.stdout + out.stderr)}")


_FAILED: dict[Path, DynamoUnavailable] = {}


def dynamo_python() -> Path:
    """The interpreter of Dynamo's environment, built on first use (see module doc). A
    failed build is not tried again by the same test process."""
    target = venv_dir()
    if target in _FAILED:
        raise _FAILED[target]
    try:
        return _build(target)
    except DynamoUnavailable as exc:
        _FAILED[target] = exc
        raise


def dynamo_python_or_skip() -> Path:
    """``dynamo_python()``, or the current test skipped with the reason (failed instead when
    ``KVOFFLOAD_REQUIRE_DYNAMO`` is set)."""
    import pytest

    try:
        return dynamo_python()
    except DynamoUnavailable as exc:
        message = f"Dynamo's indexer is not available here: {exc}"
        if required():
            pytest.fail(message)
        pytest.skip(message)


def _build(target: Path) -> Path:
    python = target / "bin" / "python"
    if _installed_version(python) == DYNAMO_VERSION:
        return python
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / (target.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another test process may be building it
        if _installed_version(python) == DYNAMO_VERSION:
            return python
        # a half-built environment (an interrupted build) fails the version check: start over
        shutil.rmtree(target, ignore_errors=True)
        try:
            _run([sys.executable, "-m", "venv", str(target)], "python -m venv")
            _run(
                [str(python), "-m", "pip", "install", "-q", DYNAMO_REQUIREMENT],
                f"pip install {DYNAMO_REQUIREMENT}",
            )
        except DynamoUnavailable:
            shutil.rmtree(target, ignore_errors=True)
            raise
    if _installed_version(python) != DYNAMO_VERSION:
        raise DynamoUnavailable(
            f"the environment at {target} does not import {DYNAMO_REQUIREMENT} after the build"
        )
    return python


_LOCAL_HASHES = """
import json, sys
from dynamo.llm import compute_block_hash_for_seq
request = json.load(sys.stdin)
print(json.dumps(compute_block_hash_for_seq(request["tokens"], request["block_size"])))
"""


def dynamo_block_hashes(python: Path, tokens: list[int], block_size: int) -> list[int]:
    """Dynamo's own hash of each full block of ``tokens`` (``compute_block_hash_for_seq``,
    what its ``/query`` computes and its ``/query_by_hash`` expects), run in its
    environment: JSON in on stdin, out on stdout."""
    request = json.dumps({"tokens": tokens, "block_size": block_size})
    out = subprocess.run(
        [str(python), "-c", _LOCAL_HASHES], input=request, capture_output=True, text=True, timeout=120
    )
    if out.returncode != 0:
        raise RuntimeError(f"Dynamo's compute_block_hash_for_seq failed: {_tail(out.stderr)}")
    return json.loads(out.stdout)


def http_call(base_url: str, path: str, body: object = None) -> tuple[int, object]:
    """GET ``path`` (POST ``body`` as JSON if given); ``(status, parsed JSON or text)``."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        base_url + path,
        data=data,
        method="GET" if data is None else "POST",
        headers={"content-type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            status, payload = response.status, response.read()
    except urllib.error.HTTPError as exc:
        status, payload = exc.code, exc.read()
    text = payload.decode()
    try:
        return status, json.loads(text) if text else None
    except json.JSONDecodeError:
        return status, text


class DynamoIndexer:
    """``python -m dynamo.indexer`` on a free port (see module doc). ``call(path, body)``
    returns ``(status, parsed JSON or text)``."""

    def __init__(self, python: Path, log_path: Path, threads: int = 1) -> None:
        self.python = python
        self.log_path = log_path
        self.threads = threads
        self.proc: subprocess.Popen | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, attempts: int = 3) -> DynamoIndexer:
        last = ""
        for _ in range(attempts):  # a free port may be taken before the indexer binds it
            self.port = free_port()
            # threads=1: one radix tree fed in arrival order (the default, 4, shards the
            # work over threads); the answers are the same, the tests' waits simpler
            cmd = [str(self.python), "-m", "dynamo.indexer", "--port", str(self.port)]
            cmd += ["--threads", str(self.threads)]
            env = dict(os.environ, DYN_LOG=os.environ.get("DYN_LOG", "info"), NO_COLOR="1")
            with open(self.log_path, "ab") as log:
                self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and self.proc.poll() is None:
                try:
                    if self.call("/health")[0] == 200:
                        return self
                except OSError:
                    time.sleep(0.05)
            self.stop()
            last = _tail(self.log_path.read_text(errors="replace"))
        raise RuntimeError(f"Dynamo's indexer did not start: {last}")

    def call(self, path: str, body: object = None) -> tuple[int, object]:
        return http_call(self.url, path, body)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None

    def __enter__(self) -> DynamoIndexer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
