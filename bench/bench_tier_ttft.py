"""Time to first token on a real vLLM engine (CPU build) for a ~2,000-token prompt served
from a tier below the CPU tier — the local disk (``fs``) and the shared Redis tier —
against recomputation, in the same run on the same engine.

One engine per tier, each with a CPU tier of 140 offloaded blocks (a 2,000-token prompt
is 62: room for one prompt while another's write-through pins its CPU copy). Per round, a
fresh prompt P: (a) P computed (stored to the CPU tier, written through below); two
filler prompts of the same length push P out of the CPU tier (see the comment in
``run_tier``); the engine's own prefix cache is reset; (b) P again: its prefix comes from
the tier below (promoted into the CPU tier, then loaded). Rounds interleave (a) and (b)
so load drifts hit both. The Redis server is started here on loopback (no persistence)
and stopped by its PID. (b) includes the promotion's extra scheduler step(s); for the
shared tier the blocks are this engine's own (known to its index: no probe round trip).

    .venv/bin/python bench/bench_tier_ttft.py [--rounds N] [--tokens N] [--model-dir DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import tempfile

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench_redis import free_port, start_server  # noqa: E402 - a sibling script, after the settings


def start_redis(folder: str) -> tuple[subprocess.Popen, int]:
    port = free_port()
    return start_server(folder, port), port


def run_tier(model: str, tier: dict, rounds: int, tokens: int) -> dict[str, list[float]]:
    from vllm import SamplingParams

    from kvoffload.demo.offline import close_llm, kv_block_bytes, make_llm, settle, word_text

    block = kv_block_bytes(model)
    llm = make_llm(model, kvoffload={"cpu_bytes_to_use": 140 * block, "secondary_tiers": [tier]})
    params = SamplingParams(temperature=0, max_tokens=1)
    times: dict[str, list[float]] = {"recompute": [], "from the tier": [], "tokens cached": []}

    def ttft(text: str) -> tuple[float, int]:
        out = llm.generate([text], params, use_tqdm=False)[0]
        return out.metrics.first_token_latency, out.num_cached_tokens

    try:
        ttft("warm up " * 100)
        for _ in range(3):
            settle(llm)
        for r in range(rounds):
            text = word_text(2000 + r, tokens)
            seconds, _ = ttft(text)
            times["recompute"].append(seconds)
            for _ in range(3):  # P's write-through done: its CPU copies unpinned, evictable
                settle(llm)
            # Two fillers: the first one's steps hand out P's write-through (an idle engine
            # runs no scheduler step, so tier transfers wait for the next request), the
            # second one's store evicts P from the CPU tier once that copy is done.
            for filler in (5000, 6000):
                ttft(word_text(filler + r, tokens))
                for _ in range(3):
                    settle(llm)
            if not llm.reset_prefix_cache():
                raise RuntimeError("the engine's prefix cache could not be reset")
            seconds, hit = ttft(text)
            if hit == 0:
                raise RuntimeError(f"round {r}: nothing came from the {tier['type']} tier")
            times["from the tier"].append(seconds)
            times["tokens cached"].append(hit)
    finally:
        close_llm(llm)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--model-dir", default=".cache/tiny-llama")
    args = parser.parse_args()

    from kvoffload.demo.offline import kv_block_bytes
    from kvoffload.demo.tiny_model import build_tiny_llama

    model = str(build_tiny_llama(args.model_dir))
    folder = tempfile.mkdtemp(prefix="kvo-bench-tier-ttft-")
    proc, port = start_redis(folder)
    results = {}
    try:
        block = kv_block_bytes(model)
        fs = {"type": "fs", "root_dir": os.path.join(folder, "disk"), "bytes_to_use": 400 * (block + 4096)}
        results["fs (local disk)"] = run_tier(model, fs, args.rounds, args.tokens)
        redis = {"type": "redis", "url": f"redis://127.0.0.1:{port}/0"}
        results["redis (shared)"] = run_tier(model, redis, args.rounds, args.tokens)
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait()
        shutil.rmtree(folder, ignore_errors=True)
    print(f"prompt {args.tokens} tokens, tiny Llama (4 layers, hidden 256, float32), {args.rounds} rounds")
    print()
    print("| tier | recompute TTFT ms (median) | tier-hit TTFT ms (median) | ratio | tokens cached |")
    print("|---|---:|---:|---:|---:|")
    for name, times in results.items():
        a = statistics.median(times["recompute"]) * 1e3
        b = statistics.median(times["from the tier"]) * 1e3
        cached = "/".join(str(int(n)) for n in times["tokens cached"])
        print(f"| {name} | {a:.1f} | {b:.1f} | {b / a:.2f} | {cached} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
