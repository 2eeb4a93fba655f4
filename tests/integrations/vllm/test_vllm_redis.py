"""End to end on real vLLM engines sharing one redis-server (``type: "redis"``): engine B
serves, from the shared tier, the prefix that engine A computed; with the server killed
mid-run and started again, no exception reaches the engine, outputs stay those of
recomputation, and the tier stores again after the recovery."""

import sys
import time

import pytest

pytest.importorskip("vllm")

from kvoffload.demo.offline import (
    close_llm,
    kv_block_bytes,
    make_llm,
    scheduler_connector,
    settle,
    word_text,
)
from kvoffload.demo.offline import (  # noqa: E402
    greedy as generate,
)
from redis_server import RedisServer  # noqa: E402
from vllm_reference import want  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

PROMPT = 2000  # tokens (one character each): 62 full blocks of 32 are offloaded
OFFLOADED = 62 * 32


@pytest.fixture(scope="module")
def model(tiny_llama: str) -> str:
    return tiny_llama


TEXTS = want(*(word_text(51 + i, PROMPT) for i in range(4)))


@pytest.fixture(scope="module")
def expected(reference):
    return {text: reference[text] for text in TEXTS}


def redis_engine(model, url):
    block = kv_block_bytes(model)
    extra = {
        "cpu_bytes_to_use": 70 * block,
        "secondary_tiers": [
            {"type": "redis", "url": url, "timeout_s": 1.0, "connect_timeout_s": 0.5, "probe_timeout_s": 1.0}
        ],  # fmt: skip
    }
    return make_llm(model, kvoffload=extra)


def shared_tier(llm):
    return scheduler_connector(llm)._scheduler.manager.secondaries[0]


def test_engine_b_serves_the_prefix_engine_a_computed(model, expected, tmp_path):
    first = next(iter(expected))
    server = RedisServer(tmp_path).start()
    try:
        a = redis_engine(model, server.url)
        try:
            assert generate(a, first) == (expected[first], 0)
            for _ in range(3):
                settle(a)  # the write-through to the shared tier
            assert server.client().dbsize() == 62
        finally:
            close_llm(a)

        b = redis_engine(model, server.url)  # a replica with an empty CPU tier
        try:
            assert sys.getswitchinterval() <= 0.0002  # lowered by the worker side (switch_interval_s)
            before = scheduler_connector(b).offload_stats().snapshot()
            assert generate(b, first) == (expected[first], OFFLOADED)
            after = scheduler_connector(b).offload_stats()
            assert after.blocks_loaded - before.blocks_loaded == 62
            assert after.failed_tier_transfers == 0
            assert shared_tier(b).counters().found == 62
        finally:
            close_llm(b)
    finally:
        server.stop()


def test_server_killed_and_restarted_mid_run(model, expected, tmp_path):
    texts = list(expected)
    server = RedisServer(tmp_path).start()
    try:
        llm = redis_engine(model, server.url)
        try:
            assert generate(llm, texts[0]) == (expected[texts[0]], 0)
            settle(llm)
            server.kill()
            for text in texts[1:3]:  # the server is gone: recomputed, same outputs, no exception
                assert generate(llm, text) == (expected[text], 0)
                settle(llm)
            server.start()
            # The worker's breaker lets a call through once its backoff (at most 10 s) is
            # over: one-block requests, each written through, until one reaches the server.
            deadline = time.monotonic() + 120  # a hang guard
            fillers = 0
            while server.client().dbsize() == 0:
                assert time.monotonic() < deadline, "the tier stored nothing within 120 s of the restart"
                fillers += 1
                generate(llm, word_text(900 + fillers, 40))
                for _ in range(3):
                    settle(llm)
            stored = server.client().dbsize()
            # one block per filler, 62 per request of the outage: none of those came back
            assert stored <= fillers < 62
            assert generate(llm, texts[3]) == (expected[texts[3]], 0)
            for _ in range(3):
                settle(llm)
            assert server.client().dbsize() == stored + 62  # the tier stores again
        finally:
            close_llm(llm)
    finally:
        server.stop()
