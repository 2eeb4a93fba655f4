"""End to end on a real vLLM engine (CPU build) with a tiny random Llama built offline."""

import random

import pytest

pytest.importorskip("vllm")
import torch  # noqa: E402

from kvoffload.demo.offline import (
    close_llm,
    host_transfer_engine,
    kv_block_bytes,
    make_llm,
    scheduler_connector,
    settle,
    word_text,
    worker_connector,
)
from kvoffload.demo.offline import (  # noqa: E402
    greedy as generate,
)
from kvoffload.demo.tiny_model import build_tiny_llama  # noqa: E402
from kvoffload.events.types import BlockRemoved, BlockStored  # noqa: E402
from vllm_events_sink import Subscriber, drain  # noqa: E402
from vllm_reference import want  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]


def prompt(seed: int, n: int = 2000) -> str:
    return word_text(seed, n)  # byte tokenizer: n tokens


want(prompt(1), prompt(2))


@pytest.fixture(scope="module")
def model_path(tiny_llama: str) -> str:
    return tiny_llama


@pytest.fixture(scope="module")
def baseline(reference):
    """Outputs of an engine without kvoffload."""
    return {seed: reference[prompt(seed)] for seed in (1, 2)}


@pytest.fixture(scope="module")
def engine_256m(model_path, baseline):
    """An engine with a 256 MiB CPU tier, shared by the tests of that configuration; each
    leaves it as it found it (patches undone), and counts from its own starting point.
    (``baseline`` first: its engine must be closed before this one starts.)"""
    llm = make_llm(model_path, kvoffload={"cpu_bytes_to_use": 256 << 20})
    try:
        yield llm
    finally:
        close_llm(llm)


def test_prefix_served_from_cpu_tier_matches_recomputation(model_path, baseline):
    sub = Subscriber()
    llm = make_llm(
        model_path,
        kvoffload={"cpu_bytes_to_use": 256 << 20, "block_size": 64},
        events_endpoint=f"tcp://127.0.0.1:{sub.port}",
    )
    try:
        text = prompt(1)
        out, cached = generate(llm, text)
        assert out == baseline[1] and cached == 0
        settle(llm)  # the last stores may still be in flight
        assert llm.reset_prefix_cache()
        out, cached = generate(llm, text)
        # 31 offloaded blocks of 64 tokens; the engine computes the rest itself
        assert cached == 31 * 64
        assert out == baseline[1]
        drain(llm, sub)
        gpu = {}
        for e in sub.events:
            if isinstance(e, BlockStored) and e.medium == "GPU":
                for i, h in enumerate(e.block_hashes):
                    gpu[h] = e.token_ids[i * e.block_size : (i + 1) * e.block_size]
        cpu = [e for e in sub.events if isinstance(e, BlockStored) and e.medium == "CPU"]
        assert sum(len(e.block_hashes) for e in cpu) == 31
        for e in cpu:
            assert e.block_size == 64 and e.group_idx == 0
            assert len(e.token_ids) == 64 * len(e.block_hashes)
            for i, h in enumerate(e.block_hashes):
                # an offloaded block is named by the GPU hash of its last device block,
                # and holds the tokens of its two device blocks
                assert h in gpu
                assert e.token_ids[i * 64 + 32 : (i + 1) * 64] == gpu[h]
        # the tiny model's tokenizer maps byte b to token b + 3
        assert [t for e in cpu for t in e.token_ids] == [b + 3 for b in text.encode()][: 31 * 64]

        # The engine keeps an odd number of 32-token blocks (33) of the prompt itself: the
        # load starts half-way into offloaded block 16 (F = 2) and fills the rest.
        settle(llm)  # the last stores may still be in flight
        assert llm.reset_prefix_cache()
        generate(llm, text[:1060])
        before = scheduler_connector(llm).offload_stats().tokens_loaded
        out, cached = generate(llm, text)
        assert cached == 31 * 64 and out == baseline[1]
        stats = scheduler_connector(llm).offload_stats()
        assert stats.tokens_loaded - before == 31 * 64 - 33 * 32
        assert stats.failed_loads == 0

        # The KV cache is in host memory: a step waits for the stores it started.
        assert worker_connector()._worker.sync_stores is True
        # Corrupt the host copies: the next load must change the output.
        pool = host_transfer_engine().host_pool
        gen = torch.Generator().manual_seed(0)
        for t in pool.tensors:
            t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=gen))
        settle(llm)  # the last stores may still be in flight
        assert llm.reset_prefix_cache()
        out, cached = generate(llm, text)
        assert cached == 31 * 64
        assert out != baseline[1]
    finally:
        close_llm(llm)
        sub.close()


