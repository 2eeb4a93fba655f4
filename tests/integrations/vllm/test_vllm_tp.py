"""Tensor parallelism (TP=2) on vLLM's CPU build with the CPU, disk and Redis tiers, end to
end: ``tests/vllm_tp_driver.py`` runs the engines in a process of its own (vLLM's
multiprocessing executor) against a ``redis-server`` this test starts; see the driver for
the phases and what each checks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from redis_server import RedisServer, require_redis_server  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
DRIVER = ROOT / "tests" / "vllm_tp_driver.py"
PHASES = ["reload", "partial"]

pytestmark = [pytest.mark.vllm, pytest.mark.redis, pytest.mark.slow, pytest.mark.timeout(600)]


def test_tensor_parallel_engine_with_every_tier(tiny_llama, tmp_path):
    require_redis_server()
    server = RedisServer(tmp_path).start()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(DRIVER.parent)])}
    env.pop("LD_PRELOAD", None)  # what an in-process vLLM engine of an earlier test left here
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    try:
        proc = subprocess.run(
            [sys.executable, str(DRIVER), tiny_llama, str(tmp_path / "kv"), server.url],
            capture_output=True,
            text=True,
            env=env,
            timeout=540,
        )
    finally:
        server.stop()
    passed = [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("OK ")]
    assert proc.returncode == 0 and passed == PHASES, proc.stdout[-2000:] + proc.stderr[-6000:]
