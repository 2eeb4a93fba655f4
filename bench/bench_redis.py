"""The shared Redis tier: pipelined store and load throughput against ``redis-benchmark``
on the same server, and the scheduler-thread cost of a lookup with the server up and down.

Run: .venv/bin/python bench/bench_redis.py [--mib 256] [--sizes 65536,262144,2097152]
     [--batches c|python|both] [--busy] [--cpu]

One ``redis-server`` (started here on a free loopback port, no persistence, stopped by its
PID) serves every measurement of one run:

* **Throughput**: ``RedisWorker`` store jobs (``SET NX`` of checksummed values, one
  pipeline per job of ``--depth`` blocks) and load jobs (``GET``, header/key/CRC32C
  checks, copy into the host pool) over a real ``HostBlockPool`` of 32 layers (default
  layout: interleaved, a block is one buffer), ``--threads`` jobs in
  flight, against ``redis-benchmark -t set,get -P depth -c threads -d size`` (raw
  ``SET``/``GET`` of the same value size and pipeline depth, no checksum, no copy) run
  against the same server in the same run. Target: >= 0.8x. ``--batches both`` times the
  worker with each job's batch run by the C module (``_pipelines``, the default where it
  was built) and in Python, in turns. ``--busy``: a thread of the bench process spins in
  Python throughout (the switch interval at the vLLM connector's), as an engine's loop
  does; ``redis-benchmark`` runs beside it too, a process with its own GIL.
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


def start_server(folder: str, port: int) -> subprocess.Popen:
    proc = subprocess.Popen(
        [shutil.which("redis-server"), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", "--dir", folder],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
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


def redis_benchmark(port: int, size: int, depth: int, clients: int, requests: int) -> dict[str, float]:
    """Bytes/s of raw ``SET`` (new random keys, as the tier writes new blocks) and ``GET``
    (one key read again and again: a baseline at least as fast as reading many keys)."""
    rates = {}
    for test, spread in (("set", ["-r", "100000000"]), ("set,get", [])):
        out = subprocess.run(
            [shutil.which("redis-benchmark"), "-h", "127.0.0.1", "-p", str(port), "-t", test,
             "-P", str(depth), "-c", str(clients), "-d", str(size), "-n", str(requests), "--csv", *spread],
            capture_output=True, text=True, check=True, timeout=600,
        ).stdout  # fmt: skip
        for line in out.splitlines():
            m = re.match(r'"(SET|GET)","([\d.]+)"', line)
            if m and m.group(1) not in rates:
                rates[m.group(1)] = float(m.group(2)) * size
    return rates


def worker_throughput(
    port: int, size: int, depth: int, threads: int, total: int, base: int, batches: str = "c"
) -> dict[str, float]:
    """Bytes/s of payload ``RedisWorker`` stores and then loads: ``total`` new blocks from
    key ``base`` on, jobs of ``depth`` blocks, ``threads`` I/O threads, 2x that in flight;
    each job's batch run by ``_pipelines`` (``batches="c"``) or in Python (``"python"``)."""
    native = pipelines._pipelines
    if batches == "c" and native is None:
        raise SystemExit("--batches c: kvoffload.tiers.redis._pipelines was not built")
    try:
        pipelines._pipelines = native if batches == "c" else None
        return _throughput(port, size, depth, threads, total, base)
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


def _throughput(port: int, size: int, depth: int, threads: int, total: int, base: int) -> dict[str, float]:
    blocks = max(depth * threads * 2, 64)
    pool = make_pool(size, blocks)
    settings = ServerSettings(f"redis://127.0.0.1:{port}/0", timeout=30.0)
    names = KeyNames("bench", f"size{size}")
    worker = RedisWorker(pool, NodeCalls(lambda: connect(settings), "bench"), names, io_threads=threads)
    jobs = total // depth
    rates = {}
    for direction in ("SET", "GET"):
        start = time.perf_counter()
        in_flight = []
        for j in range(jobs):
            keys = [make_offload_key((base + j * depth + i).to_bytes(32, "big"), 0) for i in range(depth)]
            host = CPULoadStoreSpec([(j * depth + i) % blocks for i in range(depth)])
            remote = RemoteLoadStoreSpec(keys)
            src, dst = (host, remote) if direction == "SET" else (remote, host)
            worker.submit(j, src, dst)
            in_flight.append(j)
            if len(in_flight) >= threads * 2:
                worker.wait(in_flight[:threads])
                in_flight = in_flight[threads:]
        worker.wait(in_flight)
        seconds = time.perf_counter() - start
        failed = [r.error for r in worker.poll() if not r.success]
        if failed:
            raise RuntimeError(f"{len(failed)} {direction} jobs failed: {failed[0]}")
        rates[direction] = jobs * depth * size / seconds
    worker.close()
    return rates


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
    parser.add_argument("--reps", type=int, default=3, help="alternating repetitions per size")
    parser.add_argument(
        "--batches",
        choices=("c", "python", "both"),
        default="c" if pipelines._pipelines is not None else "python",
        help="who runs a job's batch on the socket: _pipelines (C, no GIL), Python, or both in turns",
    )
    parser.add_argument(
        "--busy",
        action="store_true",
        help="a thread of the bench process spins in Python while ours runs (and while redis-benchmark runs)",
    )
    parser.add_argument(
        "--cpu", action="store_true", help="also: client CPU per MiB loaded, ours and redis-benchmark's"
    )
    args = parser.parse_args()
    folder = tempfile.mkdtemp(prefix="kvo-bench-redis-")
    port = free_port()
    proc = start_server(folder, port)
    try:
        setup = f"pipeline depth {args.depth}; {args.threads} threads / clients; {os.cpu_count()} cores"
        setup += "; a busy Python thread in the bench process" if args.busy else ""
        print(f"redis-server on port {port}; {setup}")
        print("| block | direction | redis-benchmark GB/s | RedisWorker GB/s | ratio (median of reps) |")
        print("|---|---|---:|---:|---:|")
        client = connect(ServerSettings(f"redis://127.0.0.1:{port}/0"))
        for size in map(int, args.sizes.split(",")):
            total = max(args.depth * args.threads, (args.mib << 20) // size)
            variants = ("c", "python") if args.batches == "both" else (args.batches,)
            runs = []
            for rep in range(args.reps):  # alternate, each into an emptied server
                ours, theirs = {}, {}
                for variant in variants:
                    client.flushall()
                    with busy_python_thread(args.busy):
                        rates = worker_throughput(
                            port, size, args.depth, args.threads, total, rep << 32, variant
                        )
                    ours.update({f"{op} {variant}": rate for op, rate in rates.items()})
                client.flushall()
                with busy_python_thread(args.busy):
                    rates = redis_benchmark(port, value_bytes(size), args.depth, args.threads, total)
                theirs.update({f"{op} {variant}": rate for op, rate in rates.items() for variant in variants})
                runs.append((ours, theirs))
            client.flushall()
            rows = [
                (f"{op} {v}", f"{label} ({v})")
                for op, label in (("SET", "store"), ("GET", "load"))
                for v in variants
            ]
            for direction, label in rows:
                ratios = sorted(o[direction] / t[direction] for o, t in runs)
                ours_gbs = "/".join(f"{o[direction] / 1e9:.2f}" for o, _ in runs)
                theirs_gbs = "/".join(f"{t[direction] / 1e9:.2f}" for _, t in runs)
                median = ratios[len(ratios) // 2]
                print(f"| {size >> 10} KiB | {label} | {theirs_gbs} | {ours_gbs} | {median:.2f} |")
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
