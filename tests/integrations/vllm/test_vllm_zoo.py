"""A model zoo end to end on the real engine (vLLM's CPU build), one tiny random model per
family (``kvoffload.demo.tiny_zoo``): dense Llama, sliding-window hybrid, MLA, GDN hybrid.

For each, with the CPU tier and a disk tier below it:
* outputs equal those of the engine without kvoffload: cold, and after a prefix-cache reset
  those of the engine's own prefix-cache hit of the same length (in bfloat16, MLA's cached
  path rounds differently from a full prefill: 3 of 10 prompts diverge without kvoffload);
* after the reset the prompt's prefix comes back from kvoffload (tokens reloaded), and the
  reloaded KV is byte for byte what the engine computed: the device cache is overwritten
  with noise first, and every offloaded page of each loaded block (each state, for a
  Mamba/GDN group) is compared with the page the first request left;
* a fresh engine on the same ``root_dir`` serves the prefix from the disk tier.

The engine's own cached path depends on the host: vLLM's CPU build runs MLA with its AMX
backend (prefix cache on, block size 32) where the CPU has AMX, and otherwise with its
reference ``CPU_MLA`` backend, for which it turns the prefix cache off (block size 16): the
engine never hits its own cache there, and the reference for a reload is vLLM's own
``ExampleConnector``, which saves a prompt's KV and loads it back through the same
cached-context path (``engine_reference``).
"""

import pytest

pytest.importorskip("vllm")
import torch  # noqa: E402

from kvoffload.demo.offline import (  # noqa: E402
    close_llm,
    greedy,
    host_transfer_engine,
    make_llm,
    scheduler_connector,
    settle,
    word_text,
    worker_connector,
)
from kvoffload.demo.tiny_zoo import FAMILIES, build_tiny_model, engine_args  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

PROMPT = 700  # tokens (one character is one token)
TOKENS = 8


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("zoo") / request.param, request.param)
    return request.param, str(path)


def engine(family, extra=None):
    name, path = family
    return make_llm(path, kvoffload=extra, max_model_len=2048, **engine_args(name))


class Blocks:
    """The device blocks and Mamba states vLLM hands the connector per request, recorded
    from the scheduler output every step (independent of kvoffload's bookkeeping)."""

    def __init__(self, llm):
        self._connector = scheduler_connector(llm)
        self._build = self._connector.build_connector_meta
        self.ids: dict[str, list[list[int]]] = {}
        self.states: dict[tuple[int, int], int] = {}  # (group, tokens) -> block of the state after them

    def __enter__(self):
        self._connector.build_connector_meta = self._record
        return self

    def __exit__(self, *exc):
        del self._connector.build_connector_meta

    def _record(self, out):
        for new in out.scheduled_new_reqs:
            self.ids[new.req_id] = [list(ids) for ids in new.block_ids]
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if cached.new_block_ids[i] is not None:
                for ids, new in zip(self.ids[req_id], cached.new_block_ids[i]):
                    ids.extend(new)
        handed = getattr(out, "kv_connector_block_state", None)
        for entries in (handed.boundary_state_offloads if handed else {}).values():
            self.states.update(((g, tokens), block) for g, block, tokens in entries)
        return self._build(out)

    def states_by_group(self):
        return [(g, block) for (g, _), block in self.states.items()]

    def only(self):
        (ids,) = self.ids.values()
        return ids


def scrub(llm, seed, dtype):
    """Empty the engine's prefix cache (kvoffload keeps its blocks) and overwrite every
    offloaded page on the device with noise: normal values of the model's dtype (random
    bytes would hold NaNs, which poison attention over a block's unused slots)."""
    settle(llm)
    assert llm.reset_prefix_cache() is True
    gen = torch.Generator().manual_seed(seed)
    for t in worker_connector()._worker.layout.tensors:
        t.view(dtype).normal_(generator=gen)


def pages(llm, group_blocks):
    """The bytes of every offloaded page of the given ``(group, device block)``s."""
    layout = worker_connector()._worker.layout
    return [torch.cat([layout.tensors[t][block] for t in layout.groups[g]]) for g, block in group_blocks]


def loaded_blocks(llm, first, second, loaded_tokens):
    """``(group, block)`` pairs of both requests that hold the reloaded tokens: each block
    of an attention group the second request got back (not null), and for a state group
    the state after the reloaded tokens."""
    groups = scheduler_connector(llm)._scheduler.scheduler.groups
    pairs_first, pairs_second = [], []
    for g, group in enumerate(groups):
        if not group.offloaded:
            continue
        n = loaded_tokens // group.block_size
        if group.is_state:
            pairs_first.append((g, first.states[g, loaded_tokens]))
            pairs_second.append((g, second.only()[g][n - 1]))
            continue
        for j in range(n):
            if second.only()[g][j] != 0:  # 0: the null block (outside a window)
                pairs_first.append((g, first.only()[g][j]))
                pairs_second.append((g, second.only()[g][j]))
    return pairs_first, pairs_second


