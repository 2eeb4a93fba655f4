"""kvoffload's index against Dynamo's standalone indexer, side by side on one event stream.

Run: .venv/bin/python bench/bench_index_dynamo.py [--prompts N] [--queries N] [--quick]
(prints markdown tables; about 30 s at the defaults on a 2-core machine)

Dynamo's indexer is ``ai-dynamo-runtime==1.6.1`` (``python -m dynamo.indexer``, its own
virtual environment, made or reused by ``tests/dynamo_env.py``). If it cannot be had, the
bench says why and measures only kvoffload's half.

Both servers run as processes of their own on loopback: ours is ``kvoffload index serve
--port 0`` (aiohttp), Dynamo's is ``python -m dynamo.indexer --port P --threads T``
(default T = 4, Dynamo's default).

* Stream: 8 engines (instances 1..8) each hold the same ``--prompts`` prompts of 2,048
  blocks of 16 tokens (random tokens, random 64-bit chained block hashes). Per engine and
  prompt, three batches: the device tier (``GPU``) announces a random prefix, the host
  tier (``CPU``) the whole prompt, and every third prompt the disk tier (``STORAGE``,
  ``locality="LOCAL"``, the form Dynamo indexes) the whole prompt. Every ``BlockStored``
  is self-describing (token ids, parent hash, block size) and carries ``--event-blocks``
  blocks (64: a chunked-prefill step). Dynamo hashes the token ids itself; ours uses the
  hashes and learns the token chains.
* Publishing: a child process runs 8 ``ZmqEventPublisher`` s (kvoffload's). It encodes the
  whole stream before the clock starts (an engine's encoding is not the index's cost):
  the publishers are handed the same pre-encoded bytes they would have made.
* Ingestion: the identical stream (same bytes) is published twice, by fresh publishers:
  first with only our index subscribed, then with only Dynamo's, so neither shares the
  2 cores with the other's ingestion. After the stream each publisher sends a marker: one
  fresh block in each of the 3 tiers (Dynamo applies each tier on a queue of its own).
  The clock runs from the first publish to the moment ``/query`` of every engine's
  markers shows all 3 (polled every ``--poll-ms``): block hashes per second = hashes in
  the stream / that time. ``--together`` instead subscribes both to one publishing of
  the stream (they then share the cores).
* Agreement: afterwards both hold the same 8 engines; for each query prompt, ``/query``
  of ours and Dynamo's must give the same gpu/cpu/disk matched tokens per instance.
* Queries: a client process of its own, one keep-alive connection to each server,
  alternating ours and Dynamo's request by request (which goes first alternates too):
  ``/query`` with the prompt's 32,768 token ids (the same body to both), and
  ``/query_by_hash`` with each index's own 2,048 hashes (ours: the engine's block hashes;
  Dynamo: its hash of each block's tokens, ``compute_block_hash_for_seq``, computed in its
  environment beforehand; the two take different hashes under the same field); and
  ``GET /health`` of each, the floor of a round trip with this client. p50/p99 over
  ``--queries`` requests each after 20 warm-up requests.
* Memory: resident set size of each server process after start and after ingestion.
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing as mp
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from dynamo_env import DynamoIndexer, DynamoUnavailable, dynamo_python  # noqa: E402
from kvoffload.events import BlockStored, KVEventBatch, ZmqEventPublisher  # noqa: E402
from kvoffload.events.codec import EventEncoder  # noqa: E402

BS = 16
ENGINES = 8
PROMPT_BLOCKS = 2048
MODEL = "m"
TIERS = (("gpu", "GPU", None), ("cpu", "CPU", None), ("disk", "STORAGE", "LOCAL"))
WARMUP = 20


# -- the stream ----------------------------------------------------------------------------


def prompt_layout(seed: int, p: int) -> tuple[list[int], list[int], list[int]]:
    """Prompt ``p``: its token ids, its chained block hashes, each engine's device prefix."""
    rng = np.random.default_rng((seed, p))
    tokens = rng.integers(0, 150_000, PROMPT_BLOCKS * BS).tolist()
    hashes = rng.integers(0, 2**64, PROMPT_BLOCKS, dtype=np.uint64).tolist()
    device = rng.integers(1, PROMPT_BLOCKS + 1, ENGINES).tolist()
    return tokens, hashes, device


