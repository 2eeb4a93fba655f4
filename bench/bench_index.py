"""KV-block index benchmark: ingestion, /query_by_hash latency, memory per million blocks.

Run: .venv/bin/python bench/bench_index.py [--quick]   (prints markdown tables; ~1 minute)

* ingest (in process): batches decoded as the index's sources decode them
  (``kvoffload.index.wire.decode_batch``: token ids left encoded until learned) and
  applied to a ``BlockIndex`` by one thread, per event shape; block hashes per second
  counts every hash of every event applied. Each batch is one engine step: 4 events of
  64 hashes (chunked prefill of 4 requests), the device tier first, then the host tier
  re-announcing them (existing hashes), then the device evicting them. "with tokens"
  events carry 16 token ids per block, which the index learns chains from;
  "placeholder" events carry none.
* ingest (ZMQ, end to end): 8 ``ZmqEventPublisher`` s in a child process publish those
  batches as fast as they can; an ``IndexService`` with one subscriber thread per
  publisher applies them; hashes/s from the first to the last batch applied, lost batches
  (must be 0) and the sources' final state.
* query: 8 engines hold 2,048-block prompts (a random device prefix, the whole prompt on
  the host, every third prompt on disk); /query_by_hash of one of those prompts over HTTP
  on loopback (keep-alive, one client process), and ``BlockIndex.query_hashes`` alone,
  p50/p99 over 1,000 queries, for an index of ~100 k and of ~1 M distinct blocks. The
  client takes turns between two connections: Python's ``http.client`` (its header parsing
  in Python costs it about 80 us a request, which a router in Rust or Go does not pay) and
  a plain socket that sends the prepared request and reads the reply to its
  ``Content-Length``: the server's latency with the least client cost.
* memory: tracemalloc's count of what 1 M distinct blocks held by 8 engines in 2 tiers
  add to an index (numpy tables included), without and with learned token chains.
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing as mp
import random
import socket
import statistics
import tempfile
import time
import tracemalloc

import numpy as np

from kvoffload.events import BlockRemoved, BlockStored, KVEventBatch, ZmqEventPublisher, decode, encode
from kvoffload.index import BlockIndex, IndexServer, IndexService, Registration
from kvoffload.index.wire import decode_batch

BS = 16
ENGINES = 8
PROMPT_BLOCKS = 2048


def step_batches(rng: random.Random, steps: int, tokens: bool) -> list[KVEventBatch]:
    out = []
    for _ in range(steps):
        chunks = [[rng.getrandbits(64) for _ in range(64)] for _ in range(4)]
        toks = [rng.randrange(150_000) for _ in range(64 * BS)] if tokens else []
        gpu = [BlockStored(c, rng.getrandbits(64), toks, BS, None, "GPU", None) for c in chunks]
        cpu = [BlockStored(c, None, [], BS, None, "CPU", None) for c in chunks]
        out.append(KVEventBatch(time.time(), gpu, 0))
        out.append(KVEventBatch(time.time(), cpu, 0))
        out.append(KVEventBatch(time.time(), [BlockRemoved(c, "GPU") for c in chunks], 0))
    return out


def hashes_in(batches: list[KVEventBatch]) -> int:
    return sum(len(e.block_hashes) for b in batches for e in b.events)


def bench_ingest_in_process(steps: int) -> list[tuple]:
    rows = []
    for tokens in (False, True):
        payloads = [encode(b) for b in step_batches(random.Random(1), steps, tokens)]
        total = hashes_in([decode(p) for p in payloads])
        index = BlockIndex()
        engine = index.add_engine("m", "t", "e", 0, BS)
        start = time.perf_counter()
        for payload in payloads:
            index.apply(engine, decode_batch(payload).events)
        elapsed = time.perf_counter() - start
        rows.append(("with tokens" if tokens else "placeholder", total, total / elapsed))
    return rows


def _publish_child(tmp: str, steps: int, conn) -> None:
    pubs = [
        ZmqEventPublisher(f"ipc://{tmp}/p{i}", f"ipc://{tmp}/r{i}", buffer_steps=1_000_000)
        for i in range(ENGINES)
    ]
    streams = [step_batches(random.Random(100 + i), steps, False) for i in range(ENGINES)]
    conn.send(sum(hashes_in(s) for s in streams))
    conn.recv()  # the index has subscribed
    for j in range(len(streams[0])):
        for pub, stream in zip(pubs, streams):
            pub.publish(stream[j])
    conn.recv()  # the index has applied everything
    for pub in pubs:
        pub.close()


def bench_ingest_zmq(steps: int) -> tuple:
    with tempfile.TemporaryDirectory() as tmp:
        parent, child = mp.Pipe()
        proc = mp.get_context("spawn").Process(target=_publish_child, args=(tmp, steps, child))
        proc.start()
        total = parent.recv()
        with IndexService(replay_timeout=2.0) as service:
            sources = [
                service.register(
                    Registration(i, f"ipc://{tmp}/p{i}", "m", BS, replay_endpoint=f"ipc://{tmp}/r{i}")
                )
                for i in range(ENGINES)
            ]
            time.sleep(0.5)  # subscriptions established
            parent.send("go")
            first = None
            expected = 3 * steps
            while sum(s.stats().batches for s in sources) < ENGINES * expected:
                if first is None and any(s.stats().batches for s in sources):
                    first = time.perf_counter()
                time.sleep(0.001)
            elapsed = time.perf_counter() - (first or time.perf_counter())
            lost = sum(s.stats().lost for s in sources)
            states = sorted({s.state.value for s in sources})
            parent.send("done")
        proc.join(30)
    return total, total / elapsed, lost, states


def build_query_index(prompts: int, seed: int = 7) -> tuple[BlockIndex, list[list[int]]]:
    rng = random.Random(seed)
    index = BlockIndex()
    engines = [index.add_engine("m", "default", i, 0, BS) for i in range(ENGINES)]
    all_prompts = []
    for p in range(prompts):
        prompt = [rng.getrandbits(64) for _ in range(PROMPT_BLOCKS)]
        all_prompts.append(prompt)
        for engine in engines:
            device = rng.randrange(PROMPT_BLOCKS)
            events = [BlockStored(prompt[:device], None, [], BS, None, "GPU", None)]
            events.append(BlockStored(prompt, None, [], BS, None, "CPU", None))
            if p % 3 == 0:
                events.append(BlockStored(prompt, None, [], BS, None, "STORAGE", None, locality="LOCAL"))
            index.apply(engine, events)
    return index, all_prompts


def _raw_post(sock: socket.socket, request: bytes) -> bytes:
    """Send a prepared HTTP/1.1 request; the reply's status line, headers and body."""
    sock.sendall(request)
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(1 << 16)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(value) for name, _, value in (line.partition(b":") for line in head.split(b"\r\n")[1:])
        if name.strip().lower() == b"content-length"
    )  # fmt: skip
    while len(body) < length:
        body += sock.recv(1 << 16)
    return head + b"\r\n\r\n" + body


