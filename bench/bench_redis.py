"""The shared Redis tier: pipelined store and load throughput against ``redis-benchmark``
on the same server, and the scheduler-thread cost of a lookup with the server up and down.

Run: .venv/bin/python bench/bench_redis.py [--mib 256] [--sizes 65536,262144,2097152]
     [--batches c|python|both] [--back-to-back on|off|both] [--busy] [--cpu] [--no-pin]

One ``redis-server`` (started here on a free loopback port, no persistence, stopped by its
PID) serves every measurement of one run:

* **Throughput**: ``RedisWorker`` store jobs (``SET NX`` of checksummed values, one
  pipeline per job of ``--depth`` blocks) and load jobs (``GET``, header/key/CRC32C
  checks, copy into the host pool) over a real ``HostBlockPool`` of 32 layers (default
  layout: interleaved, a block is one buffer), ``--threads`` jobs in
  flight, against ``redis-benchmark -t set|get -P depth -c threads -d size`` (raw
  ``SET``/``GET`` of the same value size and pipeline depth, no checksum, no copy: ``SET``
  of new random keys; ``GET`` of as many distinct keys as the worker loads, written first,
  like for like, the target's baseline; and ``GET`` of one key again and again, whose
  value stays in the server's caches, a stricter one, also printed) run
  against the same server in the same run, each direction right before or right after
  the worker's (the order swapped every repetition): this machine's speed changes by up
  to 2x from one second to the next (the server's own copy of a value, its ``GET`` time
  in ``INFO commandstats``, takes 15 us in one second and 25 in another), so only
  neighbours compare. Ratio: the median over repetitions of each repetition's ratio.
  Target (issue 31): >= 0.85x, and >= 0.8x with ``--busy``. ``--batches both`` times the
  worker with each job's batch run by the C module (``_pipelines``, the default where it
  was built) and in Python, in turns. ``--back-to-back both`` times the C batches with
  queued jobs back to back on each connection (queued into C by ``submit`` and sent by the
  connection's thread as the batch before is answered, the default:
  ``RedisWorker(back_to_back=True)``) and without (one thread a connection, each batch
  sent after the Python of the job before it: ``c serial``), in turns. ``--busy``: a
  thread of the bench process spins in Python throughout (the switch interval at the
  vLLM connector's), as an engine's loop does; ``redis-benchmark`` runs beside it too, a
  process with its own GIL.
* **Placement** (``--pin``, the default where there are 2 cores or more): the server alone
  on the last core, both clients (this process with all its threads, and the
  ``redis-benchmark`` it starts) on the others, as Redis benchmarks are run; unpinned
  (``--no-pin``), the kernel may run the worker's second thread (the one that submits
  and waits) on the server's core, which ``redis-benchmark``, one thread, never has.
  With ``--busy`` the default is unpinned: the spinner stands for an engine's loop, which
  has a core of its own, and on two cores pinning would put it on the clients' one.
* **Client CPU per MiB loaded** (``--cpu``): ``RedisWorker``'s load path run on the
  calling thread (``time.thread_time``: the thread's user and system time, so the kernel's
  receive copy counts) against ``redis-benchmark -t get``'s client (``getrusage`` of the
  child), same value size and depth, one key read again and again for it: what each
  client spends per byte, which the machine's other load changes far less than it changes
  throughput.
* **Lookup cost on the scheduler thread**: ``RedisOffloadingManager.lookup`` of keys not
  in its index (the probe is queued to the background thread: ``RETRY``), of keys in its
  index (``HIT``), and with the server killed (``MISS`` at once), against the CPU tier's
  own ``lookup`` miss. Target with the server down: <= 1 ms per lookup.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import torch

from kvoffload.cpu import CPUOffloadingManager
from kvoffload.integrations.vllm.config import DEFAULT_SWITCH_INTERVAL_S
from kvoffload.keys import make_offload_key
from kvoffload.specs import CPULoadStoreSpec, RemoteLoadStoreSpec
from kvoffload.tiers.redis import pipelines
from kvoffload.tiers.redis.calls import NodeCalls
from kvoffload.tiers.redis.client import ServerSettings, connect
from kvoffload.tiers.redis.format import KeyNames, value_bytes
from kvoffload.tiers.redis.lookups import RemoteLookups
from kvoffload.tiers.redis.manager import RedisOffloadingManager
from kvoffload.tiers.redis.worker import RedisWorker
from kvoffload.transfer import HostBlockPool, KVLayout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def harness(port: int):
    """The bench's own client (flushes, baseline keys): generous timeouts, since a flush of
    a large keyspace on a loaded machine takes seconds."""
    return connect(ServerSettings(f"redis://127.0.0.1:{port}/0", connect_timeout=10.0, timeout=120.0))


def start_server(folder: str, port: int, cores: set[int] | None = None) -> subprocess.Popen:
    """A ``redis-server`` on ``port``; every thread of it on ``cores`` if given."""
    proc = subprocess.Popen(
        [shutil.which("redis-server"), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", "--dir", folder],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        preexec_fn=None if cores is None else lambda: os.sched_setaffinity(0, cores),
    )  # fmt: skip
    for _ in range(200):
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return proc
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("redis-server did not start")


LAYERS = 32


def make_pool(block: int, blocks: int) -> HostBlockPool:
    """A pool of ``LAYERS`` layer tensors (a block is one page of each), default layout."""
    kv = {f"layer{i}": torch.zeros((blocks, block // LAYERS), dtype=torch.uint8) for i in range(LAYERS)}
    pool = HostBlockPool(KVLayout.from_layer_tensors(kv), blocks)
    for t in pool.tensors:
        t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8))
    return pool


def pin_this_process(cores: set[int]) -> None:
    """Every thread of this process (and what it starts later: ``redis-benchmark``, its
    own threads) on ``cores``."""
    for task in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(task), cores)


def placement(pin: bool) -> tuple[set[int] | None, set[int] | None, str]:
    """Where the server and the clients run: with ``pin`` (and 2 cores or more) the server
    alone on the last core and both clients on the others, as Redis benchmarks are run (no
    client thread ever takes the server's core); else wherever the kernel puts them."""
    cores = sorted(os.sched_getaffinity(0))
    if not pin or len(cores) < 2:
        return None, None, f"not pinned ({len(cores)} cores)"
    server, clients = {cores[-1]}, set(cores[:-1])
    return server, clients, f"redis-server pinned to core {cores[-1]}, both clients to {sorted(clients)}"


def redis_benchmark(port: int, size: int, depth: int, clients: int, requests: int, op: str) -> float:
    """Bytes/s of raw ``SET`` of new random keys (as the tier writes new blocks), ``GET``
    of ``requests`` keys at random among as many distinct ones written first (as the tier
    reads distinct blocks: like for like), or ``GET one key`` read again and again (its
    value stays in the server's caches: a stricter baseline)."""
    client = harness(port)
    spread = {"SET": ["-r", "100000000"], "GET": ["-r", str(requests)], "GET one key": []}[op]
    if op == "GET":  # redis-benchmark's keys: key:000000000000 .. key:<requests - 1>
        value = os.urandom(size)
        for start in range(0, requests, depth):
            pipe = client.pipeline(transaction=False)
            for i in range(start, min(start + depth, requests)):
                pipe.set(f"key:{i:012d}", value)
            pipe.execute()
    elif op == "GET one key":
        client.set("key:__rand_int__", os.urandom(size))
    misses = client.info("stats")["keyspace_misses"]
    out = subprocess.run(
        [shutil.which("redis-benchmark"), "-h", "127.0.0.1", "-p", str(port), "-t", op.split()[0].lower(),
         "-P", str(depth), "-c", str(clients), "-d", str(size), "-n", str(requests), "--csv", *spread],
        capture_output=True, text=True, check=True, timeout=600,
    ).stdout  # fmt: skip
    if op != "SET" and client.info("stats")["keyspace_misses"] != misses:
        raise RuntimeError(f"redis-benchmark {op}: some keys were missing, its rate would not compare")
    for line in out.splitlines():
        m = re.match(r'"(SET|GET)","([\d.]+)"', line)
        if m and m.group(1) == op.split()[0]:
            return float(m.group(2)) * size
    raise RuntimeError(f"redis-benchmark printed no {op} rate: {out!r}")


@contextlib.contextmanager
def batches_in(variant: str):
    """While open, each job's batch runs in C (``_pipelines``, ``"c"``) or in Python (the
    fallback without the C module: each value read into a buffer, checked, copied)."""
    native = pipelines._pipelines
    variant = variant.split()[0]  # "c serial": C batches, one thread a connection
    if variant == "c" and native is None:
        raise SystemExit("--batches c: kvoffload.tiers.redis._pipelines was not built")
    pipelines._pipelines = native if variant == "c" else None
    try:
        yield
    finally:
        pipelines._pipelines = native


@contextlib.contextmanager
def busy_python_thread(on: bool):
    """While open (if ``on``), a thread of this process runs Python without pause, as an
    engine's scheduling loop does: every other thread here competes with it for the GIL,
    with the switch interval the vLLM connector sets (``switch_interval_s``)."""
    stop = threading.Event()
    interval = sys.getswitchinterval()
    if on:
        sys.setswitchinterval(DEFAULT_SWITCH_INTERVAL_S)

    def spin() -> None:
        n = 0
        while not stop.is_set():
            n += 1

    thread = threading.Thread(target=spin, daemon=True)
    if on:
        thread.start()
    try:
        yield
    finally:
        stop.set()
        if on:
            thread.join()
        sys.setswitchinterval(interval)


class WorkerRun:
    """``RedisWorker`` over a pool of its own: ``total`` new blocks from key ``base`` on,
    jobs of ``depth`` blocks, ``threads`` I/O threads (connections), ``in_flight`` jobs
    submitted per thread before the oldest is waited for (2: one queued behind each)."""

    def __init__(
        self,
        port: int,
        size: int,
        depth: int,
        threads: int,
        total: int,
        base: int,
        back_to_back: bool = True,
        in_flight: int = 2,
    ) -> None:
        self.in_flight = in_flight
        self.blocks = max(depth * threads * in_flight, 64)
        self.size, self.depth, self.threads, self.jobs, self.base = size, depth, threads, total // depth, base
        settings = ServerSettings(f"redis://127.0.0.1:{port}/0", timeout=30.0)
        self.worker = RedisWorker(
            make_pool(size, self.blocks), NodeCalls(lambda: connect(settings), "bench"),
            KeyNames("bench", f"size{size}"), io_threads=threads, back_to_back=back_to_back,
        )  # fmt: skip

    def rate(self, direction: str) -> float:
        """Bytes/s of payload stored (``"SET"``) or loaded (``"GET"``, of the blocks stored)."""
        depth, worker = self.depth, self.worker
        queued = worker.counters().back_to_back
        start = time.perf_counter()
        in_flight = []
        for j in range(self.jobs):
            first = self.base + j * depth
            keys = [make_offload_key((first + i).to_bytes(32, "big"), 0) for i in range(depth)]
            host = CPULoadStoreSpec([(j * depth + i) % self.blocks for i in range(depth)])
            remote = RemoteLoadStoreSpec(keys)
            worker.submit(j, *((host, remote) if direction == "SET" else (remote, host)))
            in_flight.append(j)
            if len(in_flight) >= self.threads * self.in_flight:
                worker.wait(in_flight[: self.threads])
                in_flight = in_flight[self.threads :]
        worker.wait(in_flight)
        seconds = time.perf_counter() - start
        failed = [r.error for r in worker.poll() if not r.success]
        if failed:
            raise RuntimeError(f"{len(failed)} {direction} jobs failed: {failed[0]}")
        self.back_to_back = (worker.counters().back_to_back - queued) / self.jobs
        return self.jobs * depth * self.size / seconds

    def close(self) -> None:
        self.worker.close()


def repetition(
    port: int, size: int, args: argparse.Namespace, total: int, rep: int, variants: tuple[str, ...]
) -> tuple[dict, dict]:
    """One repetition into an emptied server: each direction of ``RedisWorker`` (each batch
    variant) right next to ``redis-benchmark``'s (its like-for-like baseline first, then
    for loads the one-key baseline), in one order on even repetitions and the reverse on
    odd ones, so that a change of the machine's speed (seconds apart at most) falls on both
    sides alike. Bytes/s: the worker's by ``"SET c"``, ``"GET python"`` etc., the baselines'
    by ``redis_benchmark``'s ``op`` (``"SET"``, ``"GET"``, ``"GET one key"``)."""
    harness(port).flushall()
    runs = {v: WorkerRun(port, size, args.depth, args.threads, total, (rep << 32) + (i << 28),
                         back_to_back=not v.endswith("serial"), in_flight=args.in_flight)
            for i, v in enumerate(variants)}  # fmt: skip
    ours, theirs = {}, {}

    def baseline(op: str) -> None:
        theirs[op] = redis_benchmark(port, value_bytes(size), args.depth, args.threads, total, op)

    def worker(op: str, v: str) -> None:
        with batches_in(v):
            ours[f"{op} {v}"] = runs[v].rate(op)
            ours[f"{op} {v} back to back"] = runs[v].back_to_back

    try:
        with busy_python_thread(args.busy):
            for op, after in (("SET", ()), ("GET", ("GET one key",))):
                steps = [lambda op=op: baseline(op)]
                steps += [lambda op=op, v=v: worker(op, v) for v in variants]
                steps += [lambda op=op: baseline(op) for op in after]
                for step in steps if rep % 2 else reversed(steps):
                    step()
    finally:
        for run in runs.values():
            run.close()
    return ours, theirs


def client_cpu(port: int, size: int, depth: int, total: int, reps: int) -> tuple[list[float], list[float]]:
    """Client CPU ms per MiB of loads: ``RedisWorker``'s load path on this thread, and
    ``redis-benchmark``'s GET client, ``reps`` alternating runs each."""
    blocks = 64
    pool = make_pool(size, blocks)
    settings = ServerSettings(f"redis://127.0.0.1:{port}/0", timeout=30.0)
    worker = RedisWorker(
        pool, NodeCalls(lambda: connect(settings), "bench"), KeyNames("bench", f"size{size}")
    )
    keys = [make_offload_key(i.to_bytes(32, "big"), 0) for i in range(total)]
    for j in range(0, total, depth):  # the values to load
        worker._store([(j + i) % blocks for i in range(depth)], keys[j : j + depth])
    connect(settings).set("key:__rand_int__", bytes(value_bytes(size)))  # redis-benchmark's GET key
    mib = total * size / 2**20
    ours, theirs = [], []
    for _ in range(reps):
        start = time.thread_time()
        for j in range(0, total, depth):
            worker._load([(j + i) % blocks for i in range(depth)], keys[j : j + depth])
        ours.append((time.thread_time() - start) / mib * 1e3)
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        subprocess.run(
            [shutil.which("redis-benchmark"), "-h", "127.0.0.1", "-p", str(port), "-t", "get",
             "-P", str(depth), "-c", "1", "-d", str(value_bytes(size)), "-n", str(total), "--csv"],
            capture_output=True, check=True, timeout=600,
        )  # fmt: skip
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        used = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
        theirs.append(used / mib * 1e3)
    worker.close()
    return ours, theirs


def lookup_costs(port: int, proc: subprocess.Popen, n: int = 20000) -> dict[str, float]:
    settings = ServerSettings(f"redis://127.0.0.1:{port}/0", connect_timeout=0.5, timeout=1.0)
    names = KeyNames("bench", "lookups")
    lookups = RemoteLookups(lambda: connect(settings), names, NodeCalls(lambda: connect(settings), "bench"))
    manager = RedisOffloadingManager(lookups, 2 * n, probe_timeout=5.0)
    cpu = CPUOffloadingManager(n)
    keys = [make_offload_key(i.to_bytes(32, "big"), 0) for i in range(4 * n)]

    def per_lookup(fn, ks) -> float:
        start = time.perf_counter()
        for key in ks:
            fn(key)
        return (time.perf_counter() - start) / len(ks) * 1e9

    costs = {"cpu tier miss (baseline)": per_lookup(cpu.lookup, keys[:n])}
    costs["unknown key: probe queued (RETRY)"] = per_lookup(manager.lookup, keys[:n])
    out = manager.prepare_store(keys[n : 2 * n])
    manager.complete_store(out.keys_to_store)
    costs["indexed key (HIT)"] = per_lookup(manager.lookup, keys[n : 2 * n])
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 30
    while not lookups.calls.down and time.monotonic() < deadline:  # the next probe finds it dead
        manager.lookup(keys[2 * n + int(time.monotonic() * 1000) % n])
        time.sleep(0.01)
    costs["server down: unknown key (MISS)"] = per_lookup(manager.lookup, keys[3 * n :])
    manager.close()
    return costs


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mib", type=int, default=256, help="bytes moved per direction and size (MiB)")
    parser.add_argument("--sizes", default="65536,262144,2097152", help="block (value payload) sizes")
    parser.add_argument("--depth", type=int, default=16, help="blocks per job = pipeline depth")
    parser.add_argument("--threads", type=int, default=1, help="worker I/O threads = redis-benchmark clients")
    parser.add_argument(
        "--in-flight", type=int, default=2, help="jobs submitted per thread before the oldest is waited for"
    )
    parser.add_argument("--reps", type=int, default=3, help="alternating repetitions per size")
    parser.add_argument(
        "--batches",
        choices=("c", "python", "both"),
        default="c" if pipelines._pipelines is not None else "python",
        help="who runs a job's batch on the socket: _pipelines (C, no GIL), Python, or both in turns",
    )
    parser.add_argument(
        "--back-to-back",
        choices=("on", "off", "both"),
        default="on",
        help="C batches of queued jobs back to back on each connection (queued in C), not, or both",
    )
    parser.add_argument(
        "--busy",
        action="store_true",
        help="a thread of the bench process spins in Python while ours runs (and while redis-benchmark runs)",
    )
    parser.add_argument(
        "--pin",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="redis-server alone on one core, both clients on the others (default: on, off with --busy)",
    )
    parser.add_argument(
        "--cpu", action="store_true", help="also: client CPU per MiB loaded, ours and redis-benchmark's"
    )
    args = parser.parse_args()
    folder = tempfile.mkdtemp(prefix="kvo-bench-redis-")
    port = free_port()
    server_cores, client_cores, where = placement(not args.busy if args.pin is None else args.pin)
    if client_cores is not None:
        pin_this_process(client_cores)
    proc = start_server(folder, port, server_cores)
    try:
        setup = f"pipeline depth {args.depth}; {args.threads} threads / clients; {where}"
        setup += f"; {args.in_flight} jobs in flight per thread" if args.in_flight != 2 else ""
        setup += "; a busy Python thread in the bench process" if args.busy else ""
        print(f"redis-server on port {port}; {setup}")
        print("| block | direction | redis-benchmark GB/s | RedisWorker GB/s | ratio (median of reps) |")
        print("|---|---|---:|---:|---:|")
        client = harness(port)
        for size in map(int, args.sizes.split(",")):
            total = max(args.depth * args.threads, (args.mib << 20) // size)
            variants = ("c", "python") if args.batches == "both" else (args.batches,)
            if args.back_to_back != "on" and "c" in variants:  # "c serial": one thread a connection
                variants = tuple(v for v in variants if v != "c" or args.back_to_back == "both")
                variants += ("c serial",)
            runs = [repetition(port, size, args, total, rep, variants) for rep in range(args.reps)]
            client.flushall()
            rows = [
                (f"{op} {v}", baseline, f"{label} ({v})")
                for op, baseline, label in (
                    ("SET", "SET", "store"),
                    ("GET", "GET", "load"),
                    ("GET", "GET one key", "load, against one key"),
                )
                for v in variants
            ]
            for direction, baseline, label in rows:
                ratios = sorted(o[direction] / t[baseline] for o, t in runs)
                ours_gbs = "/".join(f"{o[direction] / 1e9:.2f}" for o, _ in runs)
                theirs_gbs = "/".join(f"{t[baseline] / 1e9:.2f}" for _, t in runs)
                median = ratios[len(ratios) // 2]
                print(f"| {size >> 10} KiB | {label} | {theirs_gbs} | {ours_gbs} | {median:.2f} |")
            for v in variants:  # the share of batches that waited in C behind the one on the wire
                shares = ", ".join(
                    label + " " + "/".join(f"{o[op + ' ' + v + ' back to back']:.2f}" for o, _ in runs)
                    for op, label in (("SET", "stores"), ("GET", "loads"))
                )
                print(f"| {size >> 10} KiB | batches sent back to back ({v}): {shares} | | | |")
        if args.cpu:
            print()
            print("| block | RedisWorker load, client CPU ms/MiB | redis-benchmark GET, client CPU ms/MiB "
                  "| ratio theirs/ours |")  # fmt: skip
            print("|---|---:|---:|---:|")
            for size in map(int, args.sizes.split(",")):
                client.flushall()
                total = max(args.depth, (args.mib << 20) // size) // args.depth * args.depth
                ours, theirs = client_cpu(port, size, args.depth, total, args.reps)
                ratio = sorted(theirs)[len(theirs) // 2] / sorted(ours)[len(ours) // 2]
                print(f"| {size >> 10} KiB | {'/'.join(f'{x:.3f}' for x in ours)} | "
                      f"{'/'.join(f'{x:.3f}' for x in theirs)} | {ratio:.2f} |")  # fmt: skip
            client.flushall()
        print()
        print("| lookup on the scheduler thread | ns per lookup |")
        print("|---|---:|")
        for label, ns in lookup_costs(port, proc).items():
            print(f"| {label} | {ns:.0f} |")
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait()
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