def engine_reference(family, text, storage):
    """The engine's own outputs for ``text`` without kvoffload: ``(cold, through a cached
    context, that context's length)``. In bfloat16 (MLA) attending over a cached context
    rounds differently from a full prefill, so a reload is compared with the engine's own
    cached path of the same length (in float32 they agree).

    Where the engine keeps its prefix cache, the second request is its own hit. Where vLLM
    turned the prefix cache off (MLA on a CPU without AMX) that hit is always 0, whatever
    kvoffload does; the cached path is then taken through vLLM's ``ExampleConnector``
    (``storage``: its folder), whose hit is the prompt less its last token in whole blocks,
    the length a reload gives."""
    llm = engine(family)
    try:
        cold = greedy(llm, text, TOKENS)[0]
        hit_output, hit = greedy(llm, text, TOKENS)
        caching = llm.llm_engine.vllm_config.cache_config.enable_prefix_caching
    finally:
        close_llm(llm)
    if caching:
        assert hit > 0, "the engine's own prefix cache missed the prompt it just computed"
        return cold, hit_output, hit
    assert hit == 0, hit
    name, path = family
    example = {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(storage)},
    }
    llm = make_llm(path, max_model_len=2048, kv_transfer_config=example, **engine_args(name))
    try:
        assert greedy(llm, text, TOKENS) == (cold, 0)  # stores the prompt's KV
        hit_output, hit = greedy(llm, text, TOKENS)  # loads it back
    finally:
        close_llm(llm)
    assert hit > 0, "vLLM's ExampleConnector missed the prompt it just stored"
    return cold, hit_output, hit


def test_outputs_reloads_bytes_and_disk_across_engines(family, tmp_path):
    name, _ = family
    dtype = getattr(torch, engine_args(name).get("dtype", "float32"))
    text = word_text(31, PROMPT)
    expected, expected_hit, engine_hit = engine_reference(family, text, tmp_path / "example")

    extra = {
        "cpu_bytes_to_use": 128 << 20,
        "secondary_tiers": [{"type": "fs", "root_dir": str(tmp_path / "fs"), "bytes_to_use": 256 << 20}],
    }
    llm = engine(family, extra)
    try:
        # cpu_bytes_to_use buys whole blocks of the real size: every distinct page once
        layout = worker_connector()._worker.layout
        block_bytes = sum(layout.page_bytes(t) for t in range(len(layout.tensors)))
        primary = scheduler_connector(llm)._scheduler.manager.primary
        assert primary.stats().capacity == extra["cpu_bytes_to_use"] // block_bytes
        assert host_transfer_engine().host_pool.num_blocks == primary.stats().capacity
        scrub(llm, 1, dtype)
        with Blocks(llm) as first:
            assert greedy(llm, text, TOKENS) == (expected, 0)
        computed = {  # every page the first request left, before the next scrub
            (g, block): page
            for g, ids in enumerate(first.only())
            for block, page in zip(ids, pages(llm, [(g, block) for block in ids]))
        }
        computed.update(zip(first.states_by_group(), pages(llm, first.states_by_group())))
        scrub(llm, 2, dtype)
        with Blocks(llm) as second:
            output, cached = greedy(llm, text, TOKENS)
        reloaded = scheduler_connector(llm).offload_stats().tokens_loaded
        assert cached == engine_hit and reloaded == cached, (cached, engine_hit, reloaded)
        want, got = loaded_blocks(llm, first, second, cached)
        assert want
        for (g, block), x in zip(want, pages(llm, got)):
            assert torch.equal(x, computed[g, block]), (
                f"{name}: group {g} block {block} differs after the reload"
            )
        assert output == expected_hit
        settle(llm)
    finally:
        close_llm(llm)

    llm = engine(family, extra)  # a fresh engine: empty CPU tier, the same disk tier
    try:
        output, cached = greedy(llm, text, TOKENS)
        sources = scheduler_connector(llm)._scheduler.scheduler.tokens_by_source
    finally:
        close_llm(llm)
    assert output == expected_hit
    assert cached == engine_hit and sources.get("DISK", 0) > 0, (cached, sources)


def test_the_hybrid_shares_its_blocks_through_the_redis_tier(tmp_path_factory, tmp_path):
    """Engine A computes a prompt on the sliding-window hybrid; engine B, a replica with an
    empty CPU tier, serves its prefix from the shared Redis tier, with A's outputs."""
    from redis_server import RedisServer

    hybrid = (
        "sliding_window",
        str(build_tiny_model(tmp_path_factory.mktemp("zoo") / "hybrid", "sliding_window")),
    )
    text = word_text(33, PROMPT)
    server = RedisServer(tmp_path).start()
    try:
        extra = {
            "cpu_bytes_to_use": 128 << 20,
            "secondary_tiers": [{"type": "redis", "url": server.url, "timeout_s": 1.0}],
        }
        a = engine(hybrid, extra)
        try:
            expected, cached = greedy(a, text, TOKENS)
            assert cached == 0
            for _ in range(3):
                settle(a)  # the write-through to the shared tier
            stored = server.client().dbsize()
        finally:
            close_llm(a)
        assert stored >= 2 * (PROMPT // 2 // 32)  # blocks of both groups

        b = engine(hybrid, extra)
        try:
            output, cached = greedy(b, text, TOKENS)
            sources = scheduler_connector(b)._scheduler.scheduler.tokens_by_source
            failed = scheduler_connector(b).offload_stats().failed_tier_transfers
        finally:
            close_llm(b)
    finally:
        server.stop()
    assert output == expected
    assert cached >= PROMPT // 2 and sources.get("REMOTE", 0) > 0, (cached, sources)
    assert failed == 0
