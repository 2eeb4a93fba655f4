"""End to end on a real vLLM engine with the local-disk tier (``type: "fs"``) under a
small CPU tier: a prefix evicted from the CPU tier is served from disk, and an engine
started again on the same ``root_dir`` serves an earlier prompt's prefix from disk; the
outputs are those of the engine computing everything itself."""

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
from vllm_reference import want  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

PROMPT = 2000  # tokens (one character each): 62 full blocks of 32 are offloaded
OFFLOADED = 62 * 32
FIRST, SECOND = want(word_text(41, PROMPT), word_text(42, PROMPT))


@pytest.fixture(scope="module")
def model(tiny_llama: str) -> str:
    return tiny_llama


def fs_engine(model, root):
    block = kv_block_bytes(model)
    extra = {
        "cpu_bytes_to_use": 70 * block,  # the second prompt's 62 blocks evict most of the first's
        "secondary_tiers": [{"type": "fs", "root_dir": str(root), "bytes_to_use": 400 * (block + 4096)}],
    }
    return make_llm(model, kvoffload=extra)


def disk_stats(llm):
    manager = scheduler_connector(llm)._scheduler.manager
    return manager.tier_stats()[1]


def test_served_from_disk_and_again_after_a_restart(model, reference, tmp_path):
    first, second = FIRST, SECOND
    expected = {text: reference[text] for text in (first, second)}  # an engine without kvoffload

    llm = fs_engine(model, tmp_path / "kv")
    try:
        assert generate(llm, first) == (expected[first], 0)
        settle(llm)
        assert generate(llm, second) == (expected[second], 0)
        for _ in range(3):
            settle(llm)  # the write-through of both prompts
        assert (disk_stats(llm).used, disk_stats(llm).in_flight) == (124, 0)
        assert llm.reset_prefix_cache()
        before = scheduler_connector(llm).offload_stats().snapshot()
        assert generate(llm, first) == (expected[first], OFFLOADED)  # most of it from disk
        after = scheduler_connector(llm).offload_stats()
        assert after.blocks_loaded - before.blocks_loaded == 62
        assert after.failed_tier_transfers == 0
    finally:
        close_llm(llm)

    llm = fs_engine(model, tmp_path / "kv")  # a new engine on the same root_dir
    try:
        assert disk_stats(llm).used == 124  # the index was rebuilt from the files
        assert generate(llm, second) == (expected[second], OFFLOADED)  # all of it from disk
    finally:
        close_llm(llm)
