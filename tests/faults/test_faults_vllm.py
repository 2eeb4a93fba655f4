"""Faults on a real vLLM engine (CPU build, a small random Llama built offline).

* 1,000 requests sharing prefixes in an engine cache far too small for them, with 20% of
  kvoffload's loads and stores failing (``fault_injection``): a failed job's copy runs
  from the wrong blocks before it is reported failed, so a failed load whose device
  blocks were used, or a failed store whose host slots became loadable, would change an
  output. Every output equals the engine's own without kvoffload, the scheduler counts
  exactly the injected failures, and no request goes round a failing load twice.
* A burst of stores into a host tier with room for a few requests: stores are declined
  and counted, the tier never overflows, outputs are unchanged, and the tier serves again
  after the burst.
"""

import random
from collections import defaultdict

import pytest

pytest.importorskip("vllm")

from kvoffload.demo.offline import (  # noqa: E402
    close_llm,
    kv_block_bytes,
    make_llm,
    scheduler_connector,
    settle,
    word_text,
    worker_connector,
)
from kvoffload.demo.tiny_model import build_tiny_llama  # noqa: E402
from kvoffload.faults import FaultInjectingWorker  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

BLOCK = 32  # tokens per engine block (one character is one token)
REQUESTS = 1000
PREFIXES = 40
ENGINE_BLOCKS = 48  # the engine's own KV cache: a fraction of the 40 prefixes' 80 blocks
RATE = 0.2


SMALL = dict(num_layers=2, hidden_size=128, num_heads=2, num_kv_heads=2, intermediate_size=256,
             max_position_embeddings=1024)  # fmt: skip


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    # Smaller than the demo's model: 2,000 requests are computed in this module.
    return str(build_tiny_llama(tmp_path_factory.mktemp("model") / "small-llama", **SMALL))


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """A sliding-window layer and a full-attention layer: two KV-cache groups overlaid on
    one allocation. A window of one block makes the engine null the blocks behind it."""
    path = tmp_path_factory.mktemp("model") / "small-hybrid"
    return str(build_tiny_llama(path, sliding_window=BLOCK, **SMALL))


def shared_prefix_prompts() -> list[str]:
    """Two-block prefixes, each followed by a short suffix of its own."""
    rng = random.Random(14)
    prefixes = [word_text(rng, 2 * BLOCK) for _ in range(PREFIXES)]
    return [rng.choice(prefixes) + word_text(rng, rng.randrange(8, 40)) for _ in range(REQUESTS)]


def burst_prompts() -> list[str]:
    """Distinct three-block prompts, all arriving at once."""
    rng = random.Random(15)
    return [word_text(rng, 3 * BLOCK + 5) for _ in range(48)]


def generate(llm, prompts):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    return [list(out.outputs[0].token_ids) for out in llm.generate(prompts, params, use_tqdm=False)]


def engine(model, engine_blocks, extra=None):
    return make_llm(
        model, kvoffload=extra, kv_cache_bytes=engine_blocks * kv_block_bytes(model, BLOCK), max_model_len=512
    )


@pytest.fixture(scope="module")
def baseline(model):
    """The engine's own outputs, without kvoffload."""
    llm = engine(model, ENGINE_BLOCKS)
    try:
        yield {"shared": generate(llm, shared_prefix_prompts()), "burst": generate(llm, burst_prompts())}
    finally:
        close_llm(llm)


class LoadLog:
    """Every load the offloading scheduler plans (job id, request) and every preemption,
    recorded by wrapping the two calls on the live engine's objects."""

    def __init__(self, llm):
        self.loads: list[tuple[int, str]] = []
        self.preempted: dict[str, int] = defaultdict(int)
        offloading = scheduler_connector(llm)._scheduler.scheduler
        build_step = offloading.build_step

        def logged_build_step(*args, **kwargs):
            plan = build_step(*args, **kwargs)
            self.loads += [(job.job_id, job.req_id) for job in plan.loads]
            return plan

        offloading.build_step = logged_build_step
        engine_scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        preempt = engine_scheduler._preempt_request

        def logged_preempt(request, *args, **kwargs):
            self.preempted[request.request_id] += 1
            return preempt(request, *args, **kwargs)

        engine_scheduler._preempt_request = logged_preempt


def injector() -> FaultInjectingWorker:
    worker = worker_connector()._worker.worker
    assert isinstance(worker, FaultInjectingWorker)
    return worker


