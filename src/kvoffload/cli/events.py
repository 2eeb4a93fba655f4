"""``kvoffload events tail ENDPOINT``: subscribe to a KV event publisher and print each
event on one line; on exit (end of ``--max-batches``, ``--timeout`` or Ctrl-C) print the
subscriber's counters, then the same counters as ``kvoffload.metrics`` exposes them (one
``name value`` line each). ``--metrics-port`` serves them over HTTP while it runs
(``--metrics-host``, 127.0.0.1 by default)."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time

from kvoffload import metrics
from kvoffload.events import AllBlocksCleared, BlockRemoved, BlockStored, EventSubscriber, KVEvent

IDLE_CATCH_UP_S = 1.0
REPLAY_TIMEOUT_S = 1.0  # a tail waits this long for a replay answer (and, at worst, to exit)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("events", help="inspect KV event streams")
    actions = p.add_subparsers(dest="events_command", required=True)
    tail = actions.add_parser("tail", help="print the events a publisher sends, one line each")
    tail.add_argument(
        "endpoint", help="publisher endpoint, e.g. tcp://127.0.0.1:5557, ipc:///tmp/kv or a port"
    )
    tail.add_argument("--replay", metavar="ENDPOINT", help="replay endpoint used to fill gaps")
    tail.add_argument("--topic", default="", help="topic prefix to subscribe to (default: all)")
    tail.add_argument("--from-start", action="store_true", help="backfill from sequence 0 via replay on join")
    tail.add_argument("--max-batches", type=int, metavar="N", help="exit after N batches")
    tail.add_argument("--timeout", type=float, metavar="SECONDS", help="exit after this many seconds")
    tail.add_argument("--data-parallel-rank", type=int, default=0, help="rank whose endpoints to derive")
    tail.add_argument(
        "--metrics-port", type=int, metavar="PORT", help="serve the counters on /metrics (Prometheus)"
    )
    tail.add_argument(
        "--metrics-host", default="127.0.0.1", help="address for --metrics-port (default 127.0.0.1)"
    )
    tail.set_defaults(run=run_tail)


def format_event(seq: int, ts: float, rank: int | None, event: KVEvent) -> str:
    head = f"seq={seq} ts={ts:.6f} dp={rank}"
    if isinstance(event, BlockStored):
        return (
            f"{head} BlockStored medium={event.medium} group={event.group_idx} "
            f"blocks={len(event.block_hashes)} block_size={event.block_size} tokens={len(event.token_ids)} "
            f"parent={_hash(event.parent_block_hash)} "
            f"hashes={_hashes(event.block_hashes)}"
        )
    if isinstance(event, BlockRemoved):
        return (
            f"{head} BlockRemoved medium={event.medium} group={event.group_idx} "
            f"blocks={len(event.block_hashes)} hashes={_hashes(event.block_hashes)}"
        )
    if isinstance(event, AllBlocksCleared):
        return f"{head} AllBlocksCleared"
    return f"{head} {event!r}"


def _hash(value: int | bytes | None) -> str:
    if value is None:
        return "-"
    return f"{value:016x}" if isinstance(value, int) else value.hex()


def _hashes(values: list) -> str:
    shown = ",".join(_hash(v) for v in values[:4])
    return shown + (f",...(+{len(values) - 4})" if len(values) > 4 else "")


def run_tail(args: argparse.Namespace) -> int:
    if args.max_batches is not None and args.max_batches <= 0:
        raise SystemExit(f"--max-batches must be a positive integer, got {args.max_batches}")
    if args.timeout is not None and args.timeout <= 0:
        raise SystemExit(f"--timeout must be a positive number of seconds, got {args.timeout}")
    if args.metrics_port is not None and not 0 <= args.metrics_port <= 65535:
        raise SystemExit(f"--metrics-port must be a port in 0..65535, got {args.metrics_port}")
    try:
        subscriber = EventSubscriber(
            args.endpoint,
            args.replay,
            args.topic,
            start_seq=0 if args.from_start else None,
            data_parallel_rank=args.data_parallel_rank,
            replay_timeout=REPLAY_TIMEOUT_S,
        )
    except ValueError as exc:
        raise SystemExit(f"kvoffload events tail: {exc}") from None
    source = metrics.SubscriberSource(subscriber)
    server = None
    if args.metrics_port is not None:
        metrics.register(source)
        try:
            server = metrics.serve(args.metrics_port, args.metrics_host)
        except OSError as exc:
            subscriber.close()
            raise SystemExit(f"kvoffload events tail: --metrics-port {args.metrics_port}: {exc}") from None
    deadline = None if args.timeout is None else time.monotonic() + args.timeout
    batches = 0
    # Ctrl-C (SIGINT) ends the loop at its next turn (a receive waits at most 0.2 s, a
    # catch-up at most REPLAY_TIMEOUT_S) instead of raising wherever the main thread is.
    # (Signals reach the main thread only: run from another thread, e.g. embedded, no handler.)
    interrupted = threading.Event()
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, lambda signum, frame: interrupted.set()) if main_thread else None
    # A dropped *last* batch leaves no gap to notice, so an idle stream is checked by replay.
    next_catch_up = time.monotonic() if args.from_start else time.monotonic() + IDLE_CATCH_UP_S
    try:
        while not interrupted.is_set() and (args.max_batches is None or batches < args.max_batches):
            if args.replay and time.monotonic() >= next_catch_up:
                subscriber.catch_up()
                next_catch_up = time.monotonic() + IDLE_CATCH_UP_S
            # Short waits keep --timeout exact and let Ctrl-C through promptly.
            wait = 0.2 if deadline is None else min(0.2, deadline - time.monotonic())
            if wait <= 0:
                break
            item = subscriber.receive(wait)
            if item is None:
                continue
            next_catch_up = time.monotonic() + IDLE_CATCH_UP_S
            seq, batch = item
            batches += 1
            for event in batch.events:
                print(format_event(seq, batch.ts, batch.data_parallel_rank, event), flush=True)
    finally:
        if main_thread:
            signal.signal(signal.SIGINT, previous)
        counters = " ".join(f"{k}={v}" for k, v in subscriber.stats().as_dict().items())
        print(f"batches={batches} {counters}", file=sys.stderr, flush=True)
        for line in metrics.exposition_lines([source]):
            print(line, file=sys.stderr, flush=True)
        if server is not None:
            server.shutdown()
            metrics.unregister(source)
        subscriber.close()
    return 130 if interrupted.is_set() else 0
