"""The object-storage tier against its client's own raw puts and gets, same server, same run.

Run: .venv/bin/python bench/bench_s3.py [--mib 64] [--sizes 65536,262144,2097152]
     [--concurrency 8] [--depth 16] [--reps 3] [--joined]
     .venv/bin/python bench/bench_s3.py --engine [--rounds 5] [--tokens 2000]

Throughput (the default mode). One SeaweedFS ``weed mini`` (``tests/s3_server.py``: loopback
ports, a fresh data folder, stopped by its PID) serves every measurement of one run. Per
block size and repetition, each direction is measured for two contenders, one right after
the other (who goes first alternating every repetition), into the same bucket:

1. **obstore's own calls**, the baseline: ``put`` with ``mode="create"`` (``If-None-Match:
   *``, as the tier) of new objects of the tier's object size (header, key, payload) from
   slices of one numpy buffer, then ``get(...).bytes()`` of those objects, ``--concurrency``
   calls at once on as many threads;
2. **kvoffload's object tier** (``S3Worker``, ``--concurrency`` requests in flight): store
   jobs of ``--depth`` blocks from a real ``HostBlockPool`` (32 layers, interleaved, with
   the row prefix an engine's pool has beside an object tier, so each object is put from
   the pool as one buffer; ``--joined``: without it, header and rows joined first), all
   jobs submitted at once, then load jobs of the same blocks into other host blocks
   (each object checked, its payload copied into the rows).

Both count the bytes of their objects' payload; the baseline's MB/s is printed beside the
tier's, with the ratio (median over repetitions of each repetition's ratio). Target: the
tier >= 0.8x of the baseline in both directions. This machine's speed changes by up to 2x
from one second to the next, so only neighbours compare.

``--engine``: time to first token on a real vLLM engine (CPU build, tiny Llama) of a
prompt served from the object tier against recompute and against a disk (``fs``) hit,
same run (``bench_tier_ttft.run_tier`` with each tier).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent / "tests"))  # the test suite's S3 server helper

from _mooncake_servers import tier_pool  # noqa: E402
from kvoffload.keys import make_offload_key  # noqa: E402
from kvoffload.specs import CPULoadStoreSpec  # noqa: E402
from kvoffload.tiers.redis.format import value_bytes  # noqa: E402
from kvoffload.tiers.s3.names import ObjectNames, S3LoadStoreSpec  # noqa: E402
from kvoffload.tiers.s3.store import ObjectStore, S3Settings  # noqa: E402
from kvoffload.tiers.s3.worker import S3Worker  # noqa: E402
from s3_server import S3Server  # noqa: E402


class Raw:
    """obstore's own conditional puts and gets of ``count`` objects of ``size`` bytes."""

    def __init__(self, server: S3Server, size: int, count: int, concurrency: int):
        self.client = server.client()
        self.size, self.count = size, count
        self.data = np.random.randint(0, 256, size * count, dtype=np.uint8)
        self.pool = ThreadPoolExecutor(concurrency)

    def seconds(self, op: str, tag: str) -> float:
        import obstore

        view = memoryview(self.data)
        names = [f"raw/{tag}/{i}" for i in range(self.count)]
        if op == "store":
            work = lambda i: obstore.put(self.client, names[i], view[i * self.size : (i + 1) * self.size],
                                         mode="create", use_multipart=False)  # fmt: skip
        else:
            work = lambda i: obstore.get(self.client, names[i]).bytes()
        start = time.perf_counter()
        list(self.pool.map(work, range(self.count)))
        return time.perf_counter() - start


class Tier:
    """``S3Worker`` jobs of ``depth`` blocks over a host pool of ``2 x count`` blocks."""

    def __init__(self, server: S3Server, block: int, count: int, depth: int, concurrency: int, joined: bool):
        key_env, secret_env = server.env_names()
        settings = S3Settings(
            server.endpoint, server.bucket, access_key_env=key_env, secret_key_env=secret_env
        )
        self.pool = tier_pool(block, 2 * count, joined)
        self.worker = S3Worker(self.pool, ObjectStore(settings, "bench"), ObjectNames("bench", "kvr-bench"),
                               concurrency=concurrency)  # fmt: skip
        self.count, self.depth, self.job = count, depth, 0

    def seconds(self, op: str, tag: str) -> float:
        keys = [make_offload_key(f"{tag}/{i}".encode().ljust(32, b"."), 0) for i in range(self.count)]
        jobs = []
        start = time.perf_counter()
        for first in range(0, self.count, self.depth):
            self.job += 1
            ks = keys[first : first + self.depth]
            ids = (
                range(first, first + len(ks))
                if op == "store"
                else range(self.count + first, self.count + first + len(ks))
            )
            host, remote = CPULoadStoreSpec(list(ids)), S3LoadStoreSpec(ks)
            self.worker.submit(self.job, *((host, remote) if op == "store" else (remote, host)))
            jobs.append(self.job)
        self.worker.wait(jobs, 600)
        seconds = time.perf_counter() - start
        failed = [r for r in self.worker.poll() if not r.success]
        if failed:
            raise RuntimeError(f"{len(failed)} {op} jobs failed: {failed[0].error}")
        return seconds

    def close(self) -> None:
        self.worker.close()


