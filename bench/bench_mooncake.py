"""The shared tier side by side: Mooncake Store and Redis, same machine, same run.

Run: .venv/bin/python bench/bench_mooncake.py [--mib 256] [--sizes 65536,262144,2097152]
     [--depth 16] [--threads 1] [--reps 3] [--slices 8] [--no-pin] [--self-check] [--split]
     .venv/bin/python bench/bench_mooncake.py --engine [--rounds 7] [--tokens 2000]

Throughput (the default mode). A ``mooncake_master`` with one standalone segment holder
(``mooncake_client``, TCP; ``_mooncake_servers.py``) and a ``redis-server``, started here
on free loopback ports and stopped by their PIDs, serve every measurement of one run. Per
block size and repetition each direction (stores of new keys, then loads of the keys just
stored) is measured for four contenders, into emptied servers:

1. **Mooncake's own batches**, the target's baseline: ``batch_put_from`` /
   ``batch_get_into`` of objects of the tier's object size (header, key, payload),
   ``--depth`` keys per call, from and into one buffer registered with the client;
2. **kvoffload's Mooncake tier** (``MooncakeWorker``): store jobs from, and load jobs into,
   a real ``HostBlockPool`` (32 layers, interleaved, with the row prefix an engine's pool
   has beside a Mooncake tier, so each object is one buffer; ``--split``: without it, each
   object a header slot and the block's rows), ``--depth`` blocks per job and batch,
   ``--threads`` I/O threads with 2x that many jobs in flight, as ``bench_redis.py`` drives
   ``RedisWorker`` (with ``--threads`` > 1 the baseline runs that many calls at once);
3. **kvoffload's Redis tier** (``bench_redis.WorkerRun``) and
4. ``redis-benchmark`` at the same value size and pipeline depth (``bench_redis.redis_benchmark``:
   ``SET`` of new keys, ``GET`` of as many distinct keys).

Only neighbours compare (this machine's speed changes by up to 2x from one second to the
next): the Mooncake pair takes turns in ``--slices`` slices of the jobs (who goes first
alternating), the Redis pair runs back to back (its order swapped every repetition), and
which pair goes first alternates too. Ratios: the median of the repetitions' ratios; each
contender's GB/s per repetition (the baselines count their whole object, the tiers their
payload). Target: the Mooncake tier's loads and stores >= 0.8x of Mooncake's own batches.
``--self-check`` runs Mooncake's batches in the tier's column (a second client): an A/A
run, the harness's noise floor. Placement (``--pin``, the default with 2 cores or more):
every server alone on the last core, this process (and ``redis-benchmark``) on the others.

Lookup cost on the scheduler thread: each tier manager's ``lookup`` of unknown keys (a
probe queued: ``RETRY``), of indexed keys (``HIT``) and, its server killed (Mooncake: the
master), of unknown keys (``MISS``), against the CPU tier's own ``lookup`` miss.

``--engine``: time to first token of a shared-tier hit on real vLLM engines (CPU build,
tiny Llama), see ``engine_ttft``. Target: a Mooncake hit's TTFT <= a Redis hit's.
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _mooncake_servers import MooncakeServers, raw_client, tier_config, tier_pool, tier_store  # noqa: E402
from _tier_engines import Engine  # noqa: E402
from bench_redis import (  # noqa: E402 - a sibling script
    WorkerRun,
    free_port,
    lookup_costs,
    pin_this_process,
    placement,
    redis_benchmark,
    start_server,
)
from kvoffload.cpu import CPUOffloadingManager  # noqa: E402
from kvoffload.keys import make_offload_key  # noqa: E402
from kvoffload.specs import CPULoadStoreSpec  # noqa: E402
from kvoffload.tiers.mooncake.lookups import MooncakeLookups  # noqa: E402
from kvoffload.tiers.mooncake.manager import MooncakeOffloadingManager  # noqa: E402
from kvoffload.tiers.mooncake.names import MooncakeLoadStoreSpec  # noqa: E402
from kvoffload.tiers.mooncake.worker import MooncakeWorker  # noqa: E402
from kvoffload.tiers.redis.client import ServerSettings, connect  # noqa: E402
from kvoffload.tiers.redis.format import KeyNames, value_bytes  # noqa: E402


class BatchRun:
    """Mooncake's own batches on ``store``: objects of ``size`` bytes named
    ``<prefix>-<i>``, ``depth`` per call, from and into one registered buffer of as many
    slots as the tier's pool has blocks, ``threads`` calls at once. ``own``: the store is
    this run's, closed with it."""

    def __init__(self, store, size: int, depth: int, threads: int, total: int, prefix: str, own=False):
        self.store, self.size, self.depth, self.threads, self.own = store, size, depth, threads, own
        self.slots = max(depth * threads * 2, 64)
        self.buffer = np.random.randint(0, 256, self.slots * size, dtype=np.uint8)
        self.base = self.buffer.ctypes.data
        if store.register_buffer(self.base, self.buffer.nbytes) != 0:
            raise RuntimeError("register_buffer failed")
        self.keys = [f"{prefix}-{i}" for i in range(total)]
        self.pool = ThreadPoolExecutor(threads) if threads > 1 else None

    def seconds(self, direction: str, jobs: range) -> float:
        """Seconds to ``batch_put_from`` (``"SET"``) or ``batch_get_into`` (``"GET"``) the
        objects of ``jobs`` (``depth`` each)."""
        call = self.store.batch_put_from if direction == "SET" else self.store.batch_get_into
        size, depth = self.size, self.depth

        def job(j: int) -> list[int]:
            first = j * depth
            ptrs = [self.base + ((first + i) % self.slots) * size for i in range(depth)]
            return call(self.keys[first : first + depth], ptrs, [size] * depth)

        start = time.perf_counter()
        codes = list(self.pool.map(job, jobs)) if self.pool else [job(j) for j in jobs]
        seconds = time.perf_counter() - start
        want = 0 if direction == "SET" else size
        bad = [c for cs in codes for c in cs if c != want]
        if bad:
            raise RuntimeError(f"Mooncake {direction}: {len(bad)} calls returned {bad[0]} (wanted {want})")
        return seconds

    def close(self) -> None:
        if self.pool:
            self.pool.shutdown()
        self.store.unregister_buffer(self.base)
        if self.own:
            self.store.close()


