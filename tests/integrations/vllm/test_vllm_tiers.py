"""End to end on a real vLLM engine with a secondary tier under the CPU tier.

The tier is the test's own "shelf" (``tests/shelf_tier.py``, loaded the way an
out-of-tree tier is, by ``package.module:ClassName``): it keeps blocks as bytes, so these
tests check the tiering path itself (write-through, promotion, the scheduler and the
worker routing) on the real engine, independent of any storage medium.
"""

import contextlib

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
from shelf_tier import ShelfTierType  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

PROMPT = 2000  # tokens (one character each): 62 full blocks of 32 are offloaded
OFFLOADED = 62 * 32


@pytest.fixture(scope="module")
def llm(tiny_llama: str):
    model = tiny_llama
    # The CPU tier holds 70 blocks: the second prompt's 62 evict most of the first one's.
    extra = {
        "cpu_bytes_to_use": 70 * kv_block_bytes(model),
        "secondary_tiers": [{"type": "shelf_tier:ShelfTierType", "blocks": 512}],
    }
    engine = make_llm(model, kvoffload=extra)
    try:
        yield engine
    finally:
        close_llm(engine)


def test_a_prefix_evicted_from_the_cpu_tier_comes_back_from_the_secondary(llm):
    first, second = word_text(21, PROMPT), word_text(22, PROMPT)
    expected, cached = generate(llm, first)
    assert cached == 0
    settle(llm)
    assert generate(llm, second)[1] == 0
    settle(llm)  # write-through of the second prompt's blocks
    settle(llm)
    shelf = ShelfTierType.last_worker
    assert len(shelf.shelf) == 124  # every block of both prompts reached the shelf
    stats = scheduler_connector(llm).offload_stats().snapshot()
    tiers = scheduler_connector(llm)._scheduler.manager.tier_stats()
    assert (tiers[0].used, tiers[1].used) == (70, 124)
    assert llm.reset_prefix_cache()  # the engine's own cache: the prefix must come from kvoffload
    with counted_steps(llm) as steps:
        assert generate(llm, first) == (expected, OFFLOADED)
    after = scheduler_connector(llm).offload_stats()
    assert after.blocks_loaded - stats.blocks_loaded == 62
    assert after.failed_tier_transfers == 0
    # One scheduler round trip: the step that plans the promotion plans the load chained on
    # it (within the step: the hit fits sync_load_budget_bytes), and that very step runs
    # the forward pass; the two-step path spent at least one step without one first.
    tokens, plans = zip(*steps)
    assert tokens[0] > 0, tokens[:4]
    promotions = [job for job in plans[0].transfers if job.src_spec.medium == "SHELF"]
    assert len(promotions) == 1 and len(plans[0].loads) == 1
    assert sum(len(plan.loads) for plan in plans) == 1


@contextlib.contextmanager
def counted_steps(llm):
    """The engine's steps while in the block: ``(tokens scheduled, StepPlan)`` each."""
    side = scheduler_connector(llm)._scheduler
    build = side.build_connector_meta
    steps = []

    def counted(out):
        meta = build(out)
        steps.append((out.total_num_scheduled_tokens, meta.plan))
        return meta

    side.build_connector_meta = counted
    try:
        yield steps
    finally:
        del side.build_connector_meta


def test_a_failed_read_below_is_recomputed_and_the_block_dropped(llm):
    first, second = word_text(31, PROMPT), word_text(32, PROMPT)
    expected, _ = generate(llm, first)
    settle(llm)
    generate(llm, second)
    settle(llm)
    settle(llm)
    shelf = ShelfTierType.last_worker
    shelf.fail_reads = True
    try:
        assert llm.reset_prefix_cache()
        before = scheduler_connector(llm).offload_stats().snapshot()
        # The CPU tier evicts a prompt's deepest blocks first: it kept the first prompt's
        # first 8 blocks, and the rest must come from below. The load is chained on their
        # promotion, which fails: the load fails unrun, the blocks are dropped below, and
        # the engine recomputes the request (vLLM's count of cached tokens stays that of
        # its first schedule).
        assert generate(llm, first)[0] == expected
        after = scheduler_connector(llm).offload_stats()
        assert after.failed_tier_transfers == before.failed_tier_transfers + 1
        assert after.failed_loads == before.failed_loads + 1
        assert after.failed_load_tokens - before.failed_load_tokens == OFFLOADED
    finally:
        shelf.fail_reads = False
