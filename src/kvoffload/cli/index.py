"""``kvoffload index serve``: the KV-block index as an HTTP service (``kvoffload.index.server``).

Binds 127.0.0.1 by default. Publishers are registered over HTTP (``POST /register``) or at
start with ``--worker '{"instance_id": ..., "endpoint": ..., "model_name": ...,
"block_size": ...}'`` (repeatable). Runs until SIGINT or SIGTERM, then stops every
subscriber and exits 0."""

from __future__ import annotations

import argparse
import json
import signal
import threading

from kvoffload.extras import require
from kvoffload.keys import DEFAULT_HASH_SEED

DEFAULT_PORT = 8090


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("index", help="index KV events of many engines and serve prefix scores over HTTP")
    actions = p.add_subparsers(dest="index_command", required=True)
    serve = actions.add_parser("serve", help="run the HTTP index service")
    serve.add_argument("--host", default="127.0.0.1", help="interface to bind (default: 127.0.0.1)")
    serve.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT}; 0: any)"
    )
    serve.add_argument(
        "--weights",
        default="",
        metavar="TIER=W,...",
        help="tier weights, e.g. host=0.75,disk=0.25,shared=0.5",
    )
    serve.add_argument(
        "--hash-seed",
        default=DEFAULT_HASH_SEED,
        help="seed of the sha256_cbor chain /query hashes tokens with",
    )
    serve.add_argument(
        "--no-hash", action="store_true", help="/query uses only token chains learned from events"
    )
    serve.add_argument("--replay-timeout", type=float, default=2.0, metavar="SECONDS")
    serve.add_argument(
        "--worker", action="append", default=[], metavar="JSON", help="register a publisher at start"
    )
    serve.set_defaults(run=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    require("aiohttp", "index", "kvoffload index serve")
    from kvoffload.index import BlockIndex, IndexServer, IndexService, Registration, TierWeights

    if not 0 <= args.port <= 65535:
        raise SystemExit(f"--port must be in [0, 65535], got {args.port}")
    try:
        weights = TierWeights.parse(args.weights)
        index = BlockIndex(weights, hash_seed=None if args.no_hash else args.hash_seed)
        service = IndexService(index, replay_timeout=args.replay_timeout)
    except ValueError as exc:
        raise SystemExit(f"kvoffload index serve: {exc}") from None
    try:
        for text in args.worker:
            try:
                fields = json.loads(text)
                if not isinstance(fields, dict):
                    raise ValueError(f"--worker must be a JSON object, got {text!r}")
                service.register(Registration(**fields))
            except (ValueError, TypeError) as exc:
                raise SystemExit(f"kvoffload index serve: --worker {text!r}: {exc}") from None
        server = IndexServer(service, args.host, args.port).start()
    except BaseException:
        service.close()
        raise
    stop = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())  # before anyone can know the URL
    print(f"kvoffload index serving on {server.url}", flush=True)
    try:
        while not stop.wait(0.5):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        server.stop()
    return 0
