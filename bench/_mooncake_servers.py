"""A Mooncake Store for benchmarks: ``mooncake_master`` and a standalone segment holder
(``mooncake_client``) on free loopback ports, stopped by their PIDs, and the clients the
benchmarks use on it (Mooncake's own, and the tier's ``MooncakeStore``).

The processes are started as the tests' ``tests/mooncake_server.py`` starts them (P2P
handshake metadata, the master's RPC and metrics on 127.0.0.1, TCP transfers); this copy
adds core placement and stays out of the test tree. ``tier_pool``: the host pool an engine
has beside a Mooncake tier.
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import torch

from bench_redis import LAYERS, free_port, make_pool
from kvoffload.tiers.mooncake.objects import SLOT_BYTES
from kvoffload.tiers.mooncake.store import ClientSettings, MooncakeStore
from kvoffload.transfer.host_pool import HostBlockPool
from kvoffload.transfer.layout import KVLayout

BIN = os.path.dirname(sys.executable)
METADATA = "P2PHANDSHAKE"


def _child_setup(cores: set[int] | None):
    """In the child before exec: die with this process (SIGTERM), and run on ``cores``."""

    def setup() -> None:
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if cores is not None:
            os.sched_setaffinity(0, cores)

    return setup


class MooncakeServers:
    """A master and a holder contributing ``segment_bytes``, every process on ``cores`` if
    given, logs in ``folder``. ``start``; ``kill_master`` (SIGKILL of the master alone);
    ``stop``."""

    def __init__(self, folder: str, segment_bytes: int, cores: set[int] | None = None) -> None:
        self.folder, self.segment_bytes, self.cores = folder, segment_bytes, cores
        self.rpc_port, self.metrics_port, self.holder_port = free_port(), free_port(), free_port()
        self.master: subprocess.Popen | None = None
        self.holder: subprocess.Popen | None = None

    @property
    def master_address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen:
        common = [f"--log_dir={self.folder}", "--logtostderr=false", "--minloglevel=1"]
        with open(os.path.join(self.folder, f"{name}.log"), "ab") as out:
            return subprocess.Popen(
                [os.path.join(BIN, name), *args, *common], stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, preexec_fn=_child_setup(self.cores),
            )  # fmt: skip

    def capacity(self) -> int:
        """Bytes of segment the master knows of (0 while it does not answer)."""
        try:
            url = f"http://127.0.0.1:{self.metrics_port}/metrics"
            with urllib.request.urlopen(url, timeout=0.5) as response:
                text = response.read().decode()
        except OSError:
            return 0
        found = re.search(r"^master_total_capacity_bytes (\S+)$", text, re.M)
        return int(float(found.group(1))) if found else 0

    def start(self) -> MooncakeServers:
        self.master = self._spawn("mooncake_master", [
            "--rpc_address=127.0.0.1", f"--rpc_port={self.rpc_port}", "--metrics_host=127.0.0.1",
            f"--metrics_port={self.metrics_port}",
        ])  # fmt: skip
        self.holder = self._spawn("mooncake_client", [
            "--host=127.0.0.1", f"--port={self.holder_port}",
            f"--master_server_address={self.master_address}", f"--metadata_server={METADATA}",
            f"--global_segment_size={self.segment_bytes}", "--protocol=tcp",
        ])  # fmt: skip
        deadline = time.monotonic() + 30
        while self.capacity() < self.segment_bytes:
            dead = [p.args[0] for p in (self.master, self.holder) if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(
                    f"the Mooncake store did not come up (exited: {dead}; logs in {self.folder})"
                )
            time.sleep(0.05)
        return self

    def kill_master(self) -> None:
        if self.master is not None and self.master.poll() is None:
            os.kill(self.master.pid, signal.SIGKILL)
            self.master.wait()

    def stop(self) -> None:
        for proc in (self.holder, self.master):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    os.kill(proc.pid, signal.SIGKILL)
                    proc.wait()


def raw_client(servers: MooncakeServers, local_buffer: int = 16 << 20):
    """Mooncake's own client (``MooncakeDistributedStore``), client only, on ``servers``."""
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    rc = store.setup("127.0.0.1", METADATA, 0, local_buffer, "tcp", "", servers.master_address)
    if rc != 0:
        raise RuntimeError(f"MooncakeDistributedStore.setup against {servers.master_address} returned {rc}")
    return store


def tier_store(servers: MooncakeServers, name: str, **settings) -> MooncakeStore:
    """The tier's client owner (``MooncakeStore``) on ``servers``, once set up."""
    store = MooncakeStore(
        ClientSettings(master=servers.master_address, metadata_server=METADATA, **settings), name
    )
    if not store.wait_ready(60):
        store.close()
        raise RuntimeError(f"the Mooncake tier's client did not set up against {servers.master_address}")
    return store


def tier_config(servers: MooncakeServers) -> dict:
    """The ``secondary_tiers`` entry of a Mooncake tier on ``servers`` (client only)."""
    return {"type": "mooncake", "master": servers.master_address}


def tier_pool(block: int, blocks: int, split: bool) -> HostBlockPool:
    """``bench_redis.make_pool``'s pool (``LAYERS`` layers, random rows) with the row prefix
    an engine's pool has beside a Mooncake tier (``kvoffload.tiers.factory``: each object one
    buffer), or, ``split``, without it (each object a header slot and the block's rows)."""
    if split:
        return make_pool(block, blocks)
    kv = {f"layer{i}": torch.zeros((blocks, block // LAYERS), dtype=torch.uint8) for i in range(LAYERS)}
    pool = HostBlockPool(KVLayout.from_layer_tensors(kv), blocks, row_prefix_bytes=SLOT_BYTES)
    pool.region.copy_(torch.randint(0, 256, pool.region.shape, dtype=torch.uint8))
    return pool
