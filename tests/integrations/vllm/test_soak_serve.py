"""The soak's short form (``bench/soak_serve.py --short``): vLLM's OpenAI server with
kvoffload (CPU + disk on a small tmpfs + Redis) driven by vLLM's own ``vllm bench serve``
(the shared Mooncake trace's multi-turn conversations, then ``prefix_repetition``) while
Redis is killed with SIGKILL and started again, the disk tier's file system is filled to
ENOSPC and freed (full from before the first store), and loads and stores fail on purpose
(``fault_injection``: a 5% rate and fixed positions, so some fail on every run). A server
without a connector gets the same prompts.

Asserted: no request fails; every request's greedy output equals the server's without
kvoffload; each fault fired while the load ran; the engine's threads and open files at the
end are no more than after warm-up plus a small slack; kvoffload served hits during the
trace phase. Faults are triggered by requests finished, not by the clock; the test asserts
no timing (the timings go to the benchmark's report).

Replays the shared trace where it is beside the checkout (``../shared/traces/``), a
synthetic conversation trace in its format otherwise (``_soak_run.synthetic_trace``); needs
root to mount the tmpfs (skipped otherwise). Every process it starts is stopped by its PID
when it ends, also on failure (``ServerRun.close``; leftover Redis servers by conftest).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

BENCH = Path(__file__).resolve().parents[3] / "bench"
sys.path.insert(0, str(BENCH))

from _soak_run import TRACE, synthetic_trace  # noqa: E402
from redis_server import RedisServer, require_redis_server  # noqa: E402,F401 (marks the module redis)
from soak_serve import run, short_config  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

# Threads the engine process may start after warm-up, once, and keep: the Redis tier's I/O
# pool (a ThreadPoolExecutor of io_threads = 2) starts its threads on first use, which is
# when the server is down and jobs leave the lanes. Runs here went from 65 threads after
# warm-up to 67 after the first Redis kill and stayed there; a leak grows with every fault
# cycle and request, far past this.
THREAD_SLACK = 4
# Open files: the disk tier's slot files are opened at start-up (their count must not grow
# at all); Redis connections are pooled and reopened after a restart (+1 seen here).
FD_SLACK = 8


@pytest.fixture(scope="module")
def soak(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.skip("mounting the disk tier's tmpfs needs root")
    require_redis_server()
    root = tmp_path_factory.mktemp("soak")
    cfg = short_config(root / "work")
    if not TRACE.exists():  # a clone elsewhere: kvoffload's own conversations, same format
        print(f"the shared trace is not beside the checkout ({TRACE}): a synthetic chat trace")
        cfg = dataclasses.replace(cfg, trace_path=synthetic_trace(root / "chat-trace.jsonl"))
    out = run(cfg, root / "model", parallel_start=True, log=lambda line: print(line, flush=True))
    return out["summary"]["servers"], out["reports"]


def test_no_request_fails_and_every_phase_is_served(soak):
    servers, reports = soak
    for kind in ("kvoffload", "baseline"):
        assert servers[kind]["errors"] == 0, reports[kind]["phases"]
        for phase, p in servers[kind]["phases"].items():
            assert p["served"] == reports[kind]["phases"][phase]["result"]["num_prompts"], (kind, phase)


def test_outputs_equal_the_server_without_kvoffload(soak):
    servers, _ = soak
    compared = servers["kvoffload"]["outputs_vs_baseline"]
    for phase, p in servers["kvoffload"]["phases"].items():
        assert compared[phase]["compared"] == p["served"], phase
        assert compared[phase]["differ"] == 0, (phase, compared[phase])


def test_every_fault_fired_while_the_load_ran(soak):
    servers, _ = soak
    faults = servers["kvoffload"]["faults"]
    assert servers["kvoffload"]["tmpfs_mounted"]
    assert not [f for f in faults if "error" in f], faults
    for action in ("kill_redis", "start_redis", "fill_disk", "free_disk"):
        assert any(f["action"] == action and f["during_load"] for f in faults), (action, faults)
    filled = [f for f in faults if f["action"] == "fill_disk"]
    assert all(f["filler_bytes"] > 0 for f in filled)
    injected = sum(p["failed_loads"] + p["failed_stores"] for p in servers["kvoffload"]["phases"].values())
    assert injected > 0


def test_the_disk_tier_declines_on_a_full_disk_and_stores_again_after(soak):
    """The disk is full before the tier's first write (its space is reserved ahead, on that
    write: a later fill leaves reserved space alone); the trace phase frees it early."""
    servers, _ = soak
    phases = servers["kvoffload"]["phases"]
    counters = [phases[p]["tier_counters"] for p in ("warmup", "trace", "prefix", "after")]
    refused = sum(c.get("1:fs/floor_declines", 0) + c.get("1:fs/no_space", 0) for c in counters)
    assert refused > 0, counters
    assert sum(c.get("1:fs/stores", 0) for c in counters[1:]) > 0, counters


def test_threads_and_open_files_stay_flat(soak):
    servers, _ = soak
    for kind in ("kvoffload", "baseline"):
        res = servers[kind]["resources"]
        assert res["threads"]["last"] <= res["threads"]["warmup"] + THREAD_SLACK, (kind, res)
        assert res["fds"]["last"] <= res["fds"]["warmup"] + FD_SLACK, (kind, res)
    res = servers["kvoffload"]["resources"]
    assert res["kvoffload_files"]["last"] <= res["kvoffload_files"]["warmup"]
    assert res["kvoffload_files"]["warmup"] > 0  # the disk tier's files are what is sampled
    assert res["redis_sockets"]["last"] <= res["redis_sockets"]["warmup"] + FD_SLACK


def test_kvoffload_serves_hits(soak):
    """In the trace phase on the shared trace's conversations; the synthetic trace's few
    conversations stay in the engine's own cache, so there in the prefix phase."""
    servers, _ = soak
    phase = "trace" if TRACE.exists() else "prefix"
    figures = servers["kvoffload"]["phases"][phase]
    assert figures["connector_hit_ratio"] > 0, (phase, figures)
    assert servers["baseline"]["phases"][phase]["connector_hit_ratio"] == 0
