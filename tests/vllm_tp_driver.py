"""Tensor parallelism (TP=2) end to end on vLLM's CPU build, in a process of its own
(``tests/integrations/vllm/test_vllm_tp.py`` runs it): vLLM's multiprocessing executor needs this module's
``__main__`` guard and ``VLLM_ENABLE_V1_MULTIPROCESSING=1``.

``python vllm_tp_driver.py MODEL ROOT_DIR REDIS_URL`` runs two engines one after the
other and prints ``OK <phase>`` after each phase whose checks passed:

* ``reload``: TP=2 with CPU (room for 35 blocks over both workers), disk and Redis tiers:
  each prompt's first output, computed with nothing to load, is the one every later run
  must match (an engine without kvoffload gives the same outputs: the single-process
  engine tests check that, and a third TP engine start cost this test 40 s); after a
  prefix-cache reset the first prompt's 992 tokens are reloaded; blocks are announced
  once (not once per rank); the worker-side byte counters are the sum of both ranks'
  shares;
* ``partial``: rank 1 loses its share of the second prompt on disk (its header records
  cut off) and of that prompt's last 10 blocks on Redis (its keys deleted); a fresh
  engine's disk tier holds the first prompt's blocks only, the first prompt is served from
  disk with both ranks' files, the second from Redis up to its first block with a share
  missing, and no load or promotion of a block one rank lacks is tried.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

PROMPT = 1000  # tokens
N = PROMPT // 32  # its full blocks of 32 tokens
OFFLOADED = N * 32
KEPT = 21  # of the second prompt's blocks, those whose every share stays on Redis
CPU_BLOCKS = 35  # the CPU tier's room over both ranks: the second prompt evicts most of the first
TP = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}


def metrics(llm) -> dict[tuple, float]:
    """vLLM's metrics of the engine, ``(name, *label values but vLLM's own)`` -> value."""
    out = {}
    for m in llm.get_metrics():
        labels = tuple(v for k, v in sorted(m.labels.items()) if k not in ("model_name", "engine"))
        out[(m.name, *labels)] = getattr(m, "value", None)
    return out


def quiesce(llm, generate, blocks: dict[str, int], timeout: float = 60.0) -> dict[tuple, float]:
    """Step the engine (a one-token request: no full block) until no transfer is in flight
    and each tier in ``blocks`` (label -> count) holds that many idle blocks."""
    deadline = time.monotonic() + timeout
    while True:
        generate(llm, "hi", max_tokens=1)
        seen = metrics(llm)
        moving = sum(v for k, v in seen.items() if k[0] == "vllm:kvoffload_transfer_jobs_in_flight")
        held = {tier: seen.get(("vllm:kvoffload_blocks", "idle", tier)) for tier in blocks}
        if moving == 0 and held == blocks:
            return seen
        if time.monotonic() > deadline:
            state = {k: v for k, v in seen.items() if "kvoffload_blocks" in k[0] or "scheduler" in k[0]}
            raise AssertionError(f"{moving} transfers in flight, idle blocks {held} != {blocks}: {state}")
        time.sleep(0.2)


def stored_hashes(events, medium: str, where: str | None) -> list:
    """The block hashes of ``BlockStored`` events of a tier (its medium and locality), in order."""
    return [
        h
        for e in events
        if type(e).__name__ == "BlockStored" and (e.medium, getattr(e, "locality", None)) == (medium, where)
        for h in e.block_hashes
    ]


def main(model: str, root: str, redis_url: str) -> None:
    import redis

    from kvoffload.demo.offline import close_llm, greedy, kv_block_bytes, make_llm, word_text
    from kvoffload.tiers.fs.format import HEADER_FILE, RECORD_BYTES, parse_record
    from kvoffload.tiers.redis.format import KeyNames, redis_namespace
    from vllm_events_sink import Subscriber

    block = kv_block_bytes(model)  # one block over both ranks; each holds half
    first, second = word_text(41, PROMPT), word_text(42, PROMPT)
    fs = {"type": "fs", "root_dir": root, "bytes_to_use": 2 * 300 * (block // 2 + 8192)}
    # two workers and their OpenMP threads on two cores: a Redis call may wait its turn
    shared = {"type": "redis", "url": redis_url, "timeout_s": 20.0}
    extra = {"cpu_bytes_to_use": CPU_BLOCKS * block, "secondary_tiers": [fs, shared]}

    expected = {}
    sub = Subscriber()
    llm = make_llm(model, kvoffload=extra, events_endpoint=f"tcp://127.0.0.1:{sub.port}", **TP)
    try:
        expected[first], hit = greedy(llm, first)
        assert hit == 0, hit
        # its write-through ended: the second prompt's stores can evict it from the CPU tier
        quiesce(llm, greedy, {"0:primary": N, "1:fs": N, "2:redis": N})
        expected[second], hit = greedy(llm, second)
        assert hit == 0, hit
        seen = quiesce(llm, greedy, {"0:primary": CPU_BLOCKS, "1:fs": 2 * N, "2:redis": 2 * N})
        assert seen[("vllm:kvoffload_capacity_blocks", "0:primary")] == CPU_BLOCKS  # over both ranks
        stored = seen[("vllm:kvoffload_scheduler_blocks_stored",)]
        assert stored == 2 * N, stored
        # every rank's share counted once: the bytes of whole blocks, the jobs of both ranks
        assert seen[("vllm:kv_offload_store_bytes",)] == stored * block
        assert seen[("vllm:kvoffload_transfer_blocks", "store", "0:primary")] == 2 * stored
        assert llm.reset_prefix_cache()
        assert greedy(llm, first) == (expected[first], OFFLOADED)
        seen = quiesce(llm, greedy, {"1:fs": 2 * N, "2:redis": 2 * N})
        loaded = seen[("vllm:kvoffload_scheduler_blocks_loaded",)]
        assert loaded == N and seen[("vllm:kv_offload_load_bytes",)] == loaded * block
        assert seen.get(("vllm:kvoffload_scheduler_failed_loads",), 0) == 0
        time.sleep(1)  # the last event batches
        cpu, disk = stored_hashes(sub.events, "CPU", None), stored_hashes(sub.events, "STORAGE", "LOCAL")
        evicted = 2 * N - CPU_BLOCKS  # of the first prompt's, promoted back for the reload
        assert len(cpu) >= 2 * N + evicted and len(set(cpu[: 2 * N])) == 2 * N, len(cpu)
        assert len(disk) == len(set(disk)) == 2 * N, (len(disk), len(set(disk)))
    finally:
        close_llm(llm)
        sub.close()
    print("OK reload", flush=True)

    # Rank 1 loses shares of the second prompt: on disk all (its header records past the
    # first prompt's slots), on Redis its last blocks' (their keys).
    identities = {d: json.loads(Path(root, d, "namespace.json").read_text()) for d in os.listdir(root)}
    ((rank1, identity),) = [(d, identity) for d, identity in identities.items() if identity["rank"] == 1]
    headers = Path(root, rank1, HEADER_FILE)
    raw = headers.read_bytes()
    second_keys = [parse_record(raw[s * RECORD_BYTES :]).key for s in range(N, 2 * N)]  # its slots
    os.truncate(headers, N * RECORD_BYTES)
    identity.pop("format_version")  # the disk tier's own, not part of the blocks' identity
    names = KeyNames("kvoffload", redis_namespace(identity))
    assert redis.Redis.from_url(redis_url).delete(*names.names(second_keys[KEPT:])) == N - KEPT

    llm = make_llm(model, kvoffload=extra, **TP)
    try:
        quiesce(llm, greedy, {"1:fs": N})  # the blocks both ranks hold on disk, and no others
        assert greedy(llm, first) == (expected[first], OFFLOADED)  # from disk: both ranks' files
        # from Redis up to the first block whose rank-1 key is gone
        assert greedy(llm, second) == (expected[second], KEPT * 32)
        seen = quiesce(llm, greedy, {})
        assert seen[("vllm:kvoffload_hit_tokens", "1:fs")] == OFFLOADED
        assert seen[("vllm:kvoffload_hit_tokens", "2:redis")] == KEPT * 32
        # nothing was tried that one rank lacks
        assert seen.get(("vllm:kvoffload_scheduler_failed_loads",), 0) == 0
        assert seen.get(("vllm:kvoffload_scheduler_failed_tier_transfers",), 0) == 0
    finally:
        close_llm(llm)
    print("OK partial", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:4])
