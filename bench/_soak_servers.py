"""Processes the soak starts, each stopped by its own PID: vLLM's OpenAI server (the engine
core in a child process of its own, as users run it, with the model worker inside it:
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and the ``uni`` executor), and the small tmpfs the disk
tier writes to.

``VllmServer(model, name, log_dir, kv_transfer_config, ...)``: ``start()`` waits for
``/health``; ``engine_pid()`` is the engine-core child, which holds both halves of the
connector (the process whose memory, threads and files the soak samples); ``stop()``
sends SIGTERM to the server, then SIGKILL after a grace period, then SIGKILL to any child
it left behind, each by the PID recorded while it ran.
``scrape()`` parses ``/metrics`` into ``{(name, labels): value}``.

``Tmpfs(path, size)``: ``mount()`` (root only; returns ``False`` where mounting is refused),
``fill()`` writes a filler file until the file system is full, ``free()`` deletes it,
``unmount()``.

``soak_model(path)`` builds the soak's tiny random Llama (``kvoffload.demo.tiny_model``):
smaller than the demo's (2 layers, hidden 128: 64 KiB of float32 KV per 32-token block) so
that a 2-core machine serves the trace's long prompts, with 8,192 positions for the longest
(247 trace blocks of 32 tokens).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
SERVED_NAME = "tiny"
MAX_MODEL_LEN = 8192
BLOCK = 32
SOAK_MODEL = dict(num_layers=2, hidden_size=128, num_heads=2, num_kv_heads=2, intermediate_size=256,
                  max_position_embeddings=MAX_MODEL_LEN)  # fmt: skip


def soak_model(path: str | os.PathLike) -> str:
    from kvoffload.demo.tiny_model import build_tiny_llama

    return str(build_tiny_llama(Path(path), **SOAK_MODEL))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int, timeout: float = 30) -> dict[tuple[str, tuple], float]:
    """``/metrics`` as ``{(sample name, sorted labels without model_name/engine): value}``."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as response:
        text = response.read().decode()
    values: dict[tuple[str, tuple], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(
                sorted((k, v) for k, v in sample.labels.items() if k not in ("model_name", "engine"))
            )
            values[(sample.name, labels)] = values.get((sample.name, labels), 0.0) + sample.value
    return values


def total(values: dict, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, ls), v in values.items() if n == name and want <= set(ls))


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            text = Path(f"/proc/{pid}/task/{task}/children").read_text()
            out += [int(c) for c in text.split()]
    except OSError:
        pass
    return out


def _rss_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


class VllmServer:
    def __init__(
        self,
        model: str,
        name: str,
        log_dir: Path,
        kv_transfer_config: dict[str, Any] | None = None,
        kv_cache_bytes: int = 64 << 20,
        extra_args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
    ) -> None:
        self.model = model
        self.name = name
        self.port = free_port()
        self.log_path = Path(log_dir) / f"server-{name}.log"
        self.kv_transfer_config = kv_transfer_config
        self.kv_cache_bytes = kv_cache_bytes
        self.extra_args = extra_args
        self.env = dict(env or {})
        self.proc: subprocess.Popen | None = None
        self._engine: int | None = None
        self._seen_children: set[int] = set()

    def command(self) -> list[str]:
        command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                   "--model", self.model, "--tokenizer", self.model, "--served-model-name", SERVED_NAME,
                   "--host", "127.0.0.1", "--port", str(self.port),
                   "--dtype", "float32", "--block-size", str(BLOCK), "--max-model-len", str(MAX_MODEL_LEN),
                   "--kv-cache-memory-bytes", str(self.kv_cache_bytes), "--enforce-eager",
                   "--enable-prefix-caching", "--prefix-caching-hash-algo", "sha256_cbor",
                   "--enable-prompt-tokens-details", "--seed", "0", "--distributed-executor-backend", "uni",
                   *self.extra_args]  # fmt: skip
        if self.kv_transfer_config is not None:
            command += ["--kv-transfer-config", json.dumps(self.kv_transfer_config)]
        return command

    def start(self, timeout: float = 300) -> VllmServer:
        # The engine core runs in a process of its own (the server's client to it is always
        # one); VLLM_ENABLE_V1_MULTIPROCESSING=0 lets the CPU build keep the model worker
        # in that process too (the "uni" executor), where the scheduler's and the worker's
        # halves of a connector then live together: about half the start-up of a
        # separate worker process here.
        env = dict(
            os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1"
        )
        env.update(self.env)
        env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        # vLLM's OffloadingConnector on the CPU build imports its host-copy spec from bench/
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(BENCH_DIR), env.get("PYTHONPATH")) if p)
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(self.command(), env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            self._wait_ready(timeout)
            self._engine = self._find_engine()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            self._seen_children.update(_children(self.proc.pid))
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} server exited ({self.proc.returncode}):\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                time.sleep(0.5)  # polling a condition (the server answers), not a timed wait
        raise RuntimeError(f"{self.name} server did not start in {timeout} s:\n{self.log_tail()}")

    def _find_engine(self) -> int:
        assert self.proc is not None
        children = _children(self.proc.pid)
        self._seen_children.update(children)
        for child in children:
            try:
                if "EngineCore" in Path(f"/proc/{child}/cmdline").read_text(errors="replace"):
                    return child
            except OSError:
                continue
        if not children:
            return self.proc.pid  # the engine runs in the server's own process
        return max(children, key=_rss_kib)

    def engine_pid(self) -> int:
        assert self._engine is not None, "start() first"
        return self._engine

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def scrape(self) -> dict[tuple[str, tuple], float]:
        return scrape(self.port)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self._seen_children.update(_children(self.proc.pid))
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        for child in sorted(self._seen_children):  # what its shutdown left running
            try:
                cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
            except OSError:
                continue
            if cmdline:  # still running (not a zombie reaped elsewhere)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child, signal.SIGKILL)
        self.proc = None


class Tmpfs:
    """A small tmpfs for the disk tier, and a filler file that fills it."""

    def __init__(self, path: Path, size_mib: int) -> None:
        self.path = Path(path)
        self.size_mib = size_mib
        self.mounted = False
        self.filler = self.path / "filler.bin"

    def mount(self) -> bool:
        self.path.mkdir(parents=True, exist_ok=True)
        if os.geteuid() != 0:
            return False
        result = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={self.size_mib}m,mode=0700", "tmpfs", str(self.path)],
            capture_output=True,
        )  # fmt: skip
        self.mounted = result.returncode == 0
        return self.mounted

    def fill(self) -> int:
        """Write the filler until the file system refuses (ENOSPC); its bytes."""
        written = 0
        chunk = b"\0" * (1 << 16)
        fd = os.open(self.filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            while True:
                try:
                    written += os.write(fd, chunk)
                except OSError as e:
                    if e.errno != errno.ENOSPC:
                        raise
                    return written
        finally:
            os.close(fd)

    def free_bytes(self) -> int:
        st = os.statvfs(self.path)
        return st.f_bavail * st.f_frsize

    def free(self) -> None:
        self.filler.unlink(missing_ok=True)

    def unmount(self) -> None:
        self.free()
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.path)], capture_output=True)
            self.mounted = False
