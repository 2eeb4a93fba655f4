"""The connector's scheduler side at batch scale, next to vLLM 0.32's ``OffloadingConnector``.

vLLM's own ``Scheduler`` (``vllm.v1.core.sched.scheduler``) drives the connector in-process,
as vLLM's connector unit tests do: no model and no worker. A stand-in model output samples
one token per scheduled request; a stand-in worker finishes every job of a step within that
step, reporting what the connector's worker half would (``finished_recving`` for the loads,
``finished_sending`` for held requests, the finished job ids as worker metadata). The KV
cache is never allocated: its block count is only a number.

Per case (``--requests`` x ``--tokens``): ``N`` prompts of ``tokens - new`` tokens are
computed and stored in the CPU tier (not timed), vLLM's device prefix cache is reset, and
``N`` requests whose prompts extend those by ``new`` tokens arrive at once: each finds its
prefix in the CPU tier, loads it, computes the rest and decodes ``--decode`` tokens. Every
step of that phase is timed: the connector's scheduler-side calls by kind (matching:
``on_new_request`` + ``get_num_new_matched_tokens``; allocation:
``update_state_after_alloc``; metadata: ``build_connector_meta``; finished:
``request_finished*`` + ``update_connector_output``; events: ``take_events``, drained) and
vLLM's whole step (``schedule`` + ``update_from_output``) around them. The two connectors
alternate, each case ``--reps`` times; figures are the median over repetitions. What the
untimed warm-up left is frozen out of the garbage collector (``gc.freeze``), as vLLM's
engine freezes its start-up heap: a full collection of that heap (about a second) would
otherwise land in whichever call, of either connector, happens to allocate then.

Reported per case and connector: us per decode step (a step where every scheduled request
computes one token and none finishes) by kind and in all, with vLLM's whole step; and the
rest (admission, the prompts' last tokens, the finishing step and what follows it) in us
per request; each with its ratio to vLLM's connector. The decode steps include those where
every request stores a block (the requests run in lockstep: one step in 16).
``--kvoffload-extra '{"offload_prompt_only": true}'`` stores what vLLM's connector stores
by default (kvoffload's default also stores the blocks decoding fills).

    .venv/bin/python bench/bench_batch.py [--requests 256,1024] [--tokens 8192,32768]
        [--decode 32] [--new 256] [--reps 2] [--kvoffload-extra JSON] [--profile kvoffload|vllm]
        [--per-step]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
from collections import defaultdict

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    KVEventsConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from kvoffload.demo.tiny_model import build_tiny_llama  # noqa: E402

BLOCK = 16
SPEC = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=16, dtype=torch.float16)
LAYERS = ("l0", "l1")
KINDS = ("matching", "allocation", "metadata", "finished", "events")
TIMED = {
    "on_new_request": "matching",
    "get_num_new_matched_tokens": "matching",
    "update_state_after_alloc": "allocation",
    "build_connector_meta": "metadata",
    "request_finished": "finished",
    "request_finished_all_groups": "finished",
    "update_connector_output": "finished",
    "take_events": "events",
}
CONNECTORS = {
    "kvoffload": ("KVOffloadConnector", "kvoffload.integrations.vllm", {"sync_load_budget_bytes": 0}),
    "vllm": ("OffloadingConnector", None, {}),
}


class Timers:
    """Seconds spent in the connector's scheduler-side calls, by kind, since ``reset``."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = defaultdict(float)
        self.finishes = 0  # request_finished calls since ``take``

    def wrap(self, connector) -> None:
        for name, kind in TIMED.items():
            method = getattr(connector, name, None)
            if method is not None:
                setattr(connector, name, self._timed(method, kind, name))

    def _timed(self, method, kind: str, name: str):
        clock = time.perf_counter
        drain = name == "take_events"  # vLLM's is a generator: its work happens when drained
        finish = name.startswith("request_finished")

        def call(*args, **kwargs):
            start = clock()
            result = method(*args, **kwargs)
            if drain:
                result = list(result)
            self.spent[kind] += clock() - start
            self.finishes += finish
            return result

        return call

    def take(self) -> tuple[dict[str, float], int]:
        spent, self.spent = self.spent, defaultdict(float)
        finishes, self.finishes = self.finishes, 0
        return spent, finishes