def test_cpu_tier_evictions_are_published(model_path, baseline):
    sub = Subscriber()
    # room for 100 blocks of 32 tokens: two 62-block prompts do not fit together
    llm = make_llm(
        model_path,
        kvoffload={"cpu_bytes_to_use": 100 * kv_block_bytes(model_path), "eviction_policy": "arc"},
        events_endpoint=f"tcp://127.0.0.1:{sub.port}",
    )
    try:
        assert generate(llm, prompt(1))[0] == baseline[1]
        assert generate(llm, prompt(2))[0] == baseline[2]
        drain(llm, sub)
        removed = [
            h for e in sub.events if isinstance(e, BlockRemoved) and e.medium == "CPU" for h in e.block_hashes
        ]
        stored = [
            h for e in sub.events if isinstance(e, BlockStored) and e.medium == "CPU" for h in e.block_hashes
        ]
        assert len(stored) == 124 and len(removed) == 24
        assert set(removed) <= set(stored)
        # ARC evicts the least recently used idle blocks first: prompt 1's first 24 (one
        # store job wrote its 62 blocks in order, before prompt 2's 62 needed room).
        assert set(removed) == set(stored[:24])
        settle(llm)  # the last stores may still be in flight
        assert llm.reset_prefix_cache()
        # Prompt 2 is whole in the tier: 62 blocks of 32 tokens (the prompt's last 16
        # tokens are never offloaded).
        assert generate(llm, prompt(2)) == (baseline[2], 62 * 32)
        # Prompt 1 kept blocks 24..61 only; a prefix match stops at its missing block 0,
        # so nothing is loaded and the engine recomputes it all.
        assert generate(llm, prompt(1)) == (baseline[1], 0)
    finally:
        close_llm(llm)
        sub.close()


@pytest.mark.parametrize(
    "extra, message",
    [
        ({}, r"\['cpu_bytes_to_use'\] is required"),
        ({"cpu_bytes_to_use": -5}, r"\['cpu_bytes_to_use'\] must be a positive int, got -5$"),
        # the engine's blocks are 32 tokens
        (
            {"cpu_bytes_to_use": 1 << 20, "block_size": 48},
            r"\['block_size'\] must be a multiple of the engine block size 32, got 48$",
        ),
        (
            {"cpu_bytes_to_use": 1 << 20, "eviction_policy": "nope"},
            r"eviction_policy.*unknown eviction policy 'nope'",
        ),
        (
            {"cpu_bytes_to_use": 1 << 20, "kv_events": "loud"},
            r"\['kv_events'\] must be one of \['self_describing', 'placeholder'\], got 'loud'$",
        ),
    ],
)
def test_bad_extra_config_fails_engine_start(model_path, extra, message):
    # The in-process engine builds its connector in this thread: the config's own
    # ValueError reaches the caller, naming the key and the bad value.
    with pytest.raises(ValueError, match=message):
        llm = make_llm(model_path, kvoffload=extra)
        close_llm(llm)


def test_hybrid_sliding_window_model_two_kv_groups(tmp_path):
    """A model with sliding-window and full-attention layers: two KV-cache groups, the
    sliding-window one with null blocks outside its window."""
    path = str(build_tiny_llama(tmp_path / "hybrid", sliding_window=64))
    text = prompt(3)
    llm = make_llm(path)
    try:
        expected, _ = generate(llm, text)
    finally:
        close_llm(llm)
    llm = make_llm(path, kvoffload={"cpu_bytes_to_use": 256 << 20})
    try:
        groups = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config.kv_cache_groups
        assert sorted(type(g.kv_cache_spec).__name__ for g in groups) == [
            "FullAttentionSpec",
            "SlidingWindowSpec",
        ]
        assert generate(llm, text) == (expected, 0)
        settle(llm)  # the last stores may still be in flight
        assert llm.reset_prefix_cache()
        assert generate(llm, text) == (expected, 62 * 32)
        pool = host_transfer_engine().host_pool
        for t in pool.tensors:
            t.copy_(
                torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
            )
        settle(llm)  # the last stores may still be in flight
        assert llm.reset_prefix_cache()
        out, cached = generate(llm, text)
        assert cached == 62 * 32 and out != expected
    finally:
        close_llm(llm)