def _query_client(port: int, bodies: list[bytes], queries: int, conn) -> None:
    """Latencies of ``http.client`` and of a plain socket, request by request in turns."""
    rng = random.Random(3)
    client = http.client.HTTPConnection("127.0.0.1", port)
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    head = b"POST /query_by_hash HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    latencies: dict[str, list[float]] = {"http.client": [], "socket": []}
    for i in range(queries + 50):
        body = bodies[rng.randrange(len(bodies))]
        for name in ("http.client", "socket") if i % 2 else ("socket", "http.client"):
            start = time.perf_counter()
            if name == "socket":
                reply = _raw_post(sock, head + b"Content-Length: %d\r\n\r\n" % len(body) + body)
                ok = reply.startswith(b"HTTP/1.1 200")
            else:
                client.request("POST", "/query_by_hash", body, {"Content-Type": "application/json"})
                response = client.getresponse()
                reply = response.read()
                ok = response.status == 200
            elapsed = time.perf_counter() - start
            assert ok, reply[:300]
            if i >= 50:  # warm-up
                latencies[name].append(elapsed)
    client.close()
    sock.close()
    conn.send(latencies)


def percentiles(samples: list[float]) -> tuple[float, float]:
    samples = sorted(samples)
    return statistics.median(samples), samples[int(0.99 * (len(samples) - 1))]


