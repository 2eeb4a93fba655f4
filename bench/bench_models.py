"""The demo's chat workload on every model of the tiny zoo, served three ways in one run:
(a) the engine alone, (b) vLLM's own ``OffloadingConnector`` with its CPU manager,
(c) kvoffload's ``KVOffloadConnector``; both connectors get the same CPU budget
(``cpu_bytes_to_use``, ``--cpu-mib``) and ``kv_load_failure_policy: "recompute"``.

Workload: ``kvoffload.demo.chat_demo``'s (its ``ChatDemoConfig`` and generator, scaled
down; default 4 conversations x 3 turns, prompts 544..1,128 tokens): conversations share
a system prompt and grow turn by turn (history, the engine's own greedy answer, the next
user turn; prompts are token ids), turns are served round robin, one request at a time.
The engine's KV cache is the same number of blocks for the three ways
(``num_gpu_blocks_override``): the fewest vLLM admits a ``--engine-tokens``
(= ``max_model_len``) request with, measured on a throw-away engine per model. It cannot
keep a conversation between its turns, so a conversation's prefix is evicted from the
device and must be recomputed (a) or reloaded (b, c).

Per model and repetition the three engines are built fresh and live side by side in this
process; every request is served by the three in turn, back to back, the order rotating
from request to request and between repetitions, so machine drift hits all three alike.
vLLM keeps the worker-side connector in one process-wide slot
(``kv_transfer_state._KV_CONNECTOR_AGENT``); each engine's own connector (or none) is put
there around its calls. Each engine first serves two unmeasured warm-up requests of
unrelated text. All engines run under the interpreter switch interval kvoffload's worker
sets (set for the whole process first).

Measured per request:

* prompt tokens;
* tokens reloaded from a connector: the ``num_external_tokens`` vLLM's scheduler passes
  to the scheduler-side connector's ``update_state_after_alloc`` (the tokens it took from
  the connector and allocated blocks for), wrapped the same way for both connectors; for
  kvoffload it is checked against kvoffload's own counter (``tokens_loaded``, which also
  takes back failed loads);
* tokens from the engine's own prefix cache: ``num_cached_tokens`` (engine + connector)
  minus the reloaded tokens; the rest was recomputed;
* time to first token: vLLM's ``metrics.first_token_latency`` (from the request's
  arrival at the engine's input processor to the output step carrying its first token;
  it includes any wait for an asynchronous load and the transfers done in the engine
  steps up to then); the total over a run's requests and the median over requests;
* the output token ids (greedy): every way must give (a)'s tokens for every request;
  mismatches are counted (and between the two connectors).

Printed per model: the figures of each way (per run, mean of the repetitions); ratios
kvoffload / vLLM connector and each against no offloading, for reloaded (and recomputed)
tokens and TTFT (total over all repetitions, per repetition, median, and the median of
per-request ratios, request against the same request of the other way); the baseline's
absolute figures. A way that fails on a model is reported with its error's first line
and left out; the others go on.

vLLM on its CPU build has no CPU copy worker for its connector
(``CPUOffloadingSpec.get_worker`` refuses platforms other than CUDA-alike and XPU). This
file gives it one: ``HostCopyOffloadingSpec`` is vLLM's ``CPUOffloadingSpec`` (its
manager, its sizing of CPU chunks from ``cpu_bytes_to_use``, its LRU eviction) whose
``get_worker`` returns ``HostCopyWorker``, an ``OffloadingWorker`` that copies pages
synchronously between the engine's KV tensors (host memory on the CPU build) and host
chunk tensors with ``index_select``/``index_copy_``. vLLM's connector loads it through the
extra-config keys ``spec_name`` and ``spec_module_path`` (``OffloadingSpecFactory``).
vLLM's default ``offload_prompt_only`` (only prompt blocks are stored, not those an
answer fills) is kept.

Run (about 5 minutes on the 2-core machine; vLLM's own warnings go to stdout, the
summary is printed again at the end):

    .venv/bin/python bench/bench_models.py [--models llama,sliding_window,mla,gdn]
        [--conversations N] [--turns N] [--reps N] [--system-tokens N] [--user-tokens N]
        [--answer-tokens N] [--engine-tokens N] [--cpu-mib N] [--zoo-dir DIR] [--seed N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

for _name, _value in (
    ("VLLM_ENABLE_V1_MULTIPROCESSING", "0"),
    ("HF_HUB_OFFLINE", "1"),
    ("TRANSFORMERS_OFFLINE", "1"),
    ("VLLM_LOGGING_LEVEL", "WARNING"),
):
    os.environ.setdefault(_name, _value)

import numpy as np  # noqa: E402 - after the settings vLLM reads at import
import torch  # noqa: E402
from vllm.v1.kv_offload.base import (  # noqa: E402
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec  # noqa: E402

WAYS = ("no offloading", "vLLM connector", "kvoffload")
# --ideal: an engine without a connector whose cache keeps every conversation, the bound no
# connector can beat (every reloaded token is already on the device, nothing is copied)
IDEAL = "engine cache for all"
SPEC_NAME = "HostCopyOffloadingSpec"


# -- vLLM's OffloadingConnector on the CPU build -----------------------------------------


class HostCopyWorker(OffloadingWorker):
    """Moves KV pages between the engine's cache and vLLM's CPU chunks, synchronously.

    Per canonical KV tensor of the engine (``(num_blocks, page_bytes)`` int8 views of its
    cache, host memory on the CPU build) it keeps a host tensor of
    ``num_chunks * blocks_per_chunk`` rows of the same page size: row
    ``chunk * blocks_per_chunk + j`` holds the ``j``-th engine block of CPU chunk
    ``chunk``. A job copies, for every offloaded group, each of the group's tensors'
    pages (the group's page size on that tensor) with one ``index_select`` and one
    ``index_copy_``; it is complete when ``submit_*`` returns."""

    def __init__(self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int, num_chunks: int) -> None:
        self._per_chunk = blocks_per_chunk
        self._device: list[torch.Tensor] = []
        self._host: list[torch.Tensor] = []
        for entry in kv_caches.tensors:
            device = entry.tensor if entry.tensor.dtype == torch.int8 else entry.tensor.view(torch.int8)
            if device.dim() != 2 or device.shape[1] != entry.page_size_bytes:
                raise ValueError(
                    f"unexpected KV tensor view {tuple(device.shape)}, page {entry.page_size_bytes}"
                )
            self._device.append(device)
            self._host.append(torch.zeros((num_chunks * blocks_per_chunk, device.shape[1]), dtype=torch.int8))
        # Per offloaded group: (tensor index, bytes of the group's page on that tensor).
        self._groups: list[list[tuple[int, int]]] = []
        for refs in kv_caches.group_data_refs:
            size: dict[int, int] = {}
            for ref in refs:
                size[ref.tensor_idx] = max(size.get(ref.tensor_idx, 0), ref.page_size_bytes)
            self._groups.append(sorted(size.items()))
        self._finished: list[TransferResult] = []

    def _pairs(self, engine: GPULoadStoreSpec, host: LoadStoreSpec):
        """``(group, engine block ids, host rows)`` of a job, group by group."""
        blocks = engine.block_ids
        chunks = host.block_ids  # CPU chunk indices
        per = self._per_chunk
        b = c = 0
        for group, (count, first) in enumerate(zip(engine.group_sizes, engine.block_indices)):
            if count == 0:
                continue
            skip = first % per  # engine blocks of the first chunk before this job's
            used = -(-(count + skip) // per)
            rows = (chunks[c : c + used].astype(np.int64)[:, None] * per + np.arange(per)).ravel()
            yield (
                group,
                torch.from_numpy(blocks[b : b + count].astype(np.int64)),
                torch.from_numpy(rows[skip : skip + count].copy()),
            )
            b += count
            c += used
        if b != len(blocks) or c != len(chunks):
            raise ValueError(f"job covers {b}/{len(blocks)} engine blocks, {c}/{len(chunks)} chunks")

    def _copy(self, job_id: int, engine: GPULoadStoreSpec, host: LoadStoreSpec, store: bool) -> bool:
        start = time.perf_counter()
        moved = 0
        for group, ids, rows in self._pairs(engine, host):
            for t, size in self._groups[group]:
                device = self._device[t][:, :size]
                cpu = self._host[t][:, :size]
                if store:
                    cpu.index_copy_(0, rows, device.index_select(0, ids))
                else:
                    device.index_copy_(0, ids, cpu.index_select(0, rows))
                moved += size * len(ids)
        self._finished.append(TransferResult(job_id, True, moved, time.perf_counter() - start))
        return True

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        return self._copy(job_id, src_spec, dst_spec, store=True)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        return self._copy(job_id, dst_spec, src_spec, store=False)

    def get_finished(self) -> list[TransferResult]:
        done, self._finished = self._finished, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        return  # every job finished inside its submit_* call

    def shutdown(self) -> None:
        self._host.clear()
        self._device.clear()


class HostCopyOffloadingSpec(CPUOffloadingSpec):
    """vLLM's CPU offloading spec (its manager, chunk sizing and eviction) with a worker
    that runs on any platform."""

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            if self.config.canonical_layout:
                raise ValueError("HostCopyWorker copies the engine's own page layout only")
            self._worker = HostCopyWorker(kv_caches, self.blocks_per_chunk, self.num_chunks)
        return self._worker


def vllm_connector_config(cpu_bytes: int) -> dict[str, Any]:
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "cpu_bytes_to_use": cpu_bytes,
            "spec_name": SPEC_NAME,
            "spec_module_path": __name__,  # this module ("__main__" when run as a script)
        },
        "kv_load_failure_policy": "recompute",
    }


# -- the workload ---------------------------------------------------------------------------


@dataclass
class Turn:
    prompt: int
    engine_cached: int
    reloaded: int
    ttft_s: float
    output: list[int]


@dataclass
class Stats:
    """One way on one model, all repetitions."""

    runs: list[list[Turn]] = field(default_factory=list)
    own_counter: list[int] = field(default_factory=list)  # kvoffload's tokens_loaded per run
    error: str | None = None

    def turns(self) -> list[Turn]:
        return [t for run in self.runs for t in run]

    def total(self, attr: str) -> float:
        return sum(getattr(t, attr) for t in self.turns())


def _slot(connector: Any) -> None:
    """Put ``connector`` in vLLM's process-wide worker-side connector slot, which every
    in-process engine's model runner consults (``None``: no connector)."""
    from vllm.distributed.kv_transfer import kv_transfer_state

    kv_transfer_state._KV_CONNECTOR_AGENT = connector


class Engine:
    """One way's engine on one model, with its conversations' histories and counters."""

    def __init__(self, model: str, family: str, way: str, args: argparse.Namespace, blocks: int) -> None:
        from vllm.distributed.kv_transfer import kv_transfer_state

        from kvoffload.demo.offline import make_llm, scheduler_connector
        from kvoffload.demo.tiny_zoo import engine_args

        self.way = way
        extra = dict(engine_args(family))
        cpu_bytes = args.cpu_mib << 20
        kvoffload = None
        if way == "vLLM connector":
            extra["kv_transfer_config"] = vllm_connector_config(cpu_bytes)
        elif way == "kvoffload":
            kvoffload = {"cpu_bytes_to_use": cpu_bytes, **json.loads(args.kvoffload_extra)}
        elif way == IDEAL:  # room for every conversation (each fits in `blocks`) and the warm-up
            blocks = blocks * (args.conversations + 2)
        _slot(None)  # vLLM installs a worker connector only into an empty slot
        try:
            self.llm = make_llm(
                model,
                kvoffload=kvoffload,
                max_model_len=args.engine_tokens,
                num_gpu_blocks_override=blocks,
                seed=args.seed,
                **extra,
            )
            self.connector = kv_transfer_state._KV_CONNECTOR_AGENT
        finally:
            _slot(None)
        connected = way in ("vLLM connector", "kvoffload")
        if (self.connector is None) == connected:
            self.close()
            raise RuntimeError(f"{way}: unexpected worker connector {self.connector!r}")
        # Tokens vLLM's scheduler takes from the connector: update_state_after_alloc's
        # num_external_tokens, for both connectors alike.
        self.reloaded = 0
        self._own = None
        if connected:
            sched = scheduler_connector(self.llm)
            original = sched.update_state_after_alloc

            def counted(request: Any, blocks: Any, num_external_tokens: int) -> Any:
                self.reloaded += num_external_tokens
                return original(request, blocks, num_external_tokens)

            sched.update_state_after_alloc = counted
            self._own = sched if way == "kvoffload" else None
        self.histories: list[list[int]] = []
        self.turns: list[Turn] = []
        self._own_start = 0

    def generate(self, prompt: Any, params: Any) -> Any:
        _slot(self.connector)
        try:
            return self.llm.generate([prompt], params, use_tqdm=False)[0]
        finally:
            _slot(None)

    def start(self, system: list[int], conversations: int) -> None:
        self.histories = [list(system) for _ in range(conversations)]
        self.reloaded = 0
        self._own_start = self.own_loaded()

    def own_loaded(self) -> int:
        """kvoffload's own counter of tokens loaded (0 for the other ways)."""
        return self._own.offload_stats().tokens_loaded if self._own else 0

    def turn(self, c: int, user: list[int], params: Any) -> None:
        from vllm.inputs import TokensPrompt

        self.histories[c] += user
        before = self.reloaded
        out = self.generate(TokensPrompt(prompt_token_ids=self.histories[c]), params)
        reloaded = self.reloaded - before
        answer = list(out.outputs[0].token_ids)
        self.turns.append(
            Turn(
                len(self.histories[c]),
                out.num_cached_tokens - reloaded,
                reloaded,
                out.metrics.first_token_latency,
                answer,
            )
        )
        self.histories[c] += answer

    def close(self) -> None:
        from kvoffload.demo.offline import close_llm

        _slot(self.connector)  # its shutdown releases the slot's connector: this one
        try:
            close_llm(self.llm)
        finally:
            _slot(None)


def run_model(
    model: str, family: str, args: argparse.Namespace, blocks: int, stats: dict[str, Stats]
) -> None:
    """``args.reps`` repetitions of the workload on the ways' engines (``stats``), side by side:
    fresh engines per repetition, every request served by the three in turn (the order
    rotates from one request to the next and between repetitions)."""
    from vllm import SamplingParams

    from kvoffload.demo.chat_demo import ChatDemoConfig, _workload
    from kvoffload.demo.offline import word_text

    cfg = ChatDemoConfig(
        conversations=args.conversations,
        turns=args.turns,
        system_tokens=args.system_tokens,
        user_tokens=args.user_tokens,
        answer_tokens=args.answer_tokens,
        seed=args.seed,
    )
    system, users = _workload(cfg)
    params = SamplingParams(temperature=0, max_tokens=cfg.answer_tokens, ignore_eos=True)
    warm = word_text(10_000 + args.seed, len(system) + cfg.turns * cfg.user_tokens)
    ways = tuple(stats)
    for rep in range(args.reps):
        engines: dict[str, Engine] = {}
        try:
            for way in ways[rep % len(ways) :] + ways[: rep % len(ways)]:
                if stats[way].error:
                    continue
                try:
                    engine = Engine(model, family, way, args, blocks)
                    engines[way] = engine
                    for _ in range(2):  # an engine's first requests pay one-off costs: not measured
                        engine.generate(warm, params)
                    engine.start(system, cfg.conversations)
                except Exception as exc:  # reported; the other ways go on
                    stats[way].error = _first_line(exc)
                    print(f"{family} / {way}: {stats[way].error}", flush=True)
            i = 0
            for t in range(cfg.turns):
                for c in range(cfg.conversations):
                    k = (i + rep) % len(ways)
                    for way in ways[k:] + ways[:k]:
                        engine = engines.get(way)
                        if engine is None or stats[way].error:
                            continue
                        try:
                            engine.turn(c, users[c][t], params)
                        except Exception as exc:  # reported; the other ways go on
                            stats[way].error = _first_line(exc)
                            print(f"{family} / {way}: {stats[way].error}", flush=True)
                    i += 1
            for way, engine in engines.items():
                if not stats[way].error:
                    stats[way].runs.append(engine.turns)
                    if way == "kvoffload":
                        stats[way].own_counter.append(engine.own_loaded() - engine._own_start)
        finally:
            for engine in engines.values():
                try:
                    engine.close()
                except Exception as exc:
                    print(f"{family} / {engine.way}: closing failed: {_first_line(exc)}", flush=True)


def engine_blocks_for(model: str, family: str, args: argparse.Namespace) -> tuple[int, str]:
    """The engine KV blocks of all three ways: the fewest vLLM admits a
    ``--engine-tokens`` request with (each group's ``max_memory_usage_bytes`` in pages),
    plus its null block; and a description of the groups. From a throw-away engine
    without a connector, which also takes the process's one-off start-up costs."""
    from kvoffload.demo.offline import close_llm, make_llm
    from kvoffload.demo.tiny_zoo import engine_args

    _slot(None)
    llm = make_llm(model, max_model_len=args.engine_tokens, **engine_args(family))
    try:
        vllm_config = llm.llm_engine.vllm_config
        config = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config
        specs = [g.kv_cache_spec for g in config.kv_cache_groups]
        per_group = [-(-spec.max_memory_usage_bytes(vllm_config) // spec.page_size_bytes) for spec in specs]
        described = ", ".join(f"{type(spec).__name__} {n}" for spec, n in zip(specs, per_group))
        return 1 + sum(per_group), f"groups (blocks each): {described}; block {specs[0].block_size} tokens"
    finally:
        close_llm(llm)


# -- report --------------------------------------------------------------------------------


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.3f}" if b else "n/a"


def _median_ms(s: Stats) -> float:
    return statistics.median(t.ttft_s for t in s.turns()) * 1e3


def _run_ttft(s: Stats) -> list[float]:
    return [sum(t.ttft_s for t in run) for run in s.runs]


def _paired(s: Stats, ref: Stats) -> float:
    """Median over requests of this way's TTFT / the reference's for the same request
    (served back to back, so machine drift mostly cancels)."""
    return statistics.median(
        x.ttft_s / y.ttft_s for mine, theirs in zip(s.runs, ref.runs) for x, y in zip(mine, theirs)
    )


def _differ(s: Stats, ref: Stats) -> str:
    pairs = [(x.output, y.output) for mine, theirs in zip(s.runs, ref.runs) for x, y in zip(mine, theirs)]
    return f"{sum(a != b for a, b in pairs)} of {len(pairs)}"


def report(family: str, dtype: str, described: str, blocks: int, stats: dict[str, Stats]) -> list[str]:
    lines = ["", f"### {family} ({dtype}; {described}; engine cache {blocks} blocks for all three ways)", ""]
    lines += [f"{way}: FAILED: {s.error}" for way, s in stats.items() if s.error]
    ok = {way: s for way, s in stats.items() if not s.error and s.runs}
    if not ok:
        return lines
    base, kv, vc = ok.get("no offloading"), ok.get("kvoffload"), ok.get("vLLM connector")
    lines += [
        "| way | runs | prompt tokens | from engine cache | reloaded | recomputed | "
        "TTFT total (s) | median TTFT (ms) | outputs differing from (a) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for way, s in ok.items():
        n = len(s.runs)
        prompt, cached, reloaded = (s.total(k) / n for k in ("prompt", "engine_cached", "reloaded"))
        computed = prompt - cached - reloaded
        differ = _differ(s, base) if base is not None and s is not base else "-"
        lines.append(
            f"| {way} | {n} | {prompt:.0f} | {cached:.0f} | {reloaded:.0f} | {computed:.0f} "
            f"| {s.total('ttft_s') / n:.3f} | {_median_ms(s):.1f} | {differ} |"
        )
    lines.append("(tokens and TTFT total: summed over one run's requests, mean of the runs)")
    for way, s in ok.items():
        unstable = sum(len(set(map(tuple, col))) > 1 for col in zip(*([t.output for t in r] for r in s.runs)))
        if unstable:
            lines.append(f"{way}: {unstable} requests gave different outputs in different repetitions")
    if kv and vc:
        lines.append(f"outputs differing between kvoffload and the vLLM connector: {_differ(kv, vc)}")
    if kv and kv.own_counter:
        own, hook = sum(kv.own_counter), kv.total("reloaded")
        lines.append(
            f"kvoffload's own tokens_loaded counter: {own} over all runs "
            f"({'agrees' if own == hook else 'DIFFERS'} with the scheduler hook: {hook:.0f})"
        )
    lines.append("")
    if kv and vc:
        runs = " / ".join(f"{a / b:.3f}" for a, b in zip(_run_ttft(kv), _run_ttft(vc)))
        lines.append(
            "kvoffload / vLLM connector: reloaded tokens "
            f"{_ratio(kv.total('reloaded'), vc.total('reloaded'))}; TTFT total "
            f"{_ratio(kv.total('ttft_s'), vc.total('ttft_s'))} (per repetition {runs}), median TTFT "
            f"{_ratio(_median_ms(kv), _median_ms(vc))}, median per-request ratio {_paired(kv, vc):.3f}"
        )
    if base:
        n = len(base.runs)
        lines.append(
            f"no offloading, absolute: TTFT total {base.total('ttft_s') / n:.3f} s per run, "
            f"median TTFT {_median_ms(base):.1f} ms; {base.total('prompt') / n:.0f} prompt tokens per run, "
            f"{base.total('engine_cached') / n:.0f} of them from the engine cache"
        )
        base_computed = base.total("prompt") - base.total("engine_cached")
        for s, way in ((vc, "vLLM connector"), (kv, "kvoffload")):
            if s is None:
                continue
            runs = " / ".join(f"{a / b:.3f}" for a, b in zip(_run_ttft(s), _run_ttft(base)))
            computed = s.total("prompt") - s.total("engine_cached") - s.total("reloaded")
            lines.append(
                f"{way} / no offloading: TTFT total {_ratio(s.total('ttft_s'), base.total('ttft_s'))} "
                f"(per repetition {runs}), median TTFT {_ratio(_median_ms(s), _median_ms(base))}, "
                f"median per-request ratio {_paired(s, base):.3f}; recomputed tokens "
                f"{_ratio(computed, base_computed)}, reloaded {s.total('reloaded') / s.total('prompt'):.1%} "
                "of the prompt tokens"
            )
    ideal = ok.get(IDEAL)
    if ideal:
        n = len(ideal.runs)
        lines.append(
            f"{IDEAL} (the bound), absolute: TTFT total {ideal.total('ttft_s') / n:.3f} s per run, "
            f"median {_median_ms(ideal):.1f} ms, {ideal.total('engine_cached') / n:.0f} tokens from its cache"
        )
        for s, way in ((vc, "vLLM connector"), (kv, "kvoffload")):
            if s is not None:
                runs = " / ".join(f"{a / b:.3f}" for a, b in zip(_run_ttft(s), _run_ttft(ideal)))
                lines.append(
                    f"{way} / {IDEAL}: TTFT total {_ratio(s.total('ttft_s'), ideal.total('ttft_s'))} "
                    f"(per repetition {runs}), median per-request ratio {_paired(s, ideal):.3f}"
                )
        if vc:
            lines.append(
                f"the lowest TTFT total any connector can reach against vLLM's here: "
                f"{_ratio(ideal.total('ttft_s'), vc.total('ttft_s'))} ({IDEAL} / vLLM connector)"
            )
    return lines


def main() -> int:
    from kvoffload.demo.tiny_zoo import FAMILIES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(FAMILIES), help=f"comma-separated, of {FAMILIES}")
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--reps", type=int, default=2, help="repetitions (fresh engines; the order rotates)")
    parser.add_argument("--system-tokens", type=int, default=256)
    parser.add_argument("--user-tokens", type=int, default=288)
    parser.add_argument("--answer-tokens", type=int, default=4)
    parser.add_argument(
        "--engine-tokens",
        type=int,
        default=1152,
        help="max_model_len; the engine cache is the smallest vLLM admits a request of this length with",
    )
    parser.add_argument("--cpu-mib", type=int, default=256, help="cpu_bytes_to_use of both connectors, MiB")
    parser.add_argument(
        "--kvoffload-extra", default="{}", help="JSON: more kv_connector_extra_config keys for kvoffload"
    )
    parser.add_argument("--zoo-dir", default=".cache/zoo")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--ideal", action="store_true", help=f"a fourth way, '{IDEAL}': the bound no connector can beat"
    )
    args = parser.parse_args()

    from kvoffload.demo.tiny_zoo import build_tiny_model, engine_args
    from kvoffload.integrations.vllm.config import DEFAULT_SWITCH_INTERVAL_S

    families = [f.strip() for f in args.models.split(",") if f.strip()]
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        parser.error(f"unknown model families {unknown}; the zoo has {FAMILIES}")
    a = args
    prompts = [a.system_tokens + (t + 1) * a.user_tokens + t * a.answer_tokens for t in range(a.turns)]
    if prompts[-1] + a.answer_tokens > a.engine_tokens:
        parser.error(f"the last turn needs {prompts[-1] + a.answer_tokens} tokens, over --engine-tokens")

    sys.setswitchinterval(min(sys.getswitchinterval(), DEFAULT_SWITCH_INTERVAL_S))
    load_start = "/".join(f"{x:.2f}" for x in os.getloadavg())
    started = time.perf_counter()
    header = (
        f"chat workload: {a.conversations} conversations x {a.turns} turns, round robin; system prompt "
        f"{a.system_tokens} tokens, {a.user_tokens} per user turn, {a.answer_tokens} per answer "
        f"(prompts {prompts[0]}..{prompts[-1]} tokens); max_model_len {a.engine_tokens}; "
        f"CPU budget of both connectors {a.cpu_mib} MiB; {a.reps} repetitions; "
        f"switch interval {sys.getswitchinterval() * 1e3:g} ms"
    )
    print(header, flush=True)
    summary: list[str] = []
    for family in families:
        model_started = time.perf_counter()
        stats = {way: Stats() for way in WAYS + ((IDEAL,) if args.ideal else ())}
        try:
            model = str(build_tiny_model(os.path.join(args.zoo_dir, family), family))
            blocks, described = engine_blocks_for(model, family, args)
        except Exception as exc:  # reported; the other models go on
            summary += ["", f"### {family}", "", f"model or probe engine FAILED: {_first_line(exc)}"]
            print(summary[-1], flush=True)
            continue
        try:
            run_model(model, family, args, blocks, stats)
        except Exception as exc:  # reported; the other models go on
            summary += ["", f"{family}: FAILED: {_first_line(exc)}"]
            print(summary[-1], flush=True)
        summary += report(family, engine_args(family).get("dtype", "float32"), described, blocks, stats)
        print(f"=== {family}: done in {time.perf_counter() - model_started:.0f} s", flush=True)
    print("\n".join(["", "=" * 80, "", header, *summary]))
    print()
    print(
        f"load average (1/5/15 min) {load_start} at start, "
        f"{'/'.join(f'{x:.2f}' for x in os.getloadavg())} at end; {time.perf_counter() - started:.0f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