def test_a_fifth_of_loads_and_stores_failing_changes_no_output(model, baseline):
    extra = {
        "cpu_bytes_to_use": 4000 * kv_block_bytes(model, BLOCK),
        "fault_injection": {"seed": 1, "load_failure_rate": RATE, "store_failure_rate": RATE},
    }
    check_faults(model, extra, baseline["shared"])


def test_failing_loads_and_stores_on_a_hybrid_with_a_disk_tier_change_no_output(hybrid, tmp_path):
    """vLLM refuses block-level load failures on a model with several KV-cache groups: they
    go by request (``failed_recving``), and the engine stays up and recomputes them. The
    host tier is small, so loads are also served by promotions from the disk tier."""
    llm = engine(hybrid, ENGINE_BLOCKS)
    try:
        expected = generate(llm, shared_prefix_prompts())
    finally:
        close_llm(llm)
    extra = {
        "cpu_bytes_to_use": 24 * kv_block_bytes(hybrid, BLOCK),
        "secondary_tiers": [{"type": "fs", "root_dir": str(tmp_path / "fs"), "bytes_to_use": 64 << 20}],
        "fault_injection": {"seed": 2, "load_failure_rate": RATE, "store_failure_rate": RATE},
    }
    # Most of its loads wait for a promotion from disk first: how many requests find their
    # prefix in time varies from run to run (95-110 loads were seen), fewer than above.
    stats = check_faults(hybrid, extra, expected, min_jobs=50)
    assert stats.tokens_by_source.get("DISK", 0) > 0  # some loads came up from the disk tier


def check_faults(model, extra, expected, min_jobs=100):
    llm = engine(model, ENGINE_BLOCKS, extra)
    try:
        log = LoadLog(llm)
        outputs = generate(llm, shared_prefix_prompts())
        settle(llm)  # the last jobs complete and are counted
        stats = scheduler_connector(llm).offload_stats()
        injected = injector().stats()
        failed_load_ids = set(injector().injected["load"])
        offloading = scheduler_connector(llm)._scheduler.scheduler
    finally:
        close_llm(llm)

    assert outputs == expected
    # The workload made the engine offload and reload, and the faults hit both directions.
    assert injected.loads >= min_jobs and injected.stores >= min_jobs
    assert injected.failed_loads >= 0.1 * injected.loads
    assert injected.failed_stores >= 0.1 * injected.stores
    assert stats.blocks_loaded > 0 and stats.blocks_stored > 0
    # The scheduler saw exactly the injected failures, and nothing else failed.
    assert (stats.failed_loads, stats.failed_stores) == (injected.failed_loads, injected.failed_stores)
    assert stats.failed_tier_transfers == 0
    # Every planned load was submitted once; a request never loads again after a failed
    # load (it is recomputed), and loads again only after a preemption.
    assert len(log.loads) == injected.loads
    assert failed_load_ids <= {job for job, _ in log.loads}
    by_request: dict[str, list[int]] = defaultdict(list)
    for job, req in log.loads:
        by_request[req].append(job)
    for req, jobs in by_request.items():
        assert len(jobs) <= 1 + log.preempted[req], f"request {req} loaded {len(jobs)} times"
        failed = [i for i, job in enumerate(jobs) if job in failed_load_ids]
        assert not failed or failed[0] == len(jobs) - 1, f"request {req} loaded again after a failed load"
    return offloading


def test_host_tier_full_under_a_burst_of_stores_declines_them(model, baseline):
    # Room for 16 blocks: five of the 48 requests' three blocks each. The engine holds the
    # whole burst, so its stores are planned together, while the first ones are in flight.
    host_blocks = 16
    # Stores left running after their step (on this CPU build a step waits for them unless
    # told otherwise): the burst's later stores meet a tier full of blocks being written.
    extra = {"cpu_bytes_to_use": host_blocks * kv_block_bytes(model, BLOCK), "sync_stores": False}
    llm = engine(model, 256, extra)
    try:
        prompts = burst_prompts()
        assert generate(llm, prompts) == baseline["burst"]
        settle(llm)
        stats = scheduler_connector(llm).offload_stats()
        tier = scheduler_connector(llm)._scheduler.manager.stats()
        assert stats.declined_stores > 0
        assert stats.failed_stores == 0
        assert stats.blocks_stored + stats.declined_stores == 3 * len(prompts)
        assert tier.capacity == host_blocks and tier.used <= host_blocks and tier.in_flight == 0
        # After the burst the tier serves what it holds, and outputs stay the engine's own.
        assert llm.reset_prefix_cache()
        assert generate(llm, prompts) == baseline["burst"]
        assert scheduler_connector(llm).offload_stats().blocks_loaded > 0
    finally:
        close_llm(llm)