def stored(tokens: list[int], hashes: list[int], n: int, medium: str, locality, chunk: int) -> list:
    return [
        BlockStored(
            hashes[s : min(s + chunk, n)],
            hashes[s - 1] if s else None,
            tokens[s * BS : min(s + chunk, n) * BS],
            BS,
            None,
            medium,
            None,
            locality=locality,
        )
        for s in range(0, n, chunk)
    ]


def engine_batches(seed: int, prompts: int, chunk: int) -> list[list[KVEventBatch]]:
    """Per engine, its batches in order (device prefix, host, disk every third prompt)."""
    out: list[list[KVEventBatch]] = [[] for _ in range(ENGINES)]
    for p in range(prompts):
        tokens, hashes, device = prompt_layout(seed, p)
        for e in range(ENGINES):
            out[e].append(KVEventBatch(0.0, stored(tokens, hashes, device[e], "GPU", None, chunk), 0))
            out[e].append(KVEventBatch(0.0, stored(tokens, hashes, PROMPT_BLOCKS, "CPU", None, chunk), 0))
            if p % 3 == 0:
                disk = stored(tokens, hashes, PROMPT_BLOCKS, "STORAGE", "LOCAL", chunk)
                out[e].append(KVEventBatch(0.0, disk, 0))
    return out


def marker_tokens(tag: int, instance: int, k: int, tier: int) -> list[int]:
    """One block of fresh tokens: marker ``k`` of ``instance`` in ``tier``, run ``tag``."""
    return [200_000 + 100_000 * tag + 1000 * instance + 10 * k + tier] * BS


def marker_batch(tag: int, instance: int, k: int) -> KVEventBatch:
    events = []
    for t, (_, medium, locality) in enumerate(TIERS):
        tokens = marker_tokens(tag, instance, k, t)
        h = (tag << 40) | (instance << 24) | (k << 4) | t | (1 << 62)
        events.append(BlockStored([h], None, tokens, BS, None, medium, None, locality=locality))
    return KVEventBatch(time.time(), events, 0)


