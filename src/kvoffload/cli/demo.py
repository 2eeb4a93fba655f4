"""``kvoffload demo``: the main job. A multi-turn chat workload on a real vLLM engine (CPU
build) whose KV cache is too small for the conversations, with and without kvoffload."""

from __future__ import annotations

import argparse
import os
import warnings


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="multi-turn chat on vLLM with and without kvoffload")
    p.add_argument("--conversations", type=int, default=6)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-tokens", type=int, default=2048)
    p.add_argument("--user-tokens", type=int, default=512)
    p.add_argument("--cpu-mib", type=int, default=512, help="kvoffload CPU tier size in MiB")
    p.add_argument("--model-dir", default=".cache/tiny-llama", help="where the tiny model is built")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    for name in ("conversations", "turns", "system_tokens", "user_tokens", "cpu_mib"):
        if getattr(args, name) <= 0:
            raise SystemExit(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # The demo's table is the output: keep vLLM's start-up chatter out of it.
    os.environ["VLLM_LOGGING_LEVEL"] = "ERROR"
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    warnings.simplefilter("ignore")
    from kvoffload.demo.chat_demo import ChatDemoConfig, main

    cfg = ChatDemoConfig(
        conversations=args.conversations,
        turns=args.turns,
        system_tokens=args.system_tokens,
        user_tokens=args.user_tokens,
        cpu_bytes=args.cpu_mib << 20,
        model_dir=args.model_dir,
    )
    return main(cfg)
