"""What the soak reads from a running engine: its memory, threads and open files from
``/proc/<pid>``, sampled in the background, and the per-phase figures from vLLM's and
kvoffload's Prometheus metrics.

``proc_sample(pid, fs_root, redis_port)``: one ``Sample``: the process's RSS (KiB),
threads, open file descriptors, and of those kvoffload's: files under the disk tier's
``fs_root`` and TCP connections to the Redis port (matched through ``/proc/<pid>/net/tcp*``
by socket inode). ``Sampler`` takes one every ``interval_s`` on a thread of its own until
``stop()``; ``mark(label)`` takes one at once, named (the warm-up and end values).

``phase_figures(before, after)``: the change of the counters over a phase: prompt tokens,
tokens served from the engine's own cache and from the connector (``prompt_tokens_cached_by_
source`` other than ``device``), their ratios, requests finished, and kvoffload's transfer
jobs by outcome and hits by tier.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from _soak_servers import total


@dataclass
class Sample:
    t: float  # seconds since the sampler started
    rss_kib: int
    threads: int
    fds: int
    kvoffload_files: int  # fds into the disk tier's folder
    redis_sockets: int  # TCP connections to the Redis port
    label: str = ""

    @property
    def kvoffload_fds(self) -> int:
        return self.kvoffload_files + self.redis_sockets


def _status(pid: int) -> dict[str, str]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        out[key] = value.strip()
    return out


def _socket_inodes_to(pid: int, port: int) -> set[str]:
    inodes: set[str] = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            remote_port = int(fields[2].rsplit(":", 1)[1], 16)
            if remote_port == port:
                inodes.add(fields[9])
    return inodes


def proc_sample(
    pid: int, fs_root: str | None, redis_port: int | None, t: float = 0.0, label: str = ""
) -> Sample:
    status = _status(pid)
    rss = int(status.get("VmRSS", "0 kB").split()[0])
    threads = int(status.get("Threads", "0"))
    redis_inodes = _socket_inodes_to(pid, redis_port) if redis_port else set()
    fds = files = sockets = 0
    root = os.path.realpath(fs_root) + os.sep if fs_root else None
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        fds += 1
        if root and target.startswith(root):
            files += 1
        elif target.startswith("socket:[") and target[8:-1] in redis_inodes:
            sockets += 1
    return Sample(t, rss, threads, fds, files, sockets, label)


class Sampler:
    def __init__(self, pid: int, fs_root: str | None, redis_port: int | None, interval_s: float = 2.0):
        self.pid = pid
        self.fs_root = fs_root
        self.redis_port = redis_port
        self.interval_s = interval_s
        self.samples: list[Sample] = []
        self._start = time.monotonic()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="soak-sampler", daemon=True)
        self._thread.start()

    def _take(self, label: str = "") -> Sample | None:
        try:
            sample = proc_sample(
                self.pid, self.fs_root, self.redis_port, time.monotonic() - self._start, label
            )
        except (OSError, ValueError, IndexError):
            return None  # the process is gone
        with self._lock:
            self.samples.append(sample)
        return sample

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):  # a monitoring period, not a wait on work
            self._take()

    def mark(self, label: str) -> Sample:
        sample = self._take(label)
        if sample is None:
            raise RuntimeError(f"process {self.pid} is gone")
        return sample

    def marked(self, label: str) -> Sample:
        with self._lock:
            return next(s for s in self.samples if s.label == label)

    def stop(self) -> list[dict]:
        self._stop.set()
        self._thread.join(10)
        with self._lock:
            return [asdict(s) for s in self.samples]


def finished_requests(values: dict) -> float:
    return total(values, "vllm:request_success_total")


def phase_figures(before: dict, after: dict) -> dict:
    def delta(name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    prompt = delta("vllm:prompt_tokens_total")
    by_source = "vllm:prompt_tokens_cached_by_source_total"
    device = delta(by_source, source="device")
    connector = delta(by_source) - device
    jobs = "vllm:kvoffload_transfer_jobs_total"
    out = {
        "requests_finished": delta("vllm:request_success_total"),
        "prompt_tokens": prompt,
        "device_hit_tokens": device,
        "connector_hit_tokens": connector,
        "device_hit_ratio": device / prompt if prompt else 0.0,
        "connector_hit_ratio": connector / prompt if prompt else 0.0,
        "load_bytes": delta("vllm:kv_offload_load_bytes_total"),
        "store_bytes": delta("vllm:kv_offload_store_bytes_total"),
        "failed_loads": delta(jobs, direction="load", outcome="failed"),
        "failed_stores": delta(jobs, direction="store", outcome="failed"),
    }
    tiers = sorted(
        {dict(ls).get("tier") for (n, ls) in after if n == "vllm:kvoffload_hit_tokens_total"} - {None}
    )
    out["kvoffload_hit_tokens_by_tier"] = {t: delta("vllm:kvoffload_hit_tokens_total", tier=t) for t in tiers}
    # every per-tier counter and failed job that moved in the phase ("tier/counter": change)
    moved = {}
    for (n, ls), v in after.items():
        labels = dict(ls)
        if n == "vllm:kvoffload_tier_counter_total":
            key = f"{labels.get('tier')}/{labels.get('counter')}"
        elif n == jobs and labels.get("outcome") == "failed":
            key = f"{labels.get('tier')}/{labels.get('direction')}_jobs_failed"
        else:
            continue
        change = v - before.get((n, ls), 0.0)
        if change:
            moved[key] = change
    out["tier_counters"] = dict(sorted(moved.items()))
    return out