def test_preemptions_under_memory_pressure_do_not_change_outputs(model_path):
    """Ten concurrent requests in a 48-block engine cache: vLLM preempts and recomputes;
    with kvoffload, recomputation is partly served from the CPU tier."""
    from vllm import SamplingParams

    rng = random.Random(5)
    shared = prompt(5, 640)
    prompts = [shared + word_text(rng, 200 + 37 * i) for i in range(10)]
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    results = {}
    for name, extra in (("base", None), ("kvoffload", {"cpu_bytes_to_use": 64 << 20})):
        llm = make_llm(
            model_path, kv_cache_bytes=48 * kv_block_bytes(model_path), max_model_len=1500, kvoffload=extra
        )
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        preempt, preemptions = scheduler._preempt_request, []

        def counting(*args, preempt=preempt, preemptions=preemptions, **kwargs):
            preemptions.append(1)
            return preempt(*args, **kwargs)

        scheduler._preempt_request = counting
        try:
            outs = llm.generate(prompts, params, use_tqdm=False)
            results[name] = [list(o.outputs[0].token_ids) for o in outs]
            assert preemptions, "the workload must make the engine preempt"
            if extra:
                stats = scheduler_connector(llm).offload_stats()
                assert stats.failed_loads == 0 and stats.failed_stores == 0
                # How much comes from the tier depends on when the engine preempts, which
                # async store completions shift: the count is not fixed. Bounded: every
                # planned load completed, and the tokens handed to the engine lie in the
                # loaded 32-token blocks (F=1); fewer when a load stops at the prompt's
                # last token, which the engine computes itself.
                assert 0 < stats.tokens_loaded <= 32 * stats.blocks_loaded
        finally:
            close_llm(llm)
    assert results["kvoffload"] == results["base"]


def test_a_request_done_after_its_first_step_has_its_prompt_stored_in_that_step(engine_256m):
    llm = engine_256m
    side = worker_connector()._worker
    stored: list[int] = []  # blocks of the stores submitted, per step that had any
    start_stores = side.start_stores

    def spy(plan):
        if plan.stores:
            stored.append(sum(len(job.dst_spec.block_ids) for job in plan.stores))
        return start_stores(plan)

    side.start_stores = spy
    try:
        text = prompt(3)
        out, cached = generate(llm, text, max_tokens=1)  # one step: the prompt and its only token
        assert cached == 0 and stored == [62]
        settle(llm)
        assert llm.reset_prefix_cache()
        assert generate(llm, text, max_tokens=1) == (out, 62 * 32)
    finally:
        side.start_stores = start_stores


def test_failed_loads_are_recomputed(engine_256m, baseline):
    llm = engine_256m
    text = prompt(1)
    assert generate(llm, text)[0] == baseline[1]
    # Inject a copy error into every load the transfer engine runs from now on.
    executor = host_transfer_engine()._executor
    launch = executor.launch

    def failing_loads(store, *args, **kwargs):
        if not store:
            raise RuntimeError("injected copy failure")
        return launch(store, *args, **kwargs)

    executor.launch = failing_loads
    try:
        settle(llm)  # the last stores may still be in flight
        assert llm.reset_prefix_cache()
        before = scheduler_connector(llm).offload_stats().snapshot()
        out, _ = generate(llm, text)
        assert out == baseline[1]
        stats = scheduler_connector(llm).offload_stats()
        # One load was planned: the 62 offloaded blocks (F=1) of the 2000-token prompt. It
        # failed, and after a failed load the request is never matched again, so the engine
        # recomputed it without a second try.
        assert (
            stats.failed_loads - before.failed_loads,
            stats.blocks_loaded - before.blocks_loaded,
            stats.tokens_loaded - before.tokens_loaded,
        ) == (1, 0, 62 * 32)
    finally:
        executor.launch = launch


def test_events_reach_vllm_as_its_own_classes_with_every_field():
    import msgspec
    from vllm.distributed import kv_events as vllm_events

    from kvoffload.events.types import AllBlocksCleared
    from kvoffload.integrations.vllm.scheduler_side import to_vllm_event

    stored = BlockStored(
        block_hashes=[11, 12],
        parent_block_hash=10,
        token_ids=list(range(64)),
        block_size=32,
        lora_id=3,
        medium="CPU",
        lora_name="adapter",
        extra_keys=[("salt",), None],
        group_idx=1,
        kv_cache_spec_kind="sliding_window",
        kv_cache_spec_sliding_window=128,
        locality="host",
        ownership="replica",
        session_id="s",
    )
    removed = BlockRemoved(block_hashes=[11], medium="CPU", group_idx=1, locality="host", ownership="replica")
    for ours, theirs in (
        (stored, vllm_events.BlockStored),
        (removed, vllm_events.BlockRemoved),
        (AllBlocksCleared(), vllm_events.AllBlocksCleared),
    ):
        converted = to_vllm_event(ours)
        assert type(converted) is theirs
        values = msgspec.structs.asdict(ours)
        assert converted == theirs(**{k: values[k] for k in theirs.__struct_fields__})