class TierRun:
    """``MooncakeWorker`` over a ``HostBlockPool`` of its own: blocks from key ``base`` on,
    jobs of ``depth`` blocks (one batch each), ``threads`` I/O threads, 2x that in flight."""

    def __init__(self, servers: MooncakeServers, size: int, depth: int, threads: int, base: int, split=False):
        self.blocks = max(depth * threads * 2, 64)
        self.depth, self.threads, self.base = depth, threads, base
        store = tier_store(servers, "bench transfers")
        names = KeyNames("bench", f"size{size}")
        pool = tier_pool(size, self.blocks, split)
        self.worker = MooncakeWorker(pool, store, names, io_threads=threads, batch_blocks=depth)
        self.job_ids = itertools.count()

    def seconds(self, direction: str, jobs: range) -> float:
        """Seconds to store (``"SET"``) or load (``"GET"``) the blocks of ``jobs``."""
        depth, worker = self.depth, self.worker
        start = time.perf_counter()
        in_flight: list[int] = []
        for j in jobs:
            first = self.base + j * depth
            keys = [make_offload_key((first + i).to_bytes(32, "big"), 0) for i in range(depth)]
            host = CPULoadStoreSpec([(j * depth + i) % self.blocks for i in range(depth)])
            remote = MooncakeLoadStoreSpec(keys)
            job = next(self.job_ids)
            worker.submit(job, *((host, remote) if direction == "SET" else (remote, host)))
            in_flight.append(job)
            if len(in_flight) >= self.threads * 2:
                worker.wait(in_flight[: self.threads])
                in_flight = in_flight[self.threads :]
        worker.wait(in_flight)
        seconds = time.perf_counter() - start
        failed = [r.error for r in worker.poll() if not r.success]
        if failed:
            raise RuntimeError(f"{len(failed)} Mooncake tier {direction} jobs failed: {failed[0]}")
        return seconds

    def close(self) -> None:
        self.worker.close()


