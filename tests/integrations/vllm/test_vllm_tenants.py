"""Tenant isolation end to end on a real vLLM engine (CPU build, tiny Llama): the same
prompt under another ``cache_salt`` gets nothing from kvoffload (nor from vLLM's own
prefix cache), the same salt after ``reset_prefix_cache`` gets its prefix from kvoffload,
every output equals recomputation, and the CPU tier's ``BlockStored`` events carry the
salt in ``extra_keys`` exactly as the engine's own ``GPU`` events do."""

import pytest

pytest.importorskip("vllm")

from kvoffload.demo.offline import close_llm, greedy, make_llm, scheduler_connector, settle, word_text  # noqa: E402
from kvoffload.events.types import BlockStored  # noqa: E402
from vllm_events_sink import Subscriber, drain  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

PROMPT = 2000  # tokens: 62 full blocks of 32 are offloaded, the engine computes the rest
OFFLOADED = 62 * 32


def generate(llm, text, salt=None):
    return greedy(llm, {"prompt": text} if salt is None else {"prompt": text, "cache_salt": salt})


def loaded(llm) -> int:
    return scheduler_connector(llm).offload_stats().tokens_loaded


def test_another_salt_never_shares_offloaded_blocks(tiny_llama: str):
    model = tiny_llama
    text = word_text(7, PROMPT)
    sub = Subscriber()
    llm = make_llm(
        model, kvoffload={"cpu_bytes_to_use": 256 << 20}, events_endpoint=f"tcp://127.0.0.1:{sub.port}"
    )
    try:
        expected, cached = generate(llm, text, "tenant-a")  # computed from scratch
        assert cached == 0 and loaded(llm) == 0
        settle(llm)  # tenant A's blocks are now in the CPU tier (and still on the device)

        # the same prompt under another salt: nothing from the device cache nor kvoffload
        assert generate(llm, text, "tenant-b") == (expected, 0)
        assert loaded(llm) == 0
        settle(llm)
        assert generate(llm, text) == (expected, 0)  # no salt is a tenant of its own
        assert loaded(llm) == 0
        settle(llm)

        # tenant A again, with the device cache emptied: its prefix comes from kvoffload
        assert llm.reset_prefix_cache()
        assert generate(llm, text, "tenant-a") == (expected, OFFLOADED)
        assert loaded(llm) == OFFLOADED
        settle(llm)
        assert llm.reset_prefix_cache()
        assert generate(llm, text, "tenant-b") == (expected, OFFLOADED)  # and B its own
        assert loaded(llm) == 2 * OFFLOADED
        settle(llm)

        drain(llm, sub)
        stored = [e for e in sub.events if isinstance(e, BlockStored)]
        gpu = {h: e.extra_keys[i] for e in stored if e.medium == "GPU" for i, h in enumerate(e.block_hashes)}
        chains: dict[object, set] = {}  # salt of a chain's first block -> its hashes
        for e in (e for e in stored if e.medium == "CPU"):
            assert e.extra_keys is None or len(e.extra_keys) == len(e.block_hashes)
            for i, h in enumerate(e.block_hashes):
                extra = None if e.extra_keys is None else e.extra_keys[i]
                assert extra == gpu[h]  # what vLLM's engine says of the same block
                if e.parent_block_hash is None and i == 0:
                    chain = chains.setdefault(extra, set())
                chain.add(h)
        # three tenants, 62 blocks each, no block shared
        assert {k: len(v) for k, v in chains.items()} == {("tenant-a",): 62, ("tenant-b",): 62, None: 62}
    finally:
        close_llm(llm)
        sub.close()
