"""KV events benchmark: codec throughput, publish() cost, ipc end to end, and a burst.

Run: .venv/bin/python bench/bench_events.py   (prints markdown tables; about a minute)

* encode: batches of 4 ``BlockStored`` events of 16 or 64 u64 hashes each, with token ids
  (block size 16) or without, in both encodings; also raw 32-byte hashes converted to u64.
* publish(): caller-side cost per batch (type check + sequence + buffer + queue hand-off;
  encoding happens on the sender thread).
* end to end: publisher in this process, subscriber in a child process, over ipc.
* burst: 100,000 batches as fast as possible to a deliberately slow subscriber (child
  process, 20 us of "work" per batch). Checks delivered + lost == published, with every
  sequence number delivered at most once and in order.
* against vLLM: our ``EventEncoder`` (checking hashes, and with ``check_hashes=False``)
  against vLLM 0.32's ``msgspec.msgpack.Encoder().encode(KVEventBatch)`` on identical
  content (64 ``BlockStored`` x 16 u64 hashes x 16 tokens; the payloads are asserted
  byte-identical), interleaved repetitions in one run; ratios are taken per repetition.
  Skipped with a message when vllm does not import.
  ``.venv/bin/python bench/bench_events.py --vllm-only`` runs just this (about 15 s).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import statistics
import sys
import tempfile
import time

from kvoffload.events import (
    BlockStored,
    EventEncoder,
    EventSubscriber,
    KVEventBatch,
    ZmqEventPublisher,
    decode,
)

BLOCK_SIZE = 16
EVENTS_PER_BATCH = 4


def make_batches(
    count: int, hashes: int, tokens: bool, raw: bool = False, seed: int = 0
) -> list[KVEventBatch]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        events = []
        for _ in range(EVENTS_PER_BATCH):
            if raw:
                block_hashes = [rng.randbytes(32) for _ in range(hashes)]
            else:
                block_hashes = [rng.getrandbits(64) for _ in range(hashes)]
            token_ids = [rng.randrange(150_000) for _ in range(hashes * BLOCK_SIZE)] if tokens else []
            events.append(
                BlockStored(
                    block_hashes, rng.getrandbits(64), token_ids, BLOCK_SIZE, None, "CPU", None, group_idx=0
                )
            )
        out.append(KVEventBatch(time.time(), events, 0))
    return out


def bench_encode() -> list[tuple]:
    rows = []
    for hashes, tokens in ((16, False), (16, True), (64, False), (64, True)):
        batches = make_batches(500, hashes, tokens)
        for fmt in ("map", "array"):
            rows.append(_time_encode(batches, fmt, hashes, tokens, "u64 ints"))
    rows.append(
        _time_encode(make_batches(300, 64, False, raw=True), "map", 64, False, "32-byte digests to u64")
    )
    return rows


def _time_encode(
    batches: list[KVEventBatch], fmt: str, hashes: int, tokens: bool, input_hashes: str
) -> tuple:
    encoder = EventEncoder(fmt)
    payload = encoder.encode(batches[0])
    assert decode(payload) is not None
    loops, start = 0, time.perf_counter()
    while time.perf_counter() - start < 0.5:
        for batch in batches:
            encoder.encode(batch)
        loops += 1
    elapsed = time.perf_counter() - start
    n_batches = loops * len(batches)
    per_batch_us = elapsed / n_batches * 1e6
    decode_start = time.perf_counter()
    payloads = [encoder.encode(b) for b in batches]
    decode_start = time.perf_counter()
    for p in payloads:
        decode(p)
    decode_us = (time.perf_counter() - decode_start) / len(payloads) * 1e6
    hashes_per_s = n_batches * EVENTS_PER_BATCH * hashes / elapsed
    return (
        fmt,
        f"{EVENTS_PER_BATCH}x{hashes}",
        "yes" if tokens else "no",
        input_hashes,
        len(payload),
        per_batch_us,
        hashes_per_s,
        decode_us,
    )


VLLM_EVENTS, VLLM_HASHES = 64, 16


def bench_vs_vllm(
    reps: int = 9, batches_per_rep: int = 200, seconds: float = 0.4
) -> tuple[list[tuple], float] | str:
    """Rows (encoder, median M hashes/s, median ratio to vLLM, min ratio, max ratio) and
    the mean payload size in bytes; a message instead when vllm does not import."""
    try:
        import msgspec
        from vllm.distributed import kv_events as vllm_events
    except Exception as exc:  # noqa: BLE001 - any import failure means: no vLLM row
        return f"skipped: vllm does not import ({type(exc).__name__}: {exc})"
    rng = random.Random(1)
    ours, theirs = [], []
    for _ in range(batches_per_rep):
        ts = time.time()
        stored = [
            (
                [rng.getrandbits(64) for _ in range(VLLM_HASHES)],
                rng.getrandbits(64),
                [rng.randrange(150_000) for _ in range(VLLM_HASHES)],
            )
            for _ in range(VLLM_EVENTS)
        ]
        ours.append(
            KVEventBatch(ts, [BlockStored(h, p, t, BLOCK_SIZE, None, "CPU", None) for h, p, t in stored], 0)
        )
        theirs.append(
            vllm_events.KVEventBatch(
                ts=ts,
                events=[
                    vllm_events.BlockStored(
                        block_hashes=h,
                        parent_block_hash=p,
                        token_ids=t,
                        block_size=BLOCK_SIZE,
                        lora_id=None,
                        medium="CPU",
                        lora_name=None,
                    )
                    for h, p, t in stored
                ],
                data_parallel_rank=0,
            )
        )
    vllm_encode = msgspec.msgpack.Encoder().encode
    contenders = [
        ("vLLM 0.32 msgspec encoder", vllm_encode, theirs),
        ("EventEncoder() (checks every hash)", EventEncoder().encode, ours),
        ("EventEncoder(check_hashes=False)", EventEncoder(check_hashes=False).encode, ours),
    ]
    reference = [vllm_encode(b) for b in theirs]
    for name, encode, batches in contenders:
        assert [encode(b) for b in batches] == reference, f"{name}: payload differs from vLLM's"
    hashes_per_batch = VLLM_EVENTS * VLLM_HASHES
    # Each repetition takes turns 10 batches at a time (rotating who goes first), so a
    # change of load on the machine hits every contender alike; a repetition's ratio is
    # its contenders' total times against each other.
    rates: dict[str, list[float]] = {name: [] for name, _, _ in contenders}
    chunk = 10
    for _ in range(reps):
        spent = dict.fromkeys(rates, 0.0)
        encoded = 0
        rep_start = time.perf_counter()
        while time.perf_counter() - rep_start < seconds * len(contenders):
            for first in range(0, batches_per_rep, chunk):
                turn = (first // chunk) % len(contenders)
                for name, encode, batches in contenders[turn:] + contenders[:turn]:
                    start = time.perf_counter()
                    for batch in batches[first : first + chunk]:
                        encode(batch)
                    spent[name] += time.perf_counter() - start
            encoded += batches_per_rep
        for name in rates:
            rates[name].append(encoded * hashes_per_batch / spent[name] / 1e6)
    base = rates[contenders[0][0]]
    rows = []
    for name, _, _ in contenders:
        ratios = [r / b for r, b in zip(rates[name], base)]
        rows.append(
            (name, statistics.median(rates[name]), statistics.median(ratios), min(ratios), max(ratios))
        )
    return rows, statistics.fmean(map(len, reference))


def print_vs_vllm() -> None:
    print(
        f"## Encode against vLLM 0.32 ({VLLM_EVENTS} BlockStored x {VLLM_HASHES} hashes x "
        f"{VLLM_HASHES} tokens per batch, map encoding, identical payloads, 9 interleaved repetitions)\n"
    )
    result = bench_vs_vllm()
    if isinstance(result, str):
        print(result)
        return
    rows, payload_bytes = result
    print(f"Payload: {payload_bytes:,.0f} bytes per batch on average, the same bytes from every encoder.\n")
    print(table(
        ["encoder", "M hashes/s (median)", "ratio to vLLM (median)", "ratio min", "ratio max"],
        rows,
        ["{}", "{:.1f}", "{:.2f}x", "{:.2f}x", "{:.2f}x"],
    ))  # fmt: skip


def bench_publish(tmp: str) -> list[tuple]:
    rows = []
    for hashes, tokens in ((16, False), (64, True)):
        batches = make_batches(2000, hashes, tokens)
        with ZmqEventPublisher(f"ipc://{tmp}/pub-cost-{hashes}", f"ipc://{tmp}/replay-cost-{hashes}") as pub:
            costs = []
            for _ in range(5):
                for batch in batches:
                    t0 = time.perf_counter_ns()
                    pub.publish(batch)
                    costs.append(time.perf_counter_ns() - t0)
                time.sleep(0.05)  # let the sender drain so the queue never fills
            dropped = pub.stats().dropped_sends
        costs.sort()
        rows.append(
            (f"{EVENTS_PER_BATCH}x{hashes}", "yes" if tokens else "no", statistics.fmean(costs) / 1000,
             costs[len(costs) // 2] / 1000, costs[int(len(costs) * 0.99)] / 1000, dropped)
        )  # fmt: skip
    return rows


def _subscriber_child(endpoint: str, replay: str, total: int, hwm: int, work_us: float, conn) -> None:
    with EventSubscriber(endpoint, replay, hwm=hwm) as sub:
        conn.send("ready")
        seqs: list[int] = []
        first = last = None
        idle_deadline = time.monotonic() + 60
        while time.monotonic() < idle_deadline:
            stats = sub.stats()
            if len(seqs) + stats.lost >= total:
                break
            item = sub.receive(0.5)
            if item is None:
                sub.catch_up()  # the tail may have been dropped live: nothing after it shows a gap
                continue
            last = time.perf_counter()
            first = first or last
            seqs.append(item[0])
            if work_us:
                end = time.perf_counter() + work_us / 1e6
                while time.perf_counter() < end:
                    pass
        conn.send((seqs, first, last, sub.stats().as_dict()))


def _run_stream(
    tmp: str,
    name: str,
    total: int,
    batches: list[KVEventBatch],
    pub_kwargs: dict,
    sub_hwm: int,
    work_us: float,
):
    endpoint, replay = f"ipc://{tmp}/{name}", f"ipc://{tmp}/{name}-replay"
    parent, child = mp.Pipe()
    proc = mp.get_context("spawn").Process(
        target=_subscriber_child, args=(endpoint, replay, total, sub_hwm, work_us, child)
    )
    with ZmqEventPublisher(endpoint, replay, **pub_kwargs) as pub:
        proc.start()
        assert parent.poll(60) and parent.recv() == "ready"
        time.sleep(0.5)  # let the subscription reach the publisher
        start = time.perf_counter()
        for i in range(total):
            pub.publish(batches[i % len(batches)])
        publish_s = time.perf_counter() - start
        assert parent.poll(120), f"{name}: subscriber did not finish"
        seqs, first, last, sub_stats = parent.recv()
        pub_stats = pub.stats()
    proc.join(10)
    in_order = all(b > a for a, b in zip(seqs, seqs[1:]))
    return seqs, first, last, sub_stats, pub_stats, publish_s, in_order


def bench_end_to_end(tmp: str) -> list[tuple]:
    rows = []
    for hashes, tokens in ((16, False), (64, True)):
        total = 50_000
        batches = make_batches(500, hashes, tokens)
        seqs, first, last, sub_stats, pub_stats, publish_s, in_order = _run_stream(
            tmp, f"e2e-{hashes}", total, batches, {}, 100_000, 0.0
        )
        rate = len(seqs) / (last - first) if last and first and last > first else float("nan")
        rows.append(
            (f"{EVENTS_PER_BATCH}x{hashes}", "yes" if tokens else "no", total, total / publish_s, rate,
             sub_stats["live"], sub_stats["replayed"], sub_stats["lost"], in_order)
        )  # fmt: skip
    return rows


def bench_burst(tmp: str) -> list[tuple]:
    rows = []
    total = 100_000
    batches = make_batches(500, 16, False)
    configs = [
        ("defaults (hwm 100k, queue 100k, buffer 10k)", {}, 100_000),
        ("hwm 1k both sides, buffer 10k", {"hwm": 1000}, 1000),
        ("hwm 1k, queue 1k, buffer 2k", {"hwm": 1000, "max_queue_size": 1000, "buffer_steps": 2000}, 1000),
    ]
    for i, (label, pub_kwargs, sub_hwm) in enumerate(configs):
        seqs, first, last, sub_stats, pub_stats, publish_s, in_order = _run_stream(
            tmp, f"burst-{i}", total, batches, pub_kwargs, sub_hwm, 20.0
        )
        delivered = len(seqs)
        exact = delivered + sub_stats["lost"] == total and len(set(seqs)) == delivered and in_order
        rows.append(
            (label, total, pub_stats.dropped_sends, delivered, sub_stats["live"], sub_stats["replayed"],
             sub_stats["lost"], total - delivered, "yes" if exact else "NO",
             last - first if last else float("nan"))
        )  # fmt: skip
    return rows


def table(headers: list[str], rows: list[tuple], formats: list[str]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(f.format(v) for f, v in zip(formats, row)) + " |")
    return "\n".join(lines)


def main() -> int:
    print(
        f"# KV events benchmark (python {sys.version.split()[0]}, {os.cpu_count()} CPUs, "
        f"load avg {os.getloadavg()[0]:.1f})\n"
    )
    if "--vllm-only" in sys.argv[1:]:
        print_vs_vllm()
        return 0
    print("## Encode (EventEncoder, 4 BlockStored events per batch)\n")
    print(table(
        [
            "format", "events x hashes", "token_ids", "input hashes",
            "payload B", "encode us/batch", "hashes/s", "decode us/batch",
        ],  # fmt: skip
        bench_encode(),
        ["{}", "{}", "{}", "{}", "{:,}", "{:.2f}", "{:,.0f}", "{:.2f}"],
    ))  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="kvbench-") as tmp:
        print("\n## publish() caller cost (map encoding, ipc, replay on, 10,000 calls)\n")
        print(table(
            ["events x hashes", "token_ids", "mean us", "p50 us", "p99 us", "dropped sends"],
            bench_publish(tmp),
            ["{}", "{}", "{:.2f}", "{:.2f}", "{:.2f}", "{}"],
        ))  # fmt: skip
        print("\n## End to end over ipc (subscriber in a child process)\n")
        print(table(
            [
                "events x hashes", "token_ids", "batches", "publish batches/s", "received batches/s",
                "live", "replayed", "lost", "in order",
            ],  # fmt: skip
            bench_end_to_end(tmp),
            ["{}", "{}", "{:,}", "{:,.0f}", "{:,.0f}", "{:,}", "{:,}", "{:,}", "{}"],
        ))  # fmt: skip
        print("\n## Burst: 100,000 batches, slow subscriber (20 us per batch), ipc\n")
        print(table(
            [
                "config", "published", "dropped sends", "delivered", "live", "replayed",
                "lost (counted)", "lost (actual)", "exact", "drain s",
            ],  # fmt: skip
            bench_burst(tmp),
            ["{}", "{:,}", "{:,}", "{:,}", "{:,}", "{:,}", "{:,}", "{:,}", "{}", "{:.1f}"],
        ))  # fmt: skip
    print()
    print_vs_vllm()
    return 0


if __name__ == "__main__":
    sys.exit(main())