def throughput(args, server: S3Server) -> None:
    print("| block | direction | obstore MB/s (per rep) | tier MB/s (per rep) | tier / obstore (median) |")
    print("|---:|---|---|---|---:|")
    for size in (int(s) for s in args.sizes.split(",")):
        count = max(args.depth, (args.mib << 20) // size)
        raw = Raw(server, value_bytes(size), count, args.concurrency)
        tier = Tier(server, size, count, args.depth, args.concurrency, args.joined)
        rows = {op: {"raw": [], "tier": [], "ratio": []} for op in ("store", "load")}
        try:
            for rep in range(args.reps):
                tag = f"{size}-{rep}"
                for op in ("store", "load"):
                    order = ("raw", "tier") if (rep + (op == "load")) % 2 == 0 else ("tier", "raw")
                    took = {who: (raw if who == "raw" else tier).seconds(op, tag) for who in order}
                    mb = size * count / 1e6
                    rows[op]["raw"].append(mb / took["raw"])
                    rows[op]["tier"].append(mb / took["tier"])
                    rows[op]["ratio"].append(took["raw"] / took["tier"])
        finally:
            tier.close()
        for op, row in rows.items():
            each = lambda xs: " / ".join(f"{x:.0f}" for x in xs)  # noqa: E731
            print(f"| {size >> 10} KiB | {op} | {each(row['raw'])} | {each(row['tier'])} | "
                  f"{statistics.median(row['ratio']):.2f} |", flush=True)  # fmt: skip


def engine_ttft(args, server: S3Server, folder: str) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from bench_tier_ttft import run_tier
    from kvoffload.demo.offline import kv_block_bytes
    from kvoffload.demo.tiny_model import build_tiny_llama

    model = str(build_tiny_llama(args.model_dir))
    block = kv_block_bytes(model)
    tiers = {
        "fs (local disk)": {
            "type": "fs",
            "root_dir": os.path.join(folder, "disk"),
            "bytes_to_use": 400 * (block + 4096),
        },
        "s3 (object)": server.tier_config(),
    }
    print(f"prompt {args.tokens} tokens, tiny Llama, {args.rounds} rounds, chained path")
    print("| tier | recompute TTFT ms (median) | tier-hit TTFT ms (median) | / recompute | tokens cached |")
    print("|---|---:|---:|---:|---:|")
    for name, tier in tiers.items():
        times, _ = run_tier(model, tier, args.rounds, args.tokens, ["chained"])
        a, b = statistics.median(times["recompute"]) * 1e3, statistics.median(times["chained"]) * 1e3
        cached = "/".join(sorted({str(int(n)) for n in times["chained cached"]}))
        print(f"| {name} | {a:.1f} | {b:.1f} | {b / a:.2f} | {cached} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--mib", type=int, default=64, help="payload MiB per contender, direction and repetition"
    )
    parser.add_argument("--sizes", default="65536,262144,2097152")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--depth", type=int, default=16, help="blocks per tier job")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--joined", action="store_true", help="a pool without the row prefix")
    parser.add_argument("--engine", action="store_true")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--model-dir", default=".cache/tiny-llama")
    args = parser.parse_args()
    folder = tempfile.mkdtemp(prefix="kvo-bench-s3-")
    server = S3Server(folder).start()
    try:
        print(f"weed mini (SeaweedFS {server_version()}) at {server.endpoint}, {os.cpu_count()} cores, "
              f"concurrency {args.concurrency}, {args.depth} blocks per tier job, {args.reps} reps, "
              f"{'joined values' if args.joined else 'objects put from the pool'}")  # fmt: skip
        if args.engine:
            engine_ttft(args, server, folder)
        else:
            throughput(args, server)
    finally:
        server.stop()
        shutil.rmtree(folder, ignore_errors=True)


def server_version() -> str:
    import subprocess

    out = subprocess.run(
        [str(Path(sys.executable).parent / "weed"), "version"], capture_output=True, text=True
    )
    parts = out.stdout.split()
    return parts[2] if len(parts) > 2 else "?"


if __name__ == "__main__":
    main()