class PreEncodedPublisher(ZmqEventPublisher):
    """kvoffload's publisher, handed batches it would encode to these very bytes: the
    bench encodes the stream before the clock starts (``_payload`` is the publisher's own
    encode-once hook)."""

    def __init__(self, *args, encoded: dict[int, bytes], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._encoded = encoded

    def _payload(self, entry: list) -> bytes | None:
        value = entry[1]
        if not isinstance(value, bytes) and value is not None:
            payload = self._encoded.get(id(value))
            if payload is not None:
                entry[1] = payload
                return payload
        return super()._payload(entry)


def _publisher_child(tmp: str, seed: int, prompts: int, chunk: int, conn) -> None:
    streams = engine_batches(seed, prompts, chunk)
    encoder = EventEncoder("map", "u64")
    encoded = {id(b): encoder.encode(b) for s in streams for b in s}
    conn.send(
        {
            "hashes": sum(len(e.block_hashes) for s in streams for b in s for e in b.events),
            "batches": sum(len(s) for s in streams),
            "bytes": sum(len(v) for v in encoded.values()),
        }
    )
    pubs: dict[int, list[ZmqEventPublisher]] = {}
    hello = 0
    while True:
        cmd, tag = conn.recv()
        if cmd == "open":
            pubs[tag] = [
                PreEncodedPublisher(
                    f"ipc://{tmp}/t{tag}p{i}",
                    f"ipc://{tmp}/t{tag}r{i}",
                    buffer_steps=len(streams[i]) + 1000,
                    encoded=encoded,
                )
                for i in range(ENGINES)
            ]
            conn.send([(p.endpoint, p.replay_endpoint) for p in pubs[tag]])
        elif cmd == "hello":  # markers until the subscribers hear them
            hello += 1
            for i, pub in enumerate(pubs[tag]):
                pub.publish(marker_batch(tag, i + 1, hello))
            conn.send(hello)
        elif cmd == "go":
            start = time.perf_counter()
            for j in range(max(len(s) for s in streams)):
                for pub, stream in zip(pubs[tag], streams):
                    if j < len(stream):
                        pub.publish(stream[j])
            queued = time.perf_counter() - start
            for i, pub in enumerate(pubs[tag]):
                pub.publish(marker_batch(tag, i + 1, 999))
            while any(p.stats().sent < p.stats().published for p in pubs[tag]):
                time.sleep(0.001)
            conn.send((queued, time.perf_counter() - start))
        elif cmd == "quit":
            for group in pubs.values():
                for pub in group:
                    pub.close()
            conn.send("bye")
            return


# -- the two servers -----------------------------------------------------------------------


def http_json(conn: http.client.HTTPConnection, path: str, body: object = None) -> tuple[int, object]:
    data = None if body is None else json.dumps(body).encode()
    conn.request("GET" if data is None else "POST", path, data, {"Content-Type": "application/json"})
    response = conn.getresponse()
    text = response.read().decode()
    try:
        return response.status, json.loads(text) if text else None
    except json.JSONDecodeError:
        return response.status, text


class Server:
    """One index server process: ``name``, ``port``, ``pid``, and how its ``/query``
    answer gives an instance's matched tokens per tier."""

    def __init__(self, name: str, port: int, pid: int) -> None:
        self.name = name
        self.port = port
        self.pid = pid
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)

    def call(self, path: str, body: object = None) -> tuple[int, object]:
        try:
            return http_json(self.conn, path, body)
        except (http.client.HTTPException, OSError):
            self.conn.close()
            self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
            return http_json(self.conn, path, body)

    def tiers(self, answer: dict, instance: int) -> dict[str, int]:
        entry = (answer.get("instances") or {}).get(str(instance)) or {}
        if self.name == "kvoffload":
            entry = (entry.get("dp") or {}).get("0") or {}
        return {k: entry.get(k, 0) for k in ("gpu", "cpu", "disk")}

    def rss_mb(self) -> float:
        try:
            for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        except OSError:
            pass
        return float("nan")


def start_ours(log: Path) -> subprocess.Popen:
    code = "import sys; from kvoffload.cli import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "index", "serve", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=open(log, "ab"),  # noqa: SIM115 - the child owns it
        text=True,
    )
    line = proc.stdout.readline()  # "kvoffload index serving on http://127.0.0.1:PORT"
    if "serving on" not in line:
        proc.terminate()
        raise RuntimeError(f"kvoffload index serve did not start: {line!r} (see {log})")
    proc.port = int(line.rsplit(":", 1)[1])  # type: ignore[attr-defined]
    return proc


def register(server: Server, endpoints: list[tuple[str, str]]) -> None:
    for i, (endpoint, replay) in enumerate(endpoints):
        body = {
            "instance_id": i + 1,
            "endpoint": endpoint,
            "replay_endpoint": replay,
            "model_name": MODEL,
            "block_size": BS,
        }
        status, answer = server.call("/register", body)
        assert status in (200, 201), (server.name, status, answer)


def markers_seen(server: Server, tag: int, k: int, instances: set[int]) -> set[int]:
    """Those of ``instances`` whose marker ``k`` shows in all 3 tiers of ``server``,
    asked in order up to the first that does not (a poll costs the server little)."""
    seen = set()
    for instance in sorted(instances):
        for t, (tier, _, _) in enumerate(TIERS):
            status, answer = server.call(
                "/query", {"token_ids": marker_tokens(tag, instance, k, t), "model_name": MODEL}
            )
            if status != 200 or server.tiers(answer, instance)[tier] != BS:
                return seen
        seen.add(instance)
    return seen