def make_scheduler(
    model: str, which: str, num_blocks: int, max_seqs: int, max_len: int, more: dict
) -> Scheduler:
    name, module, extra = CONNECTORS[which]
    extra = {**extra, **more}
    page = SPEC.page_size_bytes
    config = VllmConfig(
        model_config=ModelConfig(model=model, dtype="float16", seed=0, max_model_len=max_len),
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_seqs,
            max_num_batched_tokens=1 << 20,
            max_model_len=max_len,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        ),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(
            kv_connector=name,
            kv_connector_module_path=module,
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            # room for every block of the run in the CPU tier (a number only: no worker)
            kv_connector_extra_config={"cpu_bytes_to_use": 2 * len(LAYERS) * page * num_blocks, **extra},
        ),
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null"),
        device_config=DeviceConfig("cpu"),
    )
    tensor = KVCacheTensor(len(LAYERS) * page * num_blocks, list(LAYERS), page * num_blocks, page)
    kv_config = KVCacheConfig(num_blocks, [tensor], [KVCacheGroupSpec(list(LAYERS), SPEC)])
    config.cache_config.num_gpu_blocks = num_blocks
    return Scheduler(
        vllm_config=config,
        kv_cache_config=kv_config,
        log_stats=False,
        structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK,
    )


LOADED = defaultdict(int)  # connector -> device blocks its loads wrote


def finish_jobs(which: str, meta) -> tuple[set[str], set[str], object]:
    """What the connector's worker half reports once every job of ``meta`` has finished:
    (finished_sending, finished_recving, worker metadata)."""
    if which == "kvoffload":
        from kvoffload.integrations.vllm.metadata import KVOffloadWorkerMetadata

        plan = meta.plan
        jobs = [*plan.loads, *plan.stores, *plan.transfers]
        recving = {job.req_id for job in plan.loads if job.job_id not in meta.sync_loads}
        LOADED[which] += sum(len(job.dst_spec.block_ids) for job in plan.loads)
        done = KVOffloadWorkerMetadata({job.job_id: (1, True) for job in jobs}) if jobs else None
        return set(plan.hold_blocks), recving, done
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata

    jobs = {**meta.load_jobs, **meta.store_jobs}
    recving = {job.req_id for job in meta.load_jobs.values()}
    LOADED[which] += sum(len(job.dst_spec.block_ids) for job in meta.load_jobs.values())
    done = OffloadingWorkerMetadata({job_id: 1 for job_id in jobs}) if jobs else None
    return set(), recving, done


def step(sched: Scheduler, which: str) -> tuple[bool, float]:
    """One engine step; (every scheduled request computed one token, seconds of vLLM's step)."""
    start = time.perf_counter()
    out = sched.schedule()
    scheduled = time.perf_counter()
    sending, recving, done = finish_jobs(which, out.kv_connector_metadata)
    ids = list(out.num_scheduled_tokens)
    output = ModelRunnerOutput(
        req_ids=ids,
        req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=[[5] for _ in ids],
        kv_connector_output=KVConnectorOutput(
            finished_sending=sending, finished_recving=recving, kv_connector_worker_meta=done
        ),
    )
    between = time.perf_counter()
    sched.update_from_output(out, output)
    end = time.perf_counter()
    decode = bool(ids) and out.total_num_scheduled_tokens == len(ids) and not out.scheduled_new_reqs
    return decode, (scheduled - start) + (end - between)


