"""End to end on real vLLM engines sharing one Mooncake Store (``type: "mooncake"``): engine
B serves, from the store, the prefix that engine A computed; with the master killed
mid-run and started again, no exception reaches the engine, outputs stay those of
recomputation (what the restarted master lost is recomputed), nothing hangs, and blocks
stored after the restart are shared again."""

import time

import pytest

pytest.importorskip("vllm")

from kvoffload.demo.offline import (  # noqa: E402
    close_llm,
    kv_block_bytes,
    make_llm,
    scheduler_connector,
    settle,
    word_text,
)
from kvoffload.demo.offline import greedy as generate  # noqa: E402
from mooncake_server import MooncakeServer  # noqa: E402
from vllm_reference import want  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.mooncake, pytest.mark.slow, pytest.mark.timeout(900)]

PROMPT = 2000  # tokens (one character each): 62 full blocks of 32 are offloaded
OFFLOADED = 62 * 32


@pytest.fixture(scope="module")
def model(tiny_llama: str) -> str:
    return tiny_llama


TEXTS = want(*(word_text(71 + i, PROMPT) for i in range(4)))


@pytest.fixture(scope="module")
def expected(reference):
    return {text: reference[text] for text in TEXTS}


def mooncake_engine(model, server, **tier):
    extra = {"cpu_bytes_to_use": 70 * kv_block_bytes(model), "secondary_tiers": [server.tier_config(**tier)]}
    return make_llm(model, kvoffload=extra)


def shared_tier(llm):
    return scheduler_connector(llm)._scheduler.manager.secondaries[0]


def served_from_the_store(model, server, text, expected):
    """A replica with an empty CPU tier serves ``text`` from the store: every offloaded
    block loaded, none failed, outputs those of recomputation."""
    b = mooncake_engine(model, server)
    try:
        before = scheduler_connector(b).offload_stats().snapshot()
        assert generate(b, text) == (expected, OFFLOADED)
        after = scheduler_connector(b).offload_stats()
        assert after.blocks_loaded - before.blocks_loaded == 62
        assert after.failed_tier_transfers == 0
        assert shared_tier(b).counters().found == 62
    finally:
        close_llm(b)


def test_engine_b_serves_the_prefix_engine_a_computed(model, expected, tmp_path):
    first = next(iter(expected))
    server = MooncakeServer(tmp_path, segment=256 << 20).start()
    try:
        a = mooncake_engine(model, server)
        try:
            assert generate(a, first) == (expected[first], 0)
            for _ in range(3):
                settle(a)  # the write-through to the store
            assert server.key_count() == 62
        finally:
            close_llm(a)
        served_from_the_store(model, server, first, expected[first])
    finally:
        server.stop()


def test_master_killed_and_restarted_mid_run(model, expected, tmp_path):
    texts = list(expected)
    server = MooncakeServer(tmp_path, segment=256 << 20).start()
    try:
        # the breaker's backoff capped at 1 s (10 s by default): the restart is noticed sooner
        llm = mooncake_engine(model, server, retry_max_s=1.0)
        try:
            assert generate(llm, texts[0]) == (expected[texts[0]], 0)
            for _ in range(3):
                settle(llm)
            assert server.key_count() == 62
            server.kill()
            for text in texts[1:3]:  # the master is gone: recomputed, same outputs, no exception
                assert generate(llm, text) == (expected[text], 0)
                settle(llm)
            assert shared_tier(llm).counters().outages >= 1
            server.start()  # empty: texts[0]'s blocks, still in the index, are gone
            assert llm.reset_prefix_cache()  # texts[0] is neither on the device nor in the CPU tier
            before = scheduler_connector(llm).offload_stats().failed_tier_transfers
            output, cached = generate(llm, texts[0])
            assert output == expected[texts[0]]
            # The restarted master lost its blocks: a miss, or (while the index has not yet
            # heard) a promotion that fails on the missing objects, recomputed: never an error.
            assert cached == 0 or scheduler_connector(llm).offload_stats().failed_tier_transfers > before
            deadline = time.monotonic() + 120  # a hang guard: the breaker retries within retry_max_s
            filler = 0
            while server.key_count() == 0:  # until a write-through reaches the new master
                assert time.monotonic() < deadline, "the tier stored nothing within 120 s of the restart"
                filler += 1
                generate(llm, word_text(900 + filler, 200))
                settle(llm)
            assert generate(llm, texts[3]) == (expected[texts[3]], 0)
            for _ in range(3):
                settle(llm)
        finally:
            close_llm(llm)
        served_from_the_store(model, server, texts[3], expected[texts[3]])  # shared again
    finally:
        server.stop()
