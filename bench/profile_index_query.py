"""Where one /query_by_hash or /query request's time goes, stage by stage, in process.

Run: .venv/bin/python bench/profile_index_query.py [--prompts N] [--requests N] [--cold]

Builds the index ``bench_index_dynamo.py`` ingests (8 engines, ``--prompts`` prompts of
2,048 blocks of 16 tokens: a random device prefix, the whole prompt on the host, every
third prompt on disk; self-describing events, so token chains are learned) in this
process, then times each stage the server runs for a request, on the bodies a client
sends (16 prompts in turn), without HTTP:

* ``/query_by_hash``: parse (JSON body to uint64 hashes), lookup (the block tables:
  ``BlockIndex._gather``), score (``BlockIndex._score``), response (the JSON dict) and
  encode (its bytes).
* ``/query``: parse (32,768 token ids), chains (the learned token chains walked:
  ``BlockIndex._learned_hashes``), then lookup, score, response and encode as above.

``--cold`` writes over a 64 MiB buffer before each request, as a client and other
processes sharing the machine do between two requests of a real server; without it the
caches stay warm. p50 and p99 in µs per stage.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_index_dynamo as stream  # noqa: E402
from kvoffload.index import BlockIndex  # noqa: E402
from kvoffload.index.requests import parse  # noqa: E402
from kvoffload.index.server import _encode, score_response  # noqa: E402


def build(prompts: int) -> tuple[BlockIndex, list]:
    index = BlockIndex()
    engines = [index.add_engine(stream.MODEL, "default", e + 1, 0, stream.BS) for e in range(stream.ENGINES)]
    layouts = []
    for p in range(prompts):
        tokens, hashes, device = layout = stream.prompt_layout(11, p)
        layouts.append(layout)
        for e, engine in enumerate(engines):
            index.apply(engine, stream.stored(tokens, hashes, device[e], "GPU", None, 64))
            index.apply(engine, stream.stored(tokens, hashes, stream.PROMPT_BLOCKS, "CPU", None, 64))
            if p % 3 == 0:
                disk = stream.stored(tokens, hashes, stream.PROMPT_BLOCKS, "STORAGE", "LOCAL", 64)
                index.apply(engine, disk)
    return index, layouts


def profile(index: BlockIndex, bodies: list[bytes], kind: str, requests: int, cold: bool) -> dict:
    space = index._space(stream.MODEL, "default")
    junk = np.zeros(64 << 20, dtype=np.uint8)
    stages: dict[str, list[float]] = {}
    for i in range(requests + 10):
        if cold:
            junk += 1
        body = bodies[i % len(bodies)]
        marks = [time.perf_counter()]
        req = parse(kind, body)
        marks.append(time.perf_counter())
        if kind == "query":
            hashes = index._learned_hashes(space, req.token_ids, None, None)
            marks.append(time.perf_counter())
        else:
            hashes = req.block_hashes
        groups, engines = index._gather(space, hashes, None)
        marks.append(time.perf_counter())
        result = index._score(space, groups, engines, len(hashes))
        marks.append(time.perf_counter())
        answer = score_response(result)
        marks.append(time.perf_counter())
        _encode(answer)
        marks.append(time.perf_counter())
        names = ["parse", *(["chains"] if kind == "query" else []), "lookup", "score", "response", "encode"]
        if i >= 10:
            for name, start, end in zip(names, marks, marks[1:]):
                stages.setdefault(name, []).append(end - start)
            stages.setdefault("total", []).append(marks[-1] - marks[0])
    return stages


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=96)
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--cold", action="store_true", help="evict the caches before each request")
    args = ap.parse_args()
    index, layouts = build(args.prompts)
    chosen = layouts[:16]  # (tokens, hashes, device prefixes)
    model = stream.MODEL
    bodies = {
        "query_by_hash": [json.dumps({"block_hashes": c[1], "model_name": model}).encode() for c in chosen],
        "query": [json.dumps({"token_ids": c[0], "model_name": model}).encode() for c in chosen],
    }
    print(f"{args.prompts} prompts x 8 engines, {'cold' if args.cold else 'warm'} caches, µs per stage\n")
    print("| request | stage | p50 | p99 |\n|---|---|---:|---:|")
    for kind in ("query_by_hash", "query"):
        requests = args.requests if kind == "query_by_hash" else max(1, args.requests // 5)
        for name, samples in profile(index, bodies[kind], kind, requests, args.cold).items():
            s = sorted(samples)
            p50, p99 = s[len(s) // 2] * 1e6, s[int(0.99 * (len(s) - 1))] * 1e6
            print(f"| /{kind} | {name} | {p50:,.0f} | {p99:,.0f} |")


if __name__ == "__main__":
    main()
