"""The ``kvoffload`` command. Each subcommand lives in its own module of this package
and exposes ``add_parser(subparsers)``, which registers it with a ``run(args)`` handler."""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = ("demo", "events", "index", "sim")
DESCRIPTION = (
    "kvoffload: offload the KV cache of LLM serving engines to cheaper tiers. "
    "Run the engine demo, replay traces for capacity planning, inspect KV event streams, "
    "or serve a KV-block index of many engines."
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvoffload", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMANDS:
        importlib.import_module(f"kvoffload.cli.{name}").add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