def slices(jobs: int, count: int) -> list[range]:
    """``range(jobs)`` cut into ``count`` (at most ``jobs``) consecutive, near-equal slices."""
    count = max(1, min(count, jobs))
    bounds = [jobs * k // count for k in range(count + 1)]
    return [range(bounds[k], bounds[k + 1]) for k in range(count)]


def repetition(store, servers, port: int, size: int, args, total: int, rep: int) -> dict[str, float]:
    """One repetition (see the module's docstring); bytes/s by ``"<SET|GET> <contender>"``."""
    store.remove_all(True)
    connect(ServerSettings(f"redis://127.0.0.1:{port}/0")).flushall()
    base, obj = (rep << 32) + (size << 8), value_bytes(size)
    batches = BatchRun(store, obj, args.depth, args.threads, total, f"bench-{size}-{rep}")
    if args.self_check:
        tier = BatchRun(
            raw_client(servers), obj, args.depth, args.threads, total, f"aa-{size}-{rep}", own=True
        )
    else:
        tier = TierRun(servers, size, args.depth, args.threads, base, args.split)
    redis = WorkerRun(port, size, args.depth, args.threads, total, base)
    rates: dict[str, float] = {}

    def mooncake_pair(op: str) -> None:
        spent = {"mooncake batches": 0.0, "mooncake tier": 0.0}
        for k, jobs in enumerate(slices(total // args.depth, args.slices)):
            turn = (("mooncake batches", batches), ("mooncake tier", tier))
            for who, run in turn if (k + rep) % 2 == 0 else reversed(turn):
                spent[who] += run.seconds(op, jobs)
        rates[f"{op} mooncake batches"] = total * obj / spent["mooncake batches"]
        rates[f"{op} mooncake tier"] = total * size / spent["mooncake tier"]

    def redis_pair(op: str) -> None:
        for who in ("redis tier", "redis-benchmark")[:: 1 if rep % 2 == 0 else -1]:
            if who == "redis tier":
                rates[f"{op} {who}"] = redis.rate(op)
            else:
                rates[f"{op} {who}"] = redis_benchmark(port, obj, args.depth, args.threads, total, op)

    try:
        for op in ("SET", "GET"):
            for pair in (mooncake_pair, redis_pair)[:: 1 if rep % 2 == 0 else -1]:
                pair(op)
    finally:
        for run in (batches, tier, redis):
            run.close()
    return rates


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def throughput(args, servers: MooncakeServers, port: int) -> None:
    store = raw_client(servers)
    print(
        "| block | direction | Mooncake batches GB/s | Mooncake tier GB/s | **tier / batches** "
        "| redis-benchmark GB/s | Redis tier GB/s | tier / redis-benchmark | Mooncake tier / Redis tier |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")  # fmt: skip
    for size in map(int, args.sizes.split(",")):
        total = max(args.depth * args.threads, (args.mib << 20) // size) // args.depth * args.depth
        reps = [repetition(store, servers, port, size, args, total, r) for r in range(args.reps)]
        for op, label in (("SET", "store"), ("GET", "load")):
            mb, mt, rt, rb = (f"{op} {c}" for c in ("mooncake batches", "mooncake tier", "redis tier",
                                                   "redis-benchmark"))  # fmt: skip
            gbs = {key: "/".join(f"{r[key] / 1e9:.2f}" for r in reps) for key in (mb, mt, rt, rb)}
            ratio = {
                (a, b): f"{median([r[a] / r[b] for r in reps]):.2f}"
                for a, b in ((mt, mb), (rt, rb), (mt, rt))
            }
            print(f"| {size >> 10} KiB | {label} | {gbs[mb]} | {gbs[mt]} | **{ratio[mt, mb]}** | {gbs[rb]} "
                  f"| {gbs[rt]} | {ratio[rt, rb]} | {ratio[mt, rt]} |")  # fmt: skip
    store.remove_all(True)
    store.close()


def mooncake_lookup_costs(servers: MooncakeServers, n: int = 20000) -> dict[str, float]:
    """``bench_redis.lookup_costs`` for ``MooncakeOffloadingManager``, ns per lookup, in
    the same order; kills the master."""
    lookups = MooncakeLookups(
        tier_store(servers, "bench lookups", connect_timeout=0.5), KeyNames("bench", "l")
    )
    manager = MooncakeOffloadingManager(lookups, 2 * n, probe_timeout=5.0)
    cpu = CPUOffloadingManager(n)
    keys = [make_offload_key(i.to_bytes(32, "big"), 0) for i in range(4 * n)]

    def per_lookup(fn, ks) -> float:
        start = time.perf_counter()
        for key in ks:
            fn(key)
        return (time.perf_counter() - start) / len(ks) * 1e9

    costs = {"CPU tier miss (baseline)": per_lookup(cpu.lookup, keys[:n])}
    costs["unknown key: probe queued (RETRY)"] = per_lookup(manager.lookup, keys[:n])
    out = manager.prepare_store(keys[n : 2 * n])
    manager.complete_store(out.keys_to_store)
    costs["indexed key (HIT)"] = per_lookup(manager.lookup, keys[n : 2 * n])
    servers.kill_master()
    deadline = time.monotonic() + 60
    while not lookups.down:  # the next probe finds it dead
        if time.monotonic() > deadline:
            raise RuntimeError("the Mooncake tier did not notice its master's death within 60 s")
        manager.lookup(keys[2 * n + int(time.monotonic() * 1000) % n])
        time.sleep(0.01)
    costs["master / server down: unknown key (MISS)"] = per_lookup(manager.lookup, keys[3 * n :])
    manager.close()
    return costs


def engine_ttft(args, servers: MooncakeServers, port: int, model: str, folder: str) -> None:
    """A shared-tier hit per tier, in turns. Three engine processes (``_tier_engines``): a
    writer with both tiers below its CPU tier, and one reader per tier. Per round a new
    prompt: the writer computes it (its TTFT: recomputation) and writes its blocks through
    to Mooncake and to Redis; then each reader, which has never seen it, serves it from its
    own tier (the readers' order swapped every round). A reader's TTFT includes the probe
    that finds another engine's blocks, their promotion into its CPU tier and the load.
    Outputs must equal the writer's. ``--self-check``: both readers on Redis (A/A)."""
    redis = {"type": "redis", "url": f"redis://127.0.0.1:{port}/0"}
    mooncake = redis if args.self_check else tier_config(servers)
    roles = {"writer": [mooncake, redis][args.self_check :], "mooncake": [mooncake], "redis": [redis]}
    engines: dict[str, Engine] = {}
    times: dict[str, list[float]] = {who: [] for who in roles}
    cached: dict[str, list[int]] = {who: [] for who in roles}
    try:
        for who, tiers in roles.items():
            engines[who] = Engine(tiers, model, os.path.join(folder, f"engine-{who}.log"))
        for i, engine in enumerate(engines.values()):  # warm-up, on prompts of their own
            engine.run(100 + i, args.tokens)
        for r in range(args.rounds):
            ttft, _, expected = engines["writer"].run(2000 + r, args.tokens)
            times["writer"].append(ttft * 1e3)
            for who in ("mooncake", "redis")[:: 1 if r % 2 == 0 else -1]:
                ttft, hit, tokens = engines[who].run(2000 + r, args.tokens)
                if hit == 0 or tokens != expected:
                    why = f"round {r}: the {who} reader had {hit} tokens cached, output {tokens}"
                    raise RuntimeError(f"{why} against the writer's {expected}")
                times[who].append(ttft * 1e3)
                cached[who].append(hit)
    finally:
        for engine in engines.values():
            engine.close()
    print(f"prompt {args.tokens} tokens, tiny Llama (4 layers, hidden 256, float32), {args.rounds} rounds")
    print()
    print("| engine | TTFT ms per round | median | tokens cached |")
    print("|---|---|---:|---|")
    first = (
        "reader: Redis hit (A/A: in the Mooncake reader's place)"
        if args.self_check
        else "reader: Mooncake hit"
    )
    for who, label in (("writer", "writer: recompute"), ("mooncake", first), ("redis", "reader: Redis hit")):
        per_round = " / ".join(f"{t:.1f}" for t in times[who])
        hits = "/".join(map(str, cached[who])) or "-"
        print(f"| {label} | {per_round} | {statistics.median(times[who]):.1f} | {hits} |")
    ratios = [m / r for m, r in zip(times["mooncake"], times["redis"])]
    print(f"\nMooncake hit / Redis hit TTFT, median of the per-round ratios: **{median(ratios):.2f}** "
          f"({' / '.join(f'{x:.2f}' for x in ratios)}); target <= 1")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--mib", type=int, default=256, help="bytes each contender moves per direction and size"
    )
    parser.add_argument("--sizes", default="65536,262144,2097152", help="block (payload) sizes")
    parser.add_argument("--depth", type=int, default=16, help="blocks per job = per batch = pipeline depth")
    parser.add_argument("--threads", type=int, default=1, help="I/O threads = calls in flight = clients")
    parser.add_argument("--reps", type=int, default=3, help="repetitions per size")
    parser.add_argument("--slices", type=int, default=8, help="turns the Mooncake pair takes per direction")
    parser.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True,
                        help="servers alone on the last core, this process on the others")  # fmt: skip
    parser.add_argument("--self-check", action="store_true", help="an A/A run: the noise floor")
    parser.add_argument("--split", action="store_true",
                        help="the tier over a pool without a row prefix (objects: two buffers)")  # fmt: skip
    parser.add_argument("--engine", action="store_true", help="TTFT of a shared-tier hit on vLLM engines")
    parser.add_argument("--rounds", type=int, default=7, help="--engine: rounds (prompts)")
    parser.add_argument("--tokens", type=int, default=2000, help="--engine: prompt length")
    parser.add_argument("--model-dir", default=".cache/tiny-llama", help="--engine: the tiny model's folder")
    args = parser.parse_args()
    folder = tempfile.mkdtemp(prefix="kvo-bench-mooncake-")
    server_cores, client_cores, where = placement(args.pin and not args.engine)
    if client_cores is not None:
        pin_this_process(client_cores)
    segment = (3 * args.mib if not args.engine else 1024) << 20
    servers = MooncakeServers(folder, segment, server_cores)
    port = free_port()
    redis = start_server(folder, port, server_cores)
    failed = True
    try:
        servers.start()
        if args.engine:
            from kvoffload.demo.tiny_model import build_tiny_llama

            engine_ttft(args, servers, port, str(build_tiny_llama(args.model_dir)), folder)
        else:
            print(f"mooncake_master {servers.master_address}, a {segment >> 20} MiB segment holder (TCP), "
                  f"redis-server :{port}; depth {args.depth}, {args.threads} thread(s), {args.slices} "
                  f"slices; {where.replace('redis-server', 'the servers')}")  # fmt: skip
            throughput(args, servers, port)
            print()
            print("| lookup on the scheduler thread | Mooncake tier ns | Redis tier ns |")
            print("|---|---:|---:|")
            ours, theirs = mooncake_lookup_costs(servers), lookup_costs(port, redis)
            for (label, a), b in zip(ours.items(), theirs.values()):
                print(f"| {label} | {a:.0f} | {b:.0f} |")
        failed = False
    finally:
        if redis.poll() is None:
            redis.terminate()
            redis.wait()
        servers.stop()
        if failed:
            print(f"logs kept in {folder}", file=sys.stderr)
        else:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
