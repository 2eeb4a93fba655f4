"""Time to first token on a real vLLM engine (CPU build) for a ~2,000-token prompt served
(a) by recomputation, (b) from the engine's own prefix cache, (c) from kvoffload's CPU
tier — one engine with kvoffload, one run, rounds interleaved so load drifts hit all three.

Each round uses a fresh prompt: (a) first request, (b) the same prompt again, then
``reset_prefix_cache()`` drops the engine's copy and (c) serves it from the CPU tier.

    .venv/bin/python bench/bench_engine.py [--rounds N] [--tokens N] [--model-dir DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--model-dir", default=".cache/tiny-llama")
    args = parser.parse_args()

    from vllm import SamplingParams

    from kvoffload.demo.offline import close_llm, make_llm, word_text
    from kvoffload.demo.tiny_model import build_tiny_llama

    model = str(build_tiny_llama(args.model_dir))
    llm = make_llm(model, kvoffload={"cpu_bytes_to_use": 512 << 20})
    params = SamplingParams(temperature=0, max_tokens=1)

    def ttft(text: str) -> tuple[float, int]:
        out = llm.generate([text], params, use_tqdm=False)[0]
        return out.metrics.first_token_latency, out.num_cached_tokens

    times: dict[str, list[float]] = {"recompute": [], "engine cache": [], "kvoffload CPU": []}
    cached: dict[str, int] = {}
    try:
        ttft("warm up " * 100)
        for r in range(args.rounds):
            text = word_text(1000 + r, args.tokens)
            for name in times:
                if name == "kvoffload CPU":
                    llm.reset_prefix_cache()
                seconds, hit = ttft(text)
                times[name].append(seconds)
                cached[name] = hit
    finally:
        close_llm(llm)

    a = statistics.median(times["recompute"])
    b = statistics.median(times["engine cache"])
    print(f"prompt {args.tokens} tokens, tiny Llama (4 layers, hidden 256, float32), {args.rounds} rounds")
    print()
    print("| served by | cached tokens | median TTFT (ms) | min (ms) | max (ms) |")
    print("|---|---:|---:|---:|---:|")
    for name, values in times.items():
        print(
            f"| {name} | {cached[name]} | {statistics.median(values) * 1e3:.1f} | "
            f"{min(values) * 1e3:.1f} | {max(values) * 1e3:.1f} |"
        )
    c = statistics.median(times["kvoffload CPU"])
    print()
    print(f"(c)/(a) = {c / a:.3f} (target <= 0.2); (c)/(b) = {c / b:.2f} (target <= 1.5)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
