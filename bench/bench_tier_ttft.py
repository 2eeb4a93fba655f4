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
and stopped by its PID. For the shared tier the blocks are this engine's own (known to
its index: no probe round trip).

Two paths for (b), alternating within each round on the same engine (each with its own
prompt): ``chained`` (the default: the load is planned in the step that plans the
promotion, and the worker starts it as the promotion's blocks arrive) and ``two-step``
(the scheduler's ``chain_promotions`` off: the promotion's outcome comes back first, the
load is planned in a later step). After each hit, the floors, same prompt: ``device
cache`` (straight again: all of it in vLLM's own prefix cache, nothing loaded) and ``CPU
tier`` (that cache reset: loaded from the CPU tier, nothing promoted). Printed per tier
and path: median TTFT, its ratio to the same run's recompute, the ratio chained /
two-step, the best round and its ratio, and the engine steps the hit took (median; a
step is one ``build_connector_meta``); then every round's TTFT and steps, in the order
run; then the timeline (``_ttft_timeline``): per tier and path (floors too) the median
over rounds of when each phase happened, ms from the request's arrival, and the median
round's every event.

    .venv/bin/python bench/bench_tier_ttft.py [--rounds N] [--tokens N] [--model-dir DIR]
        [--paths chained,two-step]
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


PATHS = ("chained", "two-step")
FLOORS = ("device cache", "CPU tier")  # the same prompt with nothing to promote / nothing to load


def run_tier(
    model: str, tier: dict, rounds: int, tokens: int, paths: list[str]
) -> tuple[dict[str, list[float]], dict[str, list[list]]]:
    from vllm import SamplingParams

    from _ttft_timeline import Timeline
    from kvoffload.demo.offline import (
        close_llm,
        kv_block_bytes,
        make_llm,
        scheduler_connector,
        settle,
        word_text,
    )

    block = kv_block_bytes(model)
    llm = make_llm(model, kvoffload={"cpu_bytes_to_use": 140 * block, "secondary_tiers": [tier]})
    params = SamplingParams(temperature=0, max_tokens=1)
    times: dict[str, list[float]] = {"recompute": [], FLOORS[0]: [], FLOORS[1]: []}
    for path in paths:
        times |= {path: [], f"{path} cached": [], f"{path} steps": []}
    traces: dict[str, list[list]] = {name: [] for name in (*paths, *FLOORS)}
    timeline = Timeline()
    timeline.attach(llm)
    side = scheduler_connector(llm)._scheduler
    steps = [0]
    build = side.build_connector_meta

    def counted(out):  # the engine's steps, for the steps a hit takes
        steps[0] += 1
        return build(out)

    side.build_connector_meta = counted

    def ttft(text: str, trace: str | None = None) -> tuple[float, int]:
        if trace is not None:
            timeline.begin()
        out = llm.generate([text], params, use_tqdm=False)[0]
        if trace is not None:
            traces[trace].append(timeline.end())
        return out.metrics.first_token_latency, out.num_cached_tokens

    try:
        ttft("warm up " * 100)
        for _ in range(3):
            settle(llm)
        for r in range(rounds):
            # alternate which path goes first, so drifts within a round hit both
            for path in paths if r % 2 == 0 else paths[::-1]:
                seed = len(paths) * r + paths.index(path)
                text = word_text(2000 + seed, tokens)
                seconds, _ = ttft(text)
                times["recompute"].append(seconds)
                for _ in range(3):  # P's write-through done: its CPU copies unpinned, evictable
                    settle(llm)
                # Two fillers: the first one's steps hand out P's write-through (an idle
                # engine runs no scheduler step, so tier transfers wait for the next
                # request), the second one's store evicts P from the CPU tier once that
                # copy is done.
                for filler in (5000, 6000):
                    ttft(word_text(filler + seed, tokens))
                    for _ in range(3):
                        settle(llm)
                if not llm.reset_prefix_cache():
                    raise RuntimeError("the engine's prefix cache could not be reset")
                side.scheduler.chain_promotions = path == "chained"
                steps[0] = 0
                seconds, hit = ttft(text, path)
                if hit == 0:
                    raise RuntimeError(f"round {r}: nothing came from the {tier['type']} tier")
                times[path].append(seconds)
                times[f"{path} cached"].append(hit)
                times[f"{path} steps"].append(steps[0])
                side.scheduler.chain_promotions = True
                # The floors, same prompt: in the engine's own prefix cache (nothing
                # loaded), then, that cache reset, in the CPU tier (no promotion).
                times[FLOORS[0]].append(ttft(text, FLOORS[0])[0])
                for _ in range(2):
                    settle(llm)
                if not llm.reset_prefix_cache():
                    raise RuntimeError("the engine's prefix cache could not be reset")
                seconds, hit = ttft(text, FLOORS[1])
                if hit == 0:
                    raise RuntimeError(f"round {r}: nothing came from the CPU tier")
                times[FLOORS[1]].append(seconds)
                for _ in range(2):
                    settle(llm)
    finally:
        close_llm(llm)
    return times, traces


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--model-dir", default=".cache/tiny-llama")
    parser.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated, of {PATHS}")
    args = parser.parse_args()
    paths = args.paths.split(",")
    if not paths or any(path not in PATHS for path in paths) or len(set(paths)) != len(paths):
        parser.error(f"--paths must name some of {PATHS} once each, got {args.paths!r}")

    from kvoffload.demo.offline import kv_block_bytes
    from kvoffload.demo.tiny_model import build_tiny_llama

    model = str(build_tiny_llama(args.model_dir))
    folder = tempfile.mkdtemp(prefix="kvo-bench-tier-ttft-")
    proc, port = start_redis(folder)
    results, traces = {}, {}
    try:
        block = kv_block_bytes(model)
        fs = {"type": "fs", "root_dir": os.path.join(folder, "disk"), "bytes_to_use": 400 * (block + 4096)}
        results["fs (local disk)"], traces["fs (local disk)"] = run_tier(
            model, fs, args.rounds, args.tokens, paths
        )
        redis = {"type": "redis", "url": f"redis://127.0.0.1:{port}/0"}
        results["redis (shared)"], traces["redis (shared)"] = run_tier(
            model, redis, args.rounds, args.tokens, paths
        )
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait()
        shutil.rmtree(folder, ignore_errors=True)
    print(f"prompt {args.tokens} tokens, tiny Llama (4 layers, hidden 256, float32), {args.rounds} rounds")
    print()
    print("| tier | path | recompute TTFT ms (median) | tier-hit TTFT ms (median) | / recompute | / two-step "
          "| tier-hit ms (best) | best / two-step | steps (median) | tokens cached |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, times in results.items():
        a = statistics.median(times["recompute"]) * 1e3
        base = statistics.median(times["two-step"]) * 1e3 if "two-step" in times else None
        best_base = min(times["two-step"]) * 1e3 if "two-step" in times else None
        for path in paths:
            b = statistics.median(times[path]) * 1e3
            best = min(times[path]) * 1e3
            versus = f"{b / base:.2f}" if base else "-"
            best_versus = f"{best / best_base:.2f}" if best_base else "-"
            cached = "/".join(sorted({str(int(n)) for n in times[f"{path} cached"]}))
            step_count = statistics.median(times[f"{path} steps"])
            row = f"| {name} | {path} | {a:.1f} | {b:.1f} | {b / a:.2f} | {versus} | {best:.1f}"
            print(f"{row} | {best_versus} | {step_count:g} | {cached} |")
    print()
    for name, times in results.items():  # every round, in the order run
        for path in paths:
            each = " ".join(f"{t * 1e3:.1f}" for t in times[path])
            print(f"{name}, {path}: {each} ms; steps {' '.join(str(n) for n in times[f'{path} steps'])}")
        for floor in FLOORS:
            print(f"{name}, {floor}: {' '.join(f'{t * 1e3:.1f}' for t in times[floor])} ms")
    print_timelines(results, traces, paths)
    return 0


def print_timelines(results: dict, traces: dict, paths: list[str]) -> None:
    """Per tier and path (and the floors): the median, over rounds, of when each phase
    happened (ms from the request's arrival), then the median round's whole timeline."""
    from _ttft_timeline import phases, timeline_text

    print()
    print("Timeline, ms from the request's arrival (median over rounds of each mark; '-': not on this path):")
    print()
    columns = [
        "first match", "first match end", "first start_load_kv", "promotion submitted", "promotion started",
        "promotion finished", "load submitted", "load copy", "load finished",
        "last start_load_kv end", "last execute end", "outputs", "steps", "load copies",
    ]  # fmt: skip
    print("| tier | path | TTFT | " + " | ".join(columns) + " |")
    print("|---|---|---:|" + "---:|" * len(columns))
    for name, times in results.items():
        for path in (*paths, *FLOORS):
            marks = [phases(events) for events in traces[name][path]]
            cells = []
            for column in columns:
                values = [m[column] for m in marks if column in m]
                cells.append(
                    f"{statistics.median(values):.2f}" if len(values) == len(marks) and values else "-"
                )
            ttft = statistics.median(times[path]) * 1e3
            print(f"| {name} | {path} | {ttft:.2f} | " + " | ".join(cells) + " |")
    print()
    print("KV in place, ms (arrival to the end of the last start_load_kv, median): the connector's share")
    for name in results:
        ready = {}
        for path in (*paths, *FLOORS):
            marks = [phases(events).get("last start_load_kv end") for events in traces[name][path]]
            ready[path] = statistics.median(m for m in marks if m is not None) if any(marks) else None
        cells = [f"{path} {ms:.2f} ms" for path, ms in ready.items() if ms is not None]
        line = f"{name}: " + ", ".join(cells)
        if ready.get("chained") and ready.get("two-step"):
            line += f"; chained / two-step {ready['chained'] / ready['two-step']:.2f}"
        print(line)
    print()
    for name, times in results.items():
        for path in (*paths, *FLOORS):
            order = sorted(range(len(times[path])), key=times[path].__getitem__)
            middle = order[len(order) // 2]
            print(f"{name}, {path}, median round ({times[path][middle] * 1e3:.1f} ms):")
            print("  " + timeline_text(traces[name][path][middle]))


if __name__ == "__main__":
    raise SystemExit(main())