def holds(server: Server, layout: tuple[list[int], list[int], list[int]]) -> dict | None:
    """``None`` if ``server``'s ``/query`` of a prompt gives every engine the tiers the
    stream gave it, else what it gives."""
    tokens, _, device = layout
    status, answer = server.call("/query", {"token_ids": tokens, "model_name": MODEL})
    full = PROMPT_BLOCKS * BS
    expect = {i + 1: {"gpu": device[i] * BS, "cpu": full, "disk": full} for i in range(ENGINES)}
    got = {i: server.tiers(answer, i) for i in expect} if status == 200 else {"status": status}
    return None if got == expect else got


def ingest(
    conn, servers: list[Server], tag: int, poll_s: float, last: tuple
) -> tuple[dict[str, float], dict[str, bool]]:
    """Publish the stream once to ``servers`` (all subscribed); seconds until each shows
    every engine's end marker, and the publisher's own times; whether, when it did, it
    already held the stream's last prompt as published (``last``)."""
    conn.send(("open", tag))
    endpoints = conn.recv()
    for server in servers:
        register(server, endpoints)
    deadline = time.monotonic() + 60
    while True:  # subscriptions established: a hello marker shows in every server
        conn.send(("hello", tag))
        k = conn.recv()
        stop = time.monotonic() + 1.0
        pending = {s.name: set(range(1, ENGINES + 1)) for s in servers}
        while time.monotonic() < stop and any(pending.values()):
            for s in servers:
                pending[s.name] -= markers_seen(s, tag, k, pending[s.name])
            time.sleep(0.05)
        if not any(pending.values()):
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"no subscription established: {pending}")
    pending = {s.name: set(range(1, ENGINES + 1)) for s in servers}
    done: dict[str, float] = {}
    complete: dict[str, bool] = {}
    start = time.perf_counter()
    conn.send(("go", tag))
    published = None
    while len(done) < len(servers):
        if published is None and conn.poll():
            published = conn.recv()
        time.sleep(poll_s)
        for s in servers:
            if s.name in done:
                continue
            pending[s.name] -= markers_seen(s, tag, 999, pending[s.name])
            if not pending[s.name]:
                done[s.name] = time.perf_counter() - start
                complete[s.name] = holds(s, last) is None
        if time.perf_counter() - start > 600:
            raise RuntimeError(f"ingestion did not finish in 600 s: {pending}")
    if published is None:
        published = conn.recv()
    done["_queued"], done["_published"] = published
    return done, complete


# -- queries -------------------------------------------------------------------------------


def _query_client(jobs: list[tuple[str, int, str, list[bytes]]], queries: int, conn) -> None:
    """``jobs``: (label, port, path, bodies). Request by request, the jobs take turns
    (rotating who goes first); latencies per label."""
    conns = [http.client.HTTPConnection("127.0.0.1", port, timeout=60) for _, port, _, _ in jobs]
    latencies: dict[str, list[float]] = {label: [] for label, _, _, _ in jobs}
    for i in range(queries + WARMUP):
        order = list(range(len(jobs)))
        order = order[i % len(order) :] + order[: i % len(order)]
        for j in order:
            label, _, path, bodies = jobs[j]
            body = bodies[i % len(bodies)]
            start = time.perf_counter()
            if body:
                conns[j].request("POST", path, body, {"Content-Type": "application/json"})
            else:
                conns[j].request("GET", path)
            response = conns[j].getresponse()
            payload = response.read()
            elapsed = time.perf_counter() - start
            assert response.status == 200, (label, payload[:300])
            if i >= WARMUP:
                latencies[label].append(elapsed)
    for c in conns:
        c.close()
    conn.send(latencies)


def run_queries(jobs, queries: int) -> dict[str, list[float]]:
    parent, child = mp.Pipe()
    proc = mp.get_context("spawn").Process(target=_query_client, args=(jobs, queries, child))
    proc.start()
    out = parent.recv()
    proc.join(30)
    return out