def prompt(seed: int, n: int) -> list[int]:
    # token ids below 256 are shared int objects: 32K-token prompts cost 8 bytes a token
    return [seed % 251, seed // 251 % 251, *((seed * 7 + i * 13) % 251 for i in range(n - 2))]


def drain(sched: Scheduler, which: str, limit: int = 100_000) -> None:
    for _ in range(limit):
        if not sched.has_requests():
            return
        step(sched, which)
    raise RuntimeError("the requests did not finish")


PER_STEP_KINDS = ("metadata", "finished", "events")


def run_case(model, which, n, tokens, decode, new, more, profile=False, per_step=False) -> dict[str, float]:
    blocks = n * (tokens + decode + BLOCK) // BLOCK + 1024
    sched = make_scheduler(model, which, blocks, n, tokens + decode + BLOCK, more)
    hasher = get_request_block_hasher(BLOCK, sha256)
    prompts = [prompt(i, tokens - new) for i in range(n)]
    for i, p in enumerate(prompts):  # the previous turns: computed, stored, finished
        params = SamplingParams(max_tokens=1, ignore_eos=True)
        sched.add_request(Request(f"w{i}", p, params, None, block_hasher=hasher))
    drain(sched, which)
    assert sched.reset_prefix_cache(), "vLLM's prefix cache did not reset"
    # What the warm-up left (vLLM's blocks, the tier's index of N x tokens blocks: a million
    # objects) is frozen out of the collector, as vLLM's engine freezes its start-up heap:
    # else a full collection (about a second here) lands in whichever call allocates then.
    gc.collect()
    gc.freeze()
    timers = Timers()
    timers.wrap(sched.connector)
    for i, p in enumerate(prompts):
        params = SamplingParams(max_tokens=decode, ignore_eos=True)
        p.extend(prompt(n + i, new))
        sched.add_request(Request(f"r{i}", p, params, None, block_hasher=hasher))
    del prompts
    other = sum(timers.take()[0].values())  # on_new_request
    decode_spent: dict[str, float] = defaultdict(float)
    vllm_decode = 0.0
    decode_steps = steps = 0
    profiler = cProfile.Profile() if profile else None
    loaded = LOADED[which]
    while sched.has_requests():
        if profiler and decode_steps:  # the decode steps (and the last ones)
            profiler.enable()
        is_decode, seconds = step(sched, which)
        if profiler:
            profiler.disable()
        steps += 1
        spent, finishes = timers.take()
        if is_decode and not finishes:
            decode_steps += 1
            vllm_decode += seconds
            for kind, s in spent.items():
                decode_spent[kind] += s
            if per_step:
                print(
                    f"per-step {which} {n} x {tokens} decode step {decode_steps}: "
                    + " / ".join(
                        f"{spent.get(kind, 0.0) * 1e6:,.0f}" for kind in ("metadata", "finished", "events")
                    )
                    + " us (metadata / finished / events)",
                    file=sys.stderr,
                )
        else:
            other += sum(spent.values())
        if steps > 100_000:
            raise RuntimeError("the requests did not finish")
    if profiler:
        profiler.dump_stats(f"batch-{which}.prof")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    result = {f"decode {kind}": decode_spent.get(kind, 0.0) / max(decode_steps, 1) for kind in KINDS}
    result["decode total"] = sum(decode_spent.values()) / max(decode_steps, 1)
    result["decode vllm step"] = vllm_decode / max(decode_steps, 1)
    result["other per request"] = other / n
    result["decode steps"] = decode_steps
    result["steps"] = steps
    result["loaded tokens per request"] = (LOADED[which] - loaded) * BLOCK / n
    sched.shutdown()
    del sched
    gc.unfreeze()
    gc.collect()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", default="256,1024")
    parser.add_argument("--tokens", default="8192,32768")
    parser.add_argument("--decode", type=int, default=32, help="tokens each request decodes")
    parser.add_argument("--new", type=int, default=256, help="prompt tokens past the stored prefix")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--connectors", default="kvoffload,vllm")
    parser.add_argument("--kvoffload-extra", default="{}", help="JSON: more kv_connector_extra_config keys")
    parser.add_argument(
        "--profile", choices=tuple(CONNECTORS), help="cProfile one's decode steps on (batch-<name>.prof)"
    )
    parser.add_argument(
        "--per-step", action="store_true", help="each decode step's connector us (first turn), on stderr"
    )
    args = parser.parse_args()
    init_none_hash(sha256)
    which_all = args.connectors.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        longest = max(map(int, args.tokens.split(","))) + args.decode + 2 * BLOCK
        model = str(build_tiny_llama(os.path.join(tmp, "tiny"), max_position_embeddings=longest))
        print(
            f"## Connector scheduler side at batch scale ({args.decode} decode tokens, {args.new} new "
            f"prompt tokens past a CPU-tier prefix, kvoffload extra {args.kvoffload_extra}, "
            f"load {os.getloadavg()[0]:.2f})"
        )
        print()
        print(
            "| requests x tokens | connector | matching | allocation | metadata | finished | events "
            "| us/decode step | vs vLLM | vLLM's step us | rest, us/request | vs vLLM "
            "| loaded tokens/req |"
        )
        print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for n in map(int, args.requests.split(",")):
            for tokens in map(int, args.tokens.split(",")):
                runs: dict[str, list[dict[str, float]]] = defaultdict(list)
                for rep in range(args.reps):
                    order = which_all if rep % 2 == 0 else which_all[::-1]
                    for which in order:
                        profile = args.profile == which and rep == 0
                        more = json.loads(args.kvoffload_extra) if which == "kvoffload" else {}
                        runs[which].append(
                            run_case(
                                model,
                                which,
                                n,
                                tokens,
                                args.decode,
                                args.new,
                                more,
                                profile,
                                args.per_step and rep == 0,
                            )
                        )
                med = {w: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for w, rs in runs.items()}
                base = med.get("vllm")
                for which, m in med.items():
                    step_ratio = f"{m['decode total'] / base['decode total']:.2f}x" if base else "-"
                    rest_ratio = f"{m['other per request'] / base['other per request']:.2f}x" if base else "-"
                    print(
                        f"| {n} x {tokens} | {which} | "
                        + " | ".join(f"{m['decode ' + k] * 1e6:,.0f}" for k in KINDS)
                        + f" | {m['decode total'] * 1e6:,.0f} | {step_ratio} "
                        f"| {m['decode vllm step'] * 1e6:,.0f} "
                        f"| {m['other per request'] * 1e6:,.0f} | {rest_ratio} "
                        f"| {m['loaded tokens per request']:,.0f} |",
                        flush=True,
                    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
