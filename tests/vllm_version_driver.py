"""Drives one vLLM release's own scheduler with kvoffload's connector in-process, no model:
the way vLLM's unit tests drive connectors, for releases whose CPU platform cannot run an
engine here. Run as ``PYTHONPATH=<that release> python tests/vllm_version_driver.py MODEL
[CASE ...]`` (default: every case); prints ``OK <case> <version> <details>`` per case, or
fails with a traceback.

Each step: vLLM schedules; a stand-in forward pass writes every computed block's page with
bytes derived from the block's tokens (a partial block too, as a real one would); the
worker half of the connector runs in vLLM's call order; the outputs go back to vLLM.

Cases:
* ``round_trip``: a prompt is computed and offloaded; the device KV is zeroed and vLLM's
  prefix cache reset; the same prompt comes back from kvoffload, every reloaded page
  equal to what was computed.
* ``preempt``: two long requests in a device cache too small for both: one is preempted,
  resumed and finishes, and a later copy of its prompt is served from kvoffload.
* ``failed_load``: every load fails (``fault_injection``) under ``recompute``: the
  request is recomputed and finishes; nothing is left loading.
* ``inflight_cap``: vLLM's cap on in-flight loads (where the release has it) holds with
  kvoffload's asynchronous loads.
* ``events``: the connector's events are the release's own classes and survive vLLM's
  msgpack encoding.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import vllm  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.utils.hashing import sha256_cbor  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from kvoffload.integrations.vllm import KVOffloadConnector  # noqa: E402

BLOCK = 16
SPEC = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.float32)
PAGE = SPEC.page_size_bytes
LAYERS = ("l0", "l1")


class Harness:
    def __init__(self, model: str, num_blocks: int, extra: dict | None = None, **scheduler_args) -> None:
        config = VllmConfig(
            model_config=ModelConfig(model=model, dtype="float32", seed=0),
            scheduler_config=SchedulerConfig(
                max_num_seqs=4, max_num_batched_tokens=256, max_model_len=1024, enable_chunked_prefill=True,
                is_encoder_decoder=False, **scheduler_args,
            ),
            cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
            kv_transfer_config=KVTransferConfig(
                kv_connector="KVOffloadConnector", kv_connector_module_path="kvoffload.integrations.vllm",
                kv_role="kv_both", kv_load_failure_policy="recompute",
                kv_connector_extra_config={"cpu_bytes_to_use": 4 << 20, **(extra or {})},
            ),
            device_config=DeviceConfig("cpu"),
        )  # fmt: skip
        self.num_blocks = num_blocks
        tensor = KVCacheTensor(len(LAYERS) * PAGE * num_blocks, list(LAYERS), PAGE * num_blocks, PAGE)
        kv_config = KVCacheConfig(num_blocks, [tensor], [KVCacheGroupSpec(list(LAYERS), SPEC)])
        config.cache_config.num_gpu_blocks = num_blocks
        cls = AsyncScheduler if config.scheduler_config.async_scheduling else Scheduler
        self.scheduler = cls(
            vllm_config=config, kv_cache_config=kv_config, log_stats=True,
            structured_output_manager=StructuredOutputManager(config), block_size=BLOCK,
        )  # fmt: skip
        self.worker = KVOffloadConnector(config, KVConnectorRole.WORKER, kv_config)
        self.kv = torch.zeros(len(LAYERS) * PAGE * num_blocks, dtype=torch.uint8)
        pages = self.kv.view(len(LAYERS), num_blocks, PAGE)
        self.worker.register_kv_caches({name: pages[i] for i, name in enumerate(LAYERS)})
        self.pages = pages
        init_none_hash(sha256_cbor)
        self.hasher = get_request_block_hasher(BLOCK, sha256_cbor)
        self.requests: dict[str, Request] = {}
        self.finished: set[str] = set()

    def add(self, req_id: str, tokens: list[int], max_tokens: int = 3) -> Request:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        request = Request(
            request_id=req_id, prompt_token_ids=tokens, sampling_params=params, pooling_params=None,
            block_hasher=self.hasher,
        )  # fmt: skip
        self.requests[req_id] = request
        self.scheduler.add_request(request)
        return request

    def step(self):
        out = self.scheduler.schedule()
        for req_id, n in out.num_scheduled_tokens.items():
            self._forward(self.requests[req_id], n)
        meta = out.kv_connector_metadata
        worker = self.worker
        worker.bind_connector_metadata(meta)
        worker.handle_preemptions(meta)
        worker.start_load_kv(None)
        worker.wait_for_save()
        results = worker.get_transfer_results(out.finished_req_ids)
        worker_meta = worker.build_connector_worker_meta()
        worker.clear_connector_metadata()
        ids = list(out.num_scheduled_tokens)
        output = ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=[[5] for _ in ids],
            kv_connector_output=KVConnectorOutput(
                finished_sending=results.finished_sending, finished_recving=results.finished_recving,
                failed_recving=results.failed_recving, kv_connector_worker_meta=worker_meta,
            ),
        ) if "req_id_to_index" in ModelRunnerOutput.__dataclass_fields__ else ModelRunnerOutput(
            req_ids=ids, sampled_token_ids=[[5] for _ in ids],
            kv_connector_output=KVConnectorOutput(
                finished_sending=results.finished_sending, finished_recving=results.finished_recving,
                failed_recving=results.failed_recving, kv_connector_worker_meta=worker_meta,
            ),
        )  # fmt: skip
        engine_outputs = self.scheduler.update_from_output(out, output)
        for outputs in engine_outputs.values():
            self.finished.update(o.request_id for o in outputs.outputs if o.finish_reason is not None)
        return out

    def run(self, until, steps: int = 200) -> None:
        for _ in range(steps):
            if until():
                return
            self.step()
            self.worker._worker.wait_idle(30)  # transfers end between steps, deterministically
        raise AssertionError("the requests did not finish")

    def _forward(self, request: Request, n: int) -> None:
        """Write the pages of the blocks this step computes (tokens ``[computed, computed + n)``)."""
        (ids,) = self.scheduler.kv_cache_manager.get_block_ids(request.request_id)
        end = request.num_computed_tokens  # vLLM advanced it when it scheduled the step
        start = end - n
        tokens = request.all_token_ids
        for j in range(start // BLOCK, min(-(-end // BLOCK), len(ids))):
            self.pages[:, ids[j]] = expected_page(tokens[j * BLOCK : min(end, (j + 1) * BLOCK)], j)

    def block_ids(self, req_id: str) -> list[int]:
        return list(self.scheduler.kv_cache_manager.get_block_ids(req_id)[0])


def expected_page(tokens, j: int) -> int:
    return (sum(tokens) * 31 + 7 * j + len(tokens)) % 251 + 1


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 500 + 3 for i in range(n)]


def round_trip(h: Harness) -> tuple[str, set[str]]:
    """Store a prompt, zero the device KV, serve the prompt again from the CPU tier: the
    reloaded pages checked; with the statuses the second request went through."""
    assert getattr(h.scheduler, "requires_kv_delivery", False) is False  # a best-effort cache
    tokens = prompt(1, 100)
    h.add("a", tokens)
    h.run(lambda: "a" in h.finished)
    h.run(lambda: not h.scheduler.requests, 5) if h.scheduler.requests else None
    h.kv.zero_()
    assert h.scheduler.reset_prefix_cache()
    h.add("b", tokens)
    seen: dict[str, list[int]] = {}
    statuses: set[str] = set()
    stats = h.scheduler.connector.offload_stats()

    def done() -> bool:
        if "b" in h.scheduler.requests:
            seen["ids"] = h.block_ids("b")  # its device blocks, the loaded ones first
            statuses.add(h.scheduler.requests["b"].status.name)
        return "b" in h.finished

    h.run(done)
    loaded = stats.tokens_loaded
    assert loaded == 96 and stats.failed_loads == 0, stats
    ids = seen["ids"]
    for j in range(96 // BLOCK):
        want = expected_page(tokens[j * BLOCK : (j + 1) * BLOCK], j)
        assert bool((h.pages[:, ids[j]] == want).all()), f"block {j} was not reloaded"
    return f"tokens_loaded={loaded} blocks_checked={96 // BLOCK}", statuses


def case_round_trip(model: str) -> str:
    result, statuses = round_trip(Harness(model, 64, {"sync_load_budget_bytes": 0}))  # asynchronous
    assert "WAITING_FOR_REMOTE_KVS" in statuses, statuses
    return result


def case_sync_load(model: str) -> str:
    """The default budget holds the 6-block hit: loaded within the step that schedules it,
    so the request never waits for its KV."""
    result, statuses = round_trip(Harness(model, 64))
    assert "WAITING_FOR_REMOTE_KVS" not in statuses, statuses
    return result


def case_preempt(model: str) -> str:
    # 13 usable blocks: two 80-token prompts (5 blocks each) start together, and cannot
    # both decode 60 more tokens (9 blocks each)
    h = Harness(model, 14)
    h.add("a", prompt(2, 80), max_tokens=60)
    h.add("b", prompt(3, 80), max_tokens=60)
    preempted = []
    original = h.scheduler._preempt_request

    def preempt(request, *args, **kwargs):
        preempted.append(request.request_id)
        return original(request, *args, **kwargs)

    h.scheduler._preempt_request = preempt
    h.run(lambda: {"a", "b"} <= h.finished)
    assert preempted, "nothing was preempted"
    assert h.scheduler.reset_prefix_cache()
    before = h.scheduler.connector.offload_stats().tokens_loaded
    h.add("c", prompt(2, 80))
    h.run(lambda: "c" in h.finished)
    loaded = h.scheduler.connector.offload_stats().tokens_loaded - before
    assert loaded == 79, loaded  # its 5 whole blocks: every prompt token but the one vLLM computes
    return f"preempted={preempted} tokens_loaded_after={loaded}"


def case_failed_load(model: str) -> str:
    h = Harness(model, 64, {"fault_injection": {"seed": 1, "load_failure_rate": 1.0}})
    tokens = prompt(4, 100)
    h.add("a", tokens)
    h.run(lambda: "a" in h.finished)
    assert h.scheduler.reset_prefix_cache()
    h.add("b", tokens)
    h.run(lambda: "b" in h.finished)
    stats = h.scheduler.connector.offload_stats()
    assert stats.failed_loads == 1 and stats.failed_load_tokens == 96, stats
    assert not h.scheduler.failed_recving_kv_req_ids
    return f"failed_loads={stats.failed_loads}"


def case_inflight_cap(model: str) -> str:
    config_fields = SchedulerConfig.__dataclass_fields__
    if "max_num_inflight_kv_loads" not in config_fields:
        return "skipped: this release has no max_num_inflight_kv_loads"
    # asynchronous loads (the cap is theirs: a load within the step has no request waiting)
    h = Harness(model, 128, {"sync_load_budget_bytes": 0}, max_num_inflight_kv_loads=1)
    prompts = [prompt(10 + i, 100) for i in range(3)]
    for i, tokens in enumerate(prompts):
        h.add(f"w{i}", tokens)
    h.run(lambda: {"w0", "w1", "w2"} <= h.finished)
    assert h.scheduler.reset_prefix_cache()
    for i, tokens in enumerate(prompts):
        h.add(f"r{i}", tokens)
    most = 0
    for _ in range(200):
        if {"r0", "r1", "r2"} <= h.finished:
            break
        h.step()
        waiting = sum(r.status.name == "WAITING_FOR_REMOTE_KVS" for r in h.scheduler.requests.values())
        most = max(most, waiting)
        h.worker._worker.wait_idle(30)
    assert {"r0", "r1", "r2"} <= h.finished and most == 1, most
    return f"most_in_flight={most}"


def case_events(model: str) -> str:
    from vllm.distributed import kv_events

    h = Harness(model, 64)
    connector, events = h.scheduler.connector, []
    take = connector.take_events

    def keep():  # vLLM takes them every step: keep a copy
        taken = list(take())
        events.extend(taken)
        return taken

    connector.take_events = keep
    h.add("a", prompt(5, 100))
    h.run(lambda: "a" in h.finished)
    assert events and all(type(e).__module__ == kv_events.__name__ for e in events), events
    batch = kv_events.KVEventBatch(ts=0.0, events=events)
    decoded = kv_events.msgspec.msgpack.decode(
        kv_events.msgspec.msgpack.encode(batch), type=kv_events.KVEventBatch
    )
    assert decoded.events == events
    from kvoffload.integrations.vllm.scheduler_side import _SAME_FIELDS

    assert all(_SAME_FIELDS.values()), _SAME_FIELDS  # every class converts on the positional path
    return f"events={len(events)} {type(events[0]).__name__}"


CASES = ("round_trip", "sync_load", "preempt", "failed_load", "inflight_cap", "events")

if __name__ == "__main__":
    model, cases = sys.argv[1], sys.argv[2:] or CASES
    for case in cases:
        print("OK", case, vllm.__version__, globals()[f"case_{case}"](model), flush=True)