def pct(samples: list[float]) -> tuple[float, float]:
    s = sorted(samples)
    return s[len(s) // 2] * 1e6, s[int(0.99 * (len(s) - 1))] * 1e6


_DYNAMO_HASHES = """
import json, sys
from dynamo.llm import compute_block_hash_for_seq
request = json.load(sys.stdin)
out = [compute_block_hash_for_seq(t, request["block_size"]) for t in request["prompts"]]
print(json.dumps(out))
"""


def dynamo_hashes(python: Path, prompts: list[list[int]]) -> list[list[int]]:
    """Dynamo's own hash of each block (its /query_by_hash takes these), as i64."""
    out = subprocess.run(
        [str(python), "-c", _DYNAMO_HASHES],
        input=json.dumps({"prompts": prompts, "block_size": BS}),
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return [[v - (1 << 64) if v >= 1 << 63 else v for v in p] for p in json.loads(out.stdout)]


# -- main ------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=96, help="2,048-block prompts per engine")
    parser.add_argument("--event-blocks", type=int, default=64, help="blocks per BlockStored")
    parser.add_argument("--queries", type=int, default=1000, help="timed requests per server and path")
    parser.add_argument("--query-prompts", type=int, default=16, help="distinct prompts queried")
    parser.add_argument("--dynamo-threads", type=int, default=4, help="dynamo.indexer --threads")
    parser.add_argument("--poll-ms", type=float, default=20.0, help="marker polling period")
    parser.add_argument("--together", action="store_true", help="one publishing to both at once")
    parser.add_argument("--no-dynamo", action="store_true", help="measure only kvoffload's index")
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke test)")
    args = parser.parse_args()
    if args.quick:
        args.prompts, args.queries, args.query_prompts = 3, 40, 3
    args.query_prompts = min(args.query_prompts, args.prompts)

    dyn_python = None
    if args.no_dynamo:
        print("Dynamo's indexer: skipped (--no-dynamo)\n")
    else:
        try:
            dyn_python = dynamo_python()
        except DynamoUnavailable as exc:
            print(f"Dynamo's indexer is not available, its half is skipped: {exc}\n")

    with tempfile.TemporaryDirectory() as tmp:
        parent, child = mp.Pipe()
        pub = mp.get_context("spawn").Process(
            target=_publisher_child, args=(tmp, args.seed, args.prompts, args.event_blocks, child)
        )
        pub.start()
        ours_proc = start_ours(Path(tmp) / "ours.log")
        dyn = None
        servers = [Server("kvoffload", ours_proc.port, ours_proc.pid)]  # type: ignore[attr-defined]
        try:
            if dyn_python is not None:
                try:
                    dyn = DynamoIndexer(dyn_python, Path(tmp) / "dynamo.log", args.dynamo_threads).start()
                    servers.append(Server("dynamo", dyn.port, dyn.proc.pid))
                except RuntimeError as exc:
                    print(f"Dynamo's indexer did not start, its half is skipped: {exc}\n")
                    dyn = None
            sizes = parent.recv()
            rss0 = {s.name: s.rss_mb() for s in servers}
            total = sizes["hashes"]
            print(
                f"Stream: {ENGINES} engines x {args.prompts} prompts of {PROMPT_BLOCKS} blocks "
                f"({BS} tokens/block), {sizes['batches']:,} batches, {total:,} block hashes, "
                f"{sizes['bytes'] / 1e6:,.0f} MB encoded; {args.event_blocks} blocks per event. "
                f"Dynamo threads: {args.dynamo_threads if dyn else '-'}.\n"
            )
            times: dict[str, float] = {}
            publish: dict[str, float] = {}
            complete: dict[str, bool] = {}
            last = prompt_layout(args.seed, args.prompts - 1)
            groups = [servers] if args.together else [[s] for s in servers]
            for tag, group in enumerate(groups, start=1):
                got, whole = ingest(parent, group, tag, args.poll_ms / 1000, last)
                complete.update(whole)
                for s in group:
                    times[s.name] = got[s.name]
                    publish[s.name] = got["_published"]
            rss1 = {s.name: s.rss_mb() for s in servers}

            mode = "both subscribed to one publishing" if args.together else "each alone, one after the other"
            print(f"## Ingestion over ZMQ ({mode}), until every engine's end marker shows\n")
            print(
                "| index | block hashes | seconds | hashes/s | last prompt held at marker "
                "| publisher done at s | RSS MB before → after |"
            )
            print("|---|---:|---:|---:|---|---:|---|")
            for s in servers:
                print(
                    f"| {s.name} | {total:,} | {times[s.name]:.2f} | {total / times[s.name]:,.0f} "
                    f"| {'yes' if complete[s.name] else 'NO'} | {publish[s.name]:.2f} "
                    f"| {rss0[s.name]:,.0f} → {rss1[s.name]:,.0f} |"
                )
            if dyn:
                ratio = times["dynamo"] / times["kvoffload"]
                print(f"\nIngestion ratio ours/Dynamo (hashes/s): {ratio:.2f}")

            # the query prompts: the same token ids to both; each index's own hashes
            layouts = [prompt_layout(args.seed, p) for p in range(args.query_prompts)]
            agree = 0
            for p, layout in enumerate(layouts):
                ok = True
                for s in servers:
                    wrong = holds(s, layout)
                    if wrong is not None:
                        ok = False
                        print(f"prompt {p}: {s.name} answers {str(wrong)[:300]}")
                agree += ok
            print(
                f"\nAgreement: {agree}/{len(layouts)} query prompts give the expected gpu/cpu/disk "
                f"tokens for all {ENGINES} engines in {' and '.join(s.name for s in servers)}\n"
            )

            token_bodies = [json.dumps({"token_ids": t, "model_name": MODEL}).encode() for t, _, _ in layouts]
            jobs = [
                ("kvoffload /query", servers[0].port, "/query", token_bodies),
                (
                    "kvoffload /query_by_hash",
                    servers[0].port,
                    "/query_by_hash",
                    [json.dumps({"block_hashes": h, "model_name": MODEL}).encode() for _, h, _ in layouts],
                ),
            ]
            if dyn:
                own = dynamo_hashes(dyn_python, [t for t, _, _ in layouts])
                jobs.insert(1, ("dynamo /query", dyn.port, "/query", token_bodies))
                jobs.append(
                    (
                        "dynamo /query_by_hash",
                        dyn.port,
                        "/query_by_hash",
                        [json.dumps({"block_hashes": h, "model_name": MODEL}).encode() for h in own],
                    )
                )
            jobs.append(("kvoffload GET /health (HTTP floor)", servers[0].port, "/health", [b""]))
            if dyn:
                jobs.append(("dynamo GET /health (HTTP floor)", dyn.port, "/health", [b""]))
            lat = run_queries(jobs, args.queries)
            print(
                f"## Queries, {PROMPT_BLOCKS}-block prompts, {ENGINES} engines "
                f"({args.queries} per row, interleaved, HTTP keep-alive on loopback)\n"
            )
            print("| request | p50 µs | p99 µs |\n|---|---:|---:|")
            for label, samples in lat.items():
                p50, p99 = pct(samples)
                print(f"| {label} | {p50:,.0f} | {p99:,.0f} |")
            if dyn:
                print("\n| ratio ours/Dynamo (latency; < 1: ours faster) | p50 | p99 |\n|---|---:|---:|")
                for path in ("/query", "/query_by_hash"):
                    a, b = pct(lat[f"kvoffload {path}"]), pct(lat[f"dynamo {path}"])
                    print(f"| {path} | {a[0] / b[0]:.2f} | {a[1] / b[1]:.2f} |")
        finally:
            parent.send(("quit", 0))
            if parent.poll(10):
                parent.recv()
            pub.join(10)
            if dyn:
                dyn.stop()
            ours_proc.terminate()
            try:
                ours_proc.wait(10)
            except subprocess.TimeoutExpired:
                ours_proc.kill()


if __name__ == "__main__":
    main()
