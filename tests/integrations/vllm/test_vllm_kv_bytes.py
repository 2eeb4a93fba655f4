"""End to end on a real vLLM engine: the KV that kvoffload brings back is, at every token
position, byte for byte the KV that vLLM computed for that position; with a chunked
prefill, with a prefill-only request, and across vLLM's cache resets.

Output comparison alone cannot show this: a block loaded into the wrong place, or a stored
block that holds a half-computed chunk, may leave greedy outputs unchanged. These tests read
vLLM's KV-cache tensors (the memory the worker connector registered) instead.

Every test overwrites the whole device KV cache with noise before serving its prompt a
second time, so a position that kvoffload failed to load cannot pass by still holding
the first request's bytes.
"""

import pytest

pytest.importorskip("vllm")
import torch  # noqa: E402

import vllm_reference  # noqa: E402
from kvoffload.demo.offline import (
    close_llm,
    make_llm,
    scheduler_connector,
    settle,
    word_text,
)
from kvoffload.demo.offline import (  # noqa: E402
    greedy as generate,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

BLOCK = 32  # tokens per device block (the CPU attention backend needs multiples of 32)
PROMPT = 2000  # tokens: the tiny model's tokenizer maps one character to one token
# kvoffload offloads whole offloaded blocks only: 62 of 32 tokens (F=1) or 31 of 64 (F=2),
# 1984 tokens either way. The load is bounded by the prompt minus the one token the engine
# must compute (1999), so a second request finds exactly these 1984 tokens cached; the
# trailing 16 are recomputed.
OFFLOADED = PROMPT // 64 * 64
CHUNK = 100  # max_num_batched_tokens of the chunked engine: chunks end inside blocks

SEEDS = {"bytes": 11, "prefill_only": 12, "chunked": 13, "reset": 14}


def prompt(name: str) -> str:
    return word_text(SEEDS[name], PROMPT)


vllm_reference.want(*map(prompt, SEEDS))


def chunked_llm(model_path):
    """``make_llm``'s engine with kvoffload (F=1) and prefill chunks of ``CHUNK`` tokens."""
    return make_llm(
        model_path,
        kvoffload={"cpu_bytes_to_use": 256 << 20},
        enable_chunked_prefill=True,
        max_num_batched_tokens=CHUNK,
        max_num_seqs=4,
    )


ENGINES = {
    # F=2: an offloaded block spans two device blocks, so a load or store that mixes up
    # the halves of an offloaded block is caught too
    "offload": lambda path: make_llm(path, kvoffload={"cpu_bytes_to_use": 256 << 20, "block_size": 64}),
    # Stores left running after their step (the GPU default; on this CPU build a step waits
    # for its stores unless told otherwise): for what a store still in flight meets.
    "offload-async": lambda path: make_llm(
        path, kvoffload={"cpu_bytes_to_use": 256 << 20, "block_size": 64, "sync_stores": False}
    ),
    "chunked": chunked_llm,
}


class Engines:
    """One in-process engine at a time (vLLM's distributed state and the worker connector
    are per process): asking for another configuration closes the open one. Tests that
    share a configuration share its engine."""

    def __init__(self, model_path):
        self.model_path = model_path
        self.name = None
        self.llm = None

    def get(self, name):
        if name != self.name:
            self.close()
            self.llm, self.name = ENGINES[name](self.model_path), name
        return self.llm

    def close(self):
        llm, self.llm, self.name = self.llm, None, None
        if llm is not None:
            close_llm(llm)


@pytest.fixture(scope="module")
def engines(tiny_llama: str):
    engines = Engines(tiny_llama)
    try:
        yield engines
    finally:
        engines.close()


@pytest.fixture(scope="module")
def baseline(engines, reference):
    """Greedy outputs (8 tokens) of an engine without kvoffload, prefill not chunked."""
    engines.close()  # one in-process engine at a time
    return {name: reference[prompt(name)] for name in SEEDS}


# -- reading vLLM's KV cache ---------------------------------------------------------------


def device_kv(llm) -> list[torch.Tensor]:
    """vLLM's per-layer KV-cache tensors, the memory registered with the worker connector:
    ``[blocks, kv heads, token in block, K and V]`` (the ``LBHNC`` layout kvoffload asks for)."""
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    kv = list(runner.kv_caches)
    num_blocks = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config.num_blocks
    for t in kv:
        assert t.dim() == 4 and t.shape[0] == num_blocks and t.shape[2] == BLOCK, t.shape
    return kv


def kv_at_positions(llm, block_ids, n_tokens) -> list[torch.Tensor]:
    """Every layer's K and V at token positions ``0 .. n_tokens - 1`` of a request whose
    device blocks are ``block_ids``: ``[position, kv heads, K and V]`` as raw bytes."""
    positions = torch.arange(n_tokens)
    blocks = torch.tensor(block_ids)[positions // BLOCK]
    return [t[blocks, :, positions % BLOCK, :].contiguous().view(torch.uint8) for t in device_kv(llm)]


def assert_same_kv(reloaded, computed):
    """Byte equality at every position; the message names the first positions that differ."""
    for layer, (got, want) in enumerate(zip(reloaded, computed)):
        assert got.shape == want.shape
        differs = (got != want).flatten(1).any(1).nonzero().flatten().tolist()
        assert not differs, f"layer {layer}: KV differs at {len(differs)} positions, first {differs[:8]}"


class BlockIds:
    """The device blocks vLLM gives each request, as its scheduler hands them to the
    connector every step (independent of kvoffload's own bookkeeping), and the tokens each
    step schedules. Group 0: the tiny Llama has one KV-cache group."""

    def __init__(self, llm):
        self._connector = scheduler_connector(llm)
        self._build = self._connector.build_connector_meta
        self.by_request: dict[str, list[int]] = {}
        self.step_tokens: list[int] = []

    def __enter__(self):
        self._connector.build_connector_meta = self._record
        return self

    def __exit__(self, *exc):
        del self._connector.build_connector_meta  # the class's method again

    def _record(self, out):
        for new in out.scheduled_new_reqs:
            self.by_request[new.req_id] = list(new.block_ids[0])
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            if new_ids is None:
                continue
            if req_id in cached.resumed_req_ids:
                self.by_request[req_id] = list(new_ids[0])
            else:
                self.by_request[req_id].extend(new_ids[0])
        self.step_tokens.append(out.total_num_scheduled_tokens)
        return self._build(out)

    def only(self) -> list[int]:
        (ids,) = self.by_request.values()
        return ids


# -- driving kvoffload ---------------------------------------------------------------------


def fresh_device(llm, seed):
    """Empty vLLM's device prefix cache (kvoffload keeps its blocks) and overwrite every KV
    byte on the device with noise."""
    settle(llm)
    assert llm.reset_prefix_cache() is True
    gen = torch.Generator().manual_seed(seed)
    for t in device_kv(llm):
        t.normal_(generator=gen)


def served_twice(llm, text, max_tokens):
    """Serve ``text`` on a scrubbed device (computed, offloaded), snapshot its KV, scrub the
    device again and serve it again (loaded from kvoffload). Returns both ``(output,
    cached tokens)`` and both requests' KV at the offloaded positions."""
    fresh_device(llm, seed=1)
    with BlockIds(llm) as first:
        computed = generate(llm, text, max_tokens)
    computed_kv = kv_at_positions(llm, first.only(), OFFLOADED)
    fresh_device(llm, seed=2)
    with BlockIds(llm) as second:
        reloaded = generate(llm, text, max_tokens)
    return computed, reloaded, computed_kv, kv_at_positions(llm, second.only(), OFFLOADED)


# -- tests ---------------------------------------------------------------------------------


def test_reloaded_kv_is_the_computed_kv_at_every_position(engines, baseline):
    llm = engines.get("offload")
    computed, (out, cached), computed_kv, reloaded_kv = served_twice(llm, prompt("bytes"), 8)
    assert computed == (baseline["bytes"], 0)
    assert cached == OFFLOADED
    assert_same_kv(reloaded_kv, computed_kv)  # first: it sees what outputs may not
    assert out == baseline["bytes"]


def test_prefill_only_request_is_offloaded_and_served_back(engines, baseline):
    llm = engines.get("offload")
    text = prompt("prefill_only")
    fresh_device(llm, seed=1)
    with BlockIds(llm) as first:
        assert generate(llm, text, max_tokens=1) == (baseline["prefill_only"][:1], 0)
    computed_kv = kv_at_positions(llm, first.only(), OFFLOADED)
    # The request ended in the step that computed its blocks, so their store is still in
    # flight from the scheduler's point of view (a job is reported done one step later at
    # the earliest): kvoffload keeps the request's device blocks, and vLLM's own prefix
    # cache reset (which does not ask the connector) refuses while blocks are in use.
    assert llm.reset_prefix_cache() is False
    # Once the store finished and a step reported it, the blocks are free; the reset
    # empties the device cache only, and the prompt comes back from kvoffload.
    fresh_device(llm, seed=2)
    with BlockIds(llm) as second:
        out, cached = generate(llm, text, max_tokens=1)
    assert cached == OFFLOADED
    assert_same_kv(kv_at_positions(llm, second.only(), OFFLOADED), computed_kv)
    assert out == baseline["prefill_only"][:1]


def test_connector_reset_with_a_store_in_flight(engines, baseline):
    """What vLLM's pause and sleep do (``reset_running_requests=True,
    reset_connector=True``; a ``False`` makes them raise) while a request runs and its
    store is in flight. Like vLLM's own offloading connector, kvoffload accepts: the
    tier is emptied, the late store is not counted, and the running request, preempted
    by the reset and recomputed, offloads its blocks again."""
    from vllm import SamplingParams

    llm = engines.get("offload-async")
    text = prompt("reset")
    fresh_device(llm, seed=1)
    stats = scheduler_connector(llm).offload_stats()
    stored_before = stats.blocks_stored
    engine = llm.llm_engine
    with BlockIds(llm) as blocks:
        engine.add_request("reset-1", text, SamplingParams(temperature=0, max_tokens=8))
        engine.step()  # the whole prompt: its 31 offloaded blocks go out in one store job
        assert blocks.step_tokens == [PROMPT]
        assert llm.reset_prefix_cache(reset_running_requests=True, reset_connector=True) is True
        outputs = []
        while engine.has_unfinished_requests():
            outputs += [o for o in engine.step() if o.finished]
    (out,) = outputs
    assert list(out.outputs[0].token_ids) == baseline["reset"]
    computed_kv = kv_at_positions(llm, blocks.only(), OFFLOADED)
    settle(llm)
    # Counted once: the store after the reset. The one in flight at the reset wrote blocks
    # the reset had already dropped.
    assert scheduler_connector(llm).offload_stats().blocks_stored - stored_before == OFFLOADED // 64
    fresh_device(llm, seed=2)
    with BlockIds(llm) as second:
        out, cached = generate(llm, text)
    assert cached == OFFLOADED
    assert_same_kv(kv_at_positions(llm, second.only(), OFFLOADED), computed_kv)
    assert out == baseline["reset"]


def test_chunked_prefill_offloads_whole_blocks_only(engines, baseline):
    """Prefill chunks of 100 tokens end inside 32-token blocks: a block is offloaded only
    once all its tokens are computed."""
    llm = engines.get("chunked")
    text = prompt("chunked")
    fresh_device(llm, seed=1)
    with BlockIds(llm) as first:
        assert generate(llm, text) == (baseline["chunked"], 0)
    # 20 prefill steps of 100 tokens, then 7 decode steps of one
    assert first.step_tokens == [CHUNK] * (PROMPT // CHUNK) + [1] * 7
    computed_kv = kv_at_positions(llm, first.only(), OFFLOADED)
    fresh_device(llm, seed=2)
    with BlockIds(llm) as second:
        out, cached = generate(llm, text)
    assert cached == OFFLOADED
    assert_same_kv(kv_at_positions(llm, second.only(), OFFLOADED), computed_kv)
    assert out == baseline["chunked"]
