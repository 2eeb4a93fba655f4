"""One soak: the same phases of vLLM's own load generator (``vllm bench serve``) against
servers with different connectors, faults beside kvoffload's, and the figures compared.

Servers (``SERVERS``), one at a time on this machine:

* ``baseline``: no connector; its greedy outputs are the reference.
* ``kvoffload``: ``KVOffloadConnector`` with a CPU tier, a disk (``fs``) tier on a small
  tmpfs and a Redis tier on a real ``redis-server``, ``fault_injection`` failing a share of
  loads and stores, and the fault script (``_soak_faults``) killing Redis and filling the
  disk while the trace and prefix phases run.
* ``offloading``: vLLM 0.32's ``OffloadingConnector`` with its CPU manager (``cpu_bytes_to_use``,
  ``block_size``) and the same CPU budget, through ``bench_models.HostCopyOffloadingSpec``:
  vLLM's own CPU worker refuses any platform but CUDA and XPU. No faults.
* ``kvoffload-cpu``: kvoffload with the CPU tier alone and no faults: the like-for-like
  counterpart of ``offloading``.

Phases per server: ``warmup`` (a few prefix-repetition requests; then the resource sample
the end is compared with), ``trace`` (``timed_trace`` replaying the first requests of the
shared Mooncake conversation trace, its 512-token blocks scaled to 32-token ones with
``--timed-trace-chunk-hash-size 32``, time compressed with ``--timed-trace-sec-multiplier``),
``prefix`` (``prefix_repetition``), ``after`` (a few requests once every fault is repaired:
the tiers serve again), then the last sample once the engine is idle.

Every request is greedy (temperature 0) with 8 output tokens (``max_tokens`` in
``--extra-body``: the trace's own output lengths would make the soak mostly decoding), the
prompts are the same on every server (``--seed 0`` and ``PYTHONHASHSEED=0``: the trace's
prompt tokens are drawn from ``hash()`` of its block ids), and every phase's generated texts
are compared request by request with the baseline's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from _soak_bench_cli import DONE
from _soak_faults import FaultScript, cycle_steps
from _soak_probe import Sampler, finished_requests, phase_figures
from _soak_servers import BLOCK, SERVED_NAME, Tmpfs, VllmServer, total

TRACE = (
    Path(__file__).resolve().parent.parent.parent
    / "shared"
    / "traces"
    / "mooncake_fast25_conversation_trace.jsonl"
)
BLOCK_BYTES = 2 * 2 * 64 * 2 * BLOCK * 4  # the soak model: 2 layers, 2 KV heads of 64, K and V, float32
SERVERS = ("baseline", "kvoffload", "kvoffload-cpu", "offloading")
PHASES = ("warmup", "trace", "prefix", "after")


@dataclass
class SoakConfig:
    duration_s: float = 600.0  # load time per server, trace and prefix phases together
    trace_rate: float = 3.0  # trace requests per second (the trace's timestamps compressed to it)
    trace_sample: str = "head"  # "head": the trace's first requests; "conversations": see trace_file
    prefix_rate: float = 3.0  # prefix-repetition requests per second
    prefix_tokens: int = 1024  # prefix_repetition's shared prefix, tokens
    prefixes: int = 32  # and how many distinct prefixes (the requests repeat them)
    concurrency: int = 32  # clients at most at once (vllm bench serve --max-concurrency)
    fault_cycles: int = 1  # kill/restart and fill/free cycles per faulted phase
    failure_rate: float = 0.05  # kvoffload's injected load and store failures
    device_blocks: int = 272  # the engine's own KV cache, 32-token blocks (256 hold one 8,192-token request)
    cpu_blocks: int = 2048  # host tier (both connectors)
    disk_mib: int = 64  # the tmpfs; the disk tier gets 3/4 of it
    redis_maxmemory: str = "256mb"
    baseline_same_timing: bool = True  # False: the baseline gets every request at once (outputs only)
    trace_path: Path = TRACE
    servers: tuple[str, ...] = SERVERS
    work_dir: Path = field(default_factory=lambda: Path("/tmp/kvoffload-soak"))

    def phase_requests(self) -> dict[str, int]:
        half = self.duration_s / 2
        prefix = max(2, round(self.prefix_rate * half / self.prefixes)) * self.prefixes  # whole repetitions
        return {"warmup": 8, "trace": max(8, int(self.trace_rate * half)), "prefix": prefix, "after": 8}


def trace_file(cfg: SoakConfig) -> Path:
    """The trace ``timed_trace`` reads. ``head``: the shared file itself (its first requests
    are replayed). ``conversations``: the requests of the trace's first conversations with
    two turns or more (a conversation: the requests sharing their second block id), in trace
    order, written to the work folder; in the trace's first 100 requests no turn continues
    an earlier one, so a short replay of its head finds nothing to reuse but block 0."""
    if cfg.trace_sample == "head":
        return cfg.trace_path
    wanted = cfg.phase_requests()["trace"]
    turns: dict[int, list[str]] = {}
    with open(cfg.trace_path) as f:
        for line in f:
            ids = json.loads(line)["hash_ids"]
            if len(ids) > 1:
                turns.setdefault(ids[1], []).append(line)
    chosen: list[str] = []
    for lines in turns.values():  # conversations in order of their first turn
        if len(lines) > 1 and len(chosen) < wanted:
            chosen += lines
    entries = sorted((json.loads(line) for line in chosen), key=lambda e: e["timestamp"])[:wanted]
    first = entries[0]["timestamp"] if entries else 0
    out = cfg.work_dir / "trace-conversations.jsonl"
    out.write_text("".join(json.dumps(dict(e, timestamp=e["timestamp"] - first)) + "\n" for e in entries))
    return out


def synthetic_trace(path: Path, conversations: int = 60, seed: int = 0) -> Path:
    """A conversation trace in the Mooncake format (``timestamp`` ms, ``input_length``,
    ``output_length``, 512-token ``hash_ids``) from kvoffload's own ``multi_turn_chat``
    workload, written to ``path``: what the short form replays where the shared trace is
    not beside the checkout."""
    from kvoffload.sim.workloads import ChatWorkload, multi_turn_chat

    trace = multi_turn_chat(ChatWorkload(conversations=conversations, block_size=512, seed=seed))
    path.write_text(
        "".join(
            json.dumps({"timestamp": r.timestamp, "input_length": r.input_length,
                        "output_length": r.output_length, "hash_ids": list(r.hash_ids)}) + "\n"
            for r in trace.requests
        )
    )  # fmt: skip
    return path


def trace_multiplier(path: Path, requests: int, seconds: float) -> float:
    """The ``--timed-trace-sec-multiplier`` that replays the first ``requests`` in ``seconds``."""
    first = last = None
    with open(path) as f:
        for i, line in enumerate(f):
            stamp = float(json.loads(line)["timestamp"])
            first = stamp if first is None else first
            last = stamp
            if i == requests - 1:
                break
    span = (last or 0.0) - (first or 0.0)
    return seconds / span if span > 0 else 0.001


def bench_args(cfg: SoakConfig, phase: str, timed: bool) -> list[str]:
    n = cfg.phase_requests()[phase]
    if phase == "trace":
        path = trace_file(cfg)
        args = ["--dataset-name", "timed_trace", "--dataset-path", str(path),
                "--timed-trace-chunk-hash-size", str(BLOCK)]  # fmt: skip
        if timed:
            mult = trace_multiplier(path, n, cfg.duration_s / 2)
            args += ["--timed-trace-sec-multiplier", f"{mult:.9g}"]
        else:
            args += ["--no-self-timed", "--request-rate", "inf"]
    else:
        shapes = {
            "warmup": (256, 32, 2, 7),
            "after": (256, 32, 2, 8),
            "prefix": (cfg.prefix_tokens, 64, cfg.prefixes, 0),
        }
        prefix, suffix, prefixes, seed = shapes[phase]
        args = ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", str(prefix),
                "--prefix-repetition-suffix-len", str(suffix), "--prefix-repetition-num-prefixes",
                str(prefixes), "--prefix-repetition-output-len", "8", "--seed", str(seed)]  # fmt: skip
        rate = cfg.prefix_rate if timed and phase == "prefix" else float("inf")
        args += ["--request-rate", str(rate)]
    return args + ["--num-prompts", str(n)]


class BenchClient:
    """One ``_soak_bench_cli`` process (vLLM's ``vllm bench serve``, imported once) for every
    phase of a soak; its output goes to ``log_path``."""

    def __init__(self, log_path: Path) -> None:
        env = dict(os.environ, PYTHONHASHSEED="0", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(Path(__file__).parent), env.get("PYTHONPATH")) if p
        )
        self.log = open(log_path, "a")  # noqa: SIM115 - open for the client's life, closed by close()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "_soak_bench_cli"], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, bufsize=1,
        )  # fmt: skip
        self._read_until_done()  # imported

    def _read_until_done(self) -> int:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.log.write(line)
            if line.startswith(DONE):
                self.log.flush()
                return int(line.split()[1])
        self.log.flush()
        raise RuntimeError(f"the bench client exited ({self.proc.wait()}); see {self.log.name}")

    def run(self, args: list[str]) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(args) + "\n")
        self.proc.stdin.flush()
        return self._read_until_done()

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def run_bench(
    client: BenchClient, server: VllmServer, cfg: SoakConfig, phase: str, timed: bool, out_dir: Path
) -> dict:
    name = f"{server.name}-{phase}.json"
    args = ["--backend", "openai", "--host", "127.0.0.1", "--port", str(server.port),
            "--model", server.model, "--tokenizer", server.model, "--served-model-name", SERVED_NAME,
            "--temperature", "0", "--extra-body", json.dumps({"max_tokens": 8, "ignore_eos": True}),
            "--max-concurrency", str(cfg.concurrency), "--num-warmups", "0", "--disable-tqdm",
            "--percentile-metrics", "ttft,e2el", "--metric-percentiles", "50,90,99",
            "--save-result", "--save-detailed", "--result-dir", str(out_dir), "--result-filename", name,
            *bench_args(cfg, phase, timed)]  # fmt: skip
    (out_dir / name).unlink(missing_ok=True)
    start = time.monotonic()
    rc = client.run(args)
    wall = time.monotonic() - start
    if rc != 0 or not (out_dir / name).exists():
        raise RuntimeError(f"vllm bench serve ({server.name}, {phase}) failed ({rc}); see {client.log.name}")
    result = json.loads((out_dir / name).read_text())
    result["wall_s"] = wall
    return result


def wait_idle(server: VllmServer, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        values = server.scrape()
        if total(values, "vllm:num_requests_running") + total(values, "vllm:num_requests_waiting") == 0:
            return
        time.sleep(0.2)  # polls a condition
    raise RuntimeError(f"{server.name}: requests still running after {timeout} s")


def connector_config(kind: str, cfg: SoakConfig, fs_root: str | None, redis_url: str | None) -> dict | None:
    cpu = cfg.cpu_blocks * BLOCK_BYTES
    if kind == "baseline":
        return None
    if kind == "offloading":
        return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"cpu_bytes_to_use": cpu, "block_size": BLOCK,
                                              "spec_name": "HostCopyOffloadingSpec",
                                              "spec_module_path": "bench_models"},
                "kv_load_failure_policy": "recompute"}  # fmt: skip
    from kvoffload.demo.offline import kv_transfer_config

    if kind == "kvoffload-cpu":
        return kv_transfer_config({"cpu_bytes_to_use": cpu})
    tiers: list[dict] = []
    if fs_root:
        tiers.append({"type": "fs", "root_dir": fs_root, "bytes_to_use": cfg.disk_mib * 3 // 4 << 20})
    if redis_url:
        tiers.append({"type": "redis", "url": redis_url, "timeout_s": 1.0, "connect_timeout_s": 0.5,
                      "probe_timeout_s": 1.0})  # fmt: skip
    extra = {"cpu_bytes_to_use": cpu, "secondary_tiers": tiers}
    if cfg.failure_rate:
        # a rate, and fixed positions so that some jobs fail on every run, however short
        extra["fault_injection"] = {"seed": 1, "load_failure_rate": cfg.failure_rate,
                                    "store_failure_rate": cfg.failure_rate,
                                    "fail_loads": [0, 3], "fail_stores": [1, 6]}  # fmt: skip
    return kv_transfer_config(extra)


class ServerRun:
    """One server of a soak: ``start()`` (with its Redis and tmpfs for kvoffload),
    ``run(client)`` (the phases, the fault script beside kvoffload's), ``close()`` (every
    process it started stopped by PID, the tmpfs unmounted). ``report`` holds the figures."""

    def __init__(self, kind: str, model: str, cfg: SoakConfig, redis_server_cls, log=print) -> None:
        self.kind, self.model, self.cfg, self.log = kind, model, cfg, log
        self.redis_server_cls = redis_server_cls
        self.out_dir = cfg.work_dir / kind
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.tmpfs: Tmpfs | None = None
        self.redis = self.server = self.sampler = None
        self.fs_root: str | None = None
        self.report: dict = {"server": kind, "phases": {}, "faults": []}

    def start(self) -> ServerRun:
        cfg, redis_url = self.cfg, None
        if self.kind == "kvoffload":
            self.tmpfs = Tmpfs(cfg.work_dir / "disk", cfg.disk_mib)
            self.report["tmpfs_mounted"] = self.tmpfs.mount()
            if not self.report["tmpfs_mounted"]:
                self.tmpfs = None  # fallback: the disk tier in the work folder, no disk-full fault
            self.fs_root = str(cfg.work_dir / "disk" / "kv")
            redis_dir = cfg.work_dir / "redis"
            redis_dir.mkdir(exist_ok=True)
            self.redis = self.redis_server_cls(redis_dir, maxmemory=cfg.redis_maxmemory).start()
            redis_url = self.redis.url
        config = connector_config(self.kind, cfg, self.fs_root, redis_url)
        self.server = VllmServer(self.model, self.kind, self.out_dir, config, cfg.device_blocks * BLOCK_BYTES)
        started = time.monotonic()
        self.server.start()
        self.report["start_s"] = time.monotonic() - started
        self.log(f"[{self.kind}] server up in {self.report['start_s']:.1f} s (pid {self.server.proc.pid}, "
                 f"engine {self.server.engine_pid()})")  # fmt: skip
        return self

    def run(self, client: BenchClient) -> dict:
        cfg, server, report = self.cfg, self.server, self.report
        assert server is not None, "start() first"
        self.sampler = Sampler(server.engine_pid(), self.fs_root, self.redis.port if self.redis else None)
        timed = self.kind != "baseline" or cfg.baseline_same_timing
        # The disk tier reserves its file's space ahead, 64 MiB at a time, on its first write
        # into it (kvoffload.tiers.fs.space); a full file system only bites what is not
        # reserved yet. So the disk is full before the first write: warm-up's stores meet
        # the full disk, and the trace phase frees it early on. Later fills find the tier's
        # space reserved, as a real disk filling up beside it would.
        disk_full = self.tmpfs is not None
        if disk_full:
            filled = self.tmpfs.fill()
            report["faults"].append({"action": "fill_disk", "phase": "start", "requests_finished": 0,
                                     "during_load": False, "filler_bytes": filled})  # fmt: skip
        for phase in PHASES:
            before = server.scrape()
            script = None
            if self.kind == "kvoffload" and phase in ("trace", "prefix"):
                n = cfg.phase_requests()[phase]
                steps = cycle_steps(finished_requests(before), n, cfg.fault_cycles, free_first=disk_full)
                script = FaultScript(server, self.redis, self.tmpfs, steps, disk_full=disk_full)
                script.run_in_background()
                disk_full = False
            try:
                result = run_bench(
                    client, server, cfg, phase, timed and phase in ("trace", "prefix"), self.out_dir
                )
            finally:
                if script is not None:
                    report["faults"] += [dict(e, phase=phase) for e in script.finish()]
            wait_idle(server)
            figures = phase_figures(before, server.scrape())
            report["phases"][phase] = {"result": result, "metrics": figures}
            self.log(f"[{self.kind}] {phase}: {result['completed']} served, {result['failed']} failed, "
                     f"TTFT mean {result['mean_ttft_ms']:.1f} ms, "
                     f"connector hits {figures['connector_hit_ratio']:.3f}, "
                     f"device hits {figures['device_hit_ratio']:.3f}, {result['wall_s']:.1f} s")  # fmt: skip
            if phase in ("warmup", "trace"):
                report[f"{phase}_sample"] = vars(self.sampler.mark(phase))
        report["last_sample"] = vars(self.sampler.mark("last"))
        if self.redis is not None:
            report["redis_keys_at_end"] = self.redis.client().dbsize()
        return report

    def close(self) -> None:
        if self.sampler is not None:
            self.report["samples"] = self.sampler.stop()
            self.sampler = None
        if self.server is not None:
            self.report["log_tail"] = self.server.log_tail(2000)
            self.server.stop()
        if self.redis is not None:
            self.redis.stop()
        if self.tmpfs is not None:
            self.tmpfs.unmount()


def compare_outputs(reference: dict, other: dict) -> dict:
    """Per phase, how many requests produced the same text as the reference, and which differ."""
    out = {}
    for phase, ref in reference["phases"].items():
        mine = other["phases"].get(phase)
        if mine is None:
            continue
        a, b = ref["result"]["generated_texts"], mine["result"]["generated_texts"]
        ea, eb = ref["result"]["errors"], mine["result"]["errors"]
        both = [i for i in range(min(len(a), len(b))) if not ea[i] and not eb[i]]
        differ = [i for i in both if a[i] != b[i]]
        out[phase] = {"compared": len(both), "differ": len(differ), "first_differing": differ[:5]}
    return out


__all__ = ["SoakConfig", "ServerRun", "BenchClient", "compare_outputs"]