def bench_query(prompts: int, queries: int) -> list[tuple]:
    index, all_prompts = build_query_index(prompts)
    entries = index.sizes()["entries"]
    rng = random.Random(3)
    core = []
    for _ in range(queries):
        prompt = all_prompts[rng.randrange(len(all_prompts))]
        start = time.perf_counter()
        index.query_hashes("m", "default", prompt)
        core.append(time.perf_counter() - start)
    bodies = [json.dumps({"block_hashes": p, "model_name": "m"}).encode() for p in all_prompts[:50]]
    with IndexServer(IndexService(index), "127.0.0.1", 0) as server:
        # The client runs in a process of its own: sharing the server's GIL would add
        # the client's own thread switches to every latency.
        parent, child = mp.Pipe()
        proc = mp.get_context("spawn").Process(
            target=_query_client, args=(server.port, bodies, queries, child)
        )
        proc.start()
        http_lat = parent.recv()
        proc.join(30)
    return [
        ("BlockIndex.query_hashes", entries, *percentiles(core)),
        ("HTTP /query_by_hash, http.client", entries, *percentiles(http_lat["http.client"])),
        ("HTTP /query_by_hash, socket client", entries, *percentiles(http_lat["socket"])),
    ]


def bench_memory(blocks: int, tokens: bool) -> float:
    rng = np.random.default_rng(5)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index = BlockIndex()
    engines = [index.add_engine("m", "default", i, 0, BS) for i in range(ENGINES)]
    chunk = 512
    toks = list(range(chunk * BS)) if tokens else []
    for start in range(0, blocks, chunk):
        hashes = rng.integers(0, 2**63, chunk, dtype=np.uint64).tolist()
        if tokens:
            toks = [start + i for i in range(chunk * BS)]  # distinct blocks of tokens
        for k, engine in enumerate(engines):
            medium = "GPU" if k % 2 else "CPU"
            index.apply(engine, [BlockStored(hashes, None, toks if k == 0 else [], BS, None, medium, None)])
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return used / (index.sizes()["entries"] / 1e6)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="smaller runs (for a smoke test)")
    args = parser.parse_args()
    steps = 200 if args.quick else 2000
    print("## Ingestion, in process (one thread, decode included)\n")
    print("| events | block hashes | hashes/s |\n|---|---:|---:|")
    for name, total, rate in bench_ingest_in_process(steps):
        print(f"| {name} | {total:,} | {rate:,.0f} |")
    print("\n## Ingestion over ZMQ: 8 publishers -> 8 subscriber threads\n")
    total, rate, lost, states = bench_ingest_zmq(steps // 4)
    print("| block hashes | hashes/s | lost batches | source states |\n|---:|---:|---:|---|")
    print(f"| {total:,} | {rate:,.0f} | {lost} | {', '.join(states)} |")
    print("\n## /query_by_hash, 2,048-block prompts, 8 engines\n")
    print("| path | indexed blocks | p50 µs | p99 µs |\n|---|---:|---:|---:|")
    for prompts in (50, 500) if not args.quick else (10,):
        for name, entries, p50, p99 in bench_query(prompts, 1000 if not args.quick else 100):
            print(f"| {name} | {entries:,} | {p50 * 1e6:,.0f} | {p99 * 1e6:,.0f} |")
    print("\n## Memory per million indexed blocks (8 engines, 2 tiers)\n")
    print("| token chains | bytes per block |\n|---|---:|")
    blocks = 200_000 if args.quick else 1_000_000
    for tokens in (False, True):
        print(f"| {'learned' if tokens else 'none'} | {bench_memory(blocks, tokens) / 1e6:,.0f} |")


if __name__ == "__main__":
    main()
