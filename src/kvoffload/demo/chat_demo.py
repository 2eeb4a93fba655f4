"""The engine demo: a multi-turn chat workload on vLLM, with and without kvoffload.

Conversations share a system prompt and grow turn by turn; turns are served round robin
across conversations, and the engine's own KV cache is deliberately too small to keep a
conversation between its turns. Without kvoffload each turn recomputes its history; with
it, the history comes back from the CPU tier. Prompts are token ids (the history plus the
tokens the engine generated), as a chat server would send them.

Per turn it prints prompt tokens, tokens served from the engine cache and from kvoffload,
and time to first token in both runs; then totals, the speed-up, whether every output
matched, and the KV events seen on the engine's event stream.
"""

from __future__ import annotations

import os
import random
import statistics
import sys
import tempfile
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from kvoffload.demo.offline import close_llm, kv_block_bytes, make_llm, scheduler_connector, word_text
from kvoffload.demo.tiny_model import build_tiny_llama
from kvoffload.events import EventSubscriber
from kvoffload.integrations.vllm.config import DEFAULT_SWITCH_INTERVAL_S

TOKEN_OFFSET = 3  # the tiny model's byte tokenizer: byte b is token b + 3


@dataclass(frozen=True)
class ChatDemoConfig:
    conversations: int = 6
    turns: int = 4
    system_tokens: int = 2048
    user_tokens: int = 512
    answer_tokens: int = 16
    engine_kv_blocks: int = 160  # 32-token blocks: 5,120 tokens, about one conversation
    cpu_bytes: int = 512 << 20
    model_dir: str = ".cache/tiny-llama"
    seed: int = 0


@dataclass
class TurnResult:
    conversation: int
    turn: int
    prompt_tokens: int
    cached_tokens: int
    offloaded_tokens: int
    ttft_s: float
    output: list[int]


@dataclass
class RunResult:
    turns: list[TurnResult]
    events: Counter = field(default_factory=Counter)


def _text_tokens(rng: random.Random, n: int) -> list[int]:
    text = word_text(rng, n)
    return [b + TOKEN_OFFSET for b in text.encode()]


def _workload(cfg: ChatDemoConfig) -> tuple[list[int], list[list[list[int]]]]:
    rng = random.Random(cfg.seed)
    system = _text_tokens(rng, cfg.system_tokens)
    users = [[_text_tokens(rng, cfg.user_tokens) for _ in range(cfg.turns)] for _ in range(cfg.conversations)]
    return system, users


class _EventCounter:
    """Counts the engine's KV events by type and medium, on a background thread."""

    def __init__(self, endpoint: str) -> None:
        self.counts: Counter = Counter()
        self._subscriber = EventSubscriber(endpoint)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            got = self._subscriber.receive(timeout=0.1)
            if got is not None:
                for event in got[1].events:
                    self.counts[(type(event).__name__, getattr(event, "medium", None))] += 1

    def close(self) -> Counter:
        self._stop.set()
        self._thread.join()
        self._subscriber.close()
        return self.counts


def run_chat(
    cfg: ChatDemoConfig,
    model: str,
    offload: bool,
    events_endpoint: str | None = None,
    engine_kv_blocks: int | None = None,
) -> RunResult:
    """Serve the workload on one engine (``engine_kv_blocks`` overrides the cache size)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    system, users = _workload(cfg)
    counter = _EventCounter(events_endpoint) if events_endpoint else None
    llm = make_llm(
        model,
        kvoffload={"cpu_bytes_to_use": cfg.cpu_bytes} if offload else None,
        kv_cache_bytes=(engine_kv_blocks or cfg.engine_kv_blocks) * kv_block_bytes(model),
        max_model_len=(cfg.engine_kv_blocks - 1) * 32,  # one block is vLLM's null block
        events_endpoint=events_endpoint,
    )
    params = SamplingParams(temperature=0, max_tokens=cfg.answer_tokens, ignore_eos=True)
    connector = scheduler_connector(llm) if offload else None
    histories = [list(system) for _ in range(cfg.conversations)]
    turns: list[TurnResult] = []
    try:
        for t in range(cfg.turns):
            for c in range(cfg.conversations):
                histories[c] += users[c][t]
                before = connector.offload_stats().tokens_loaded if connector else 0
                out = llm.generate([TokensPrompt(prompt_token_ids=histories[c])], params, use_tqdm=False)[0]
                loaded = (connector.offload_stats().tokens_loaded if connector else 0) - before
                answer = list(out.outputs[0].token_ids)
                turns.append(
                    TurnResult(
                        c,
                        t,
                        len(histories[c]),
                        out.num_cached_tokens - loaded,
                        loaded,
                        out.metrics.first_token_latency,
                        answer,
                    )
                )
                histories[c] += answer
    finally:
        close_llm(llm)
    return RunResult(turns, counter.close() if counter else Counter())


def main(cfg: ChatDemoConfig = ChatDemoConfig()) -> int:
    # kvoffload's worker side lowers the interpreter's switch interval (the connector's
    # switch_interval_s); the engine without kvoffload runs under the same setting, so the
    # comparison measures kvoffload, not the interpreter.
    sys.setswitchinterval(min(sys.getswitchinterval(), DEFAULT_SWITCH_INTERVAL_S))
    model = str(build_tiny_llama(cfg.model_dir))
    print(
        f"tiny Llama (4 layers, hidden 256, float32) at {model}; "
        f"{cfg.conversations} conversations x {cfg.turns} turns, "
        f"system prompt {cfg.system_tokens} tokens, {cfg.user_tokens} per user turn, "
        f"{cfg.answer_tokens} per answer; "
        f"engine KV cache {cfg.engine_kv_blocks * 32} tokens, kvoffload CPU tier {cfg.cpu_bytes >> 20} MiB"
    )
    print("running without kvoffload ...", flush=True)
    base = run_chat(cfg, model, offload=False)
    print("running with kvoffload ...", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        with_kv = run_chat(cfg, model, offload=True, events_endpoint=f"ipc://{Path(tmp) / 'kv-events'}")
    print()
    print(
        f"{'conv':>4} {'turn':>4} {'prompt':>7} | {'engine':>7} {'ttft ms':>8} | "
        f"{'engine':>7} {'kvoffload':>9} {'ttft ms':>8} | same"
    )
    print(
        f"{'':>4} {'':>4} {'tokens':>7} | {'cached':>7} {'(base)':>8} | {'cached':>7} {'tokens':>9} {'':>8} |"
    )
    for b, k in zip(base.turns, with_kv.turns):
        same = "yes" if b.output == k.output else "NO"
        print(
            f"{b.conversation:>4} {b.turn:>4} {b.prompt_tokens:>7} | "
            f"{b.cached_tokens:>7} {b.ttft_s * 1e3:>8.1f} | "
            f"{k.cached_tokens:>7} {k.offloaded_tokens:>9} {k.ttft_s * 1e3:>8.1f} | {same}"
        )
    total_base = sum(t.ttft_s for t in base.turns)
    total_kv = sum(t.ttft_s for t in with_kv.turns)
    prompt = sum(t.prompt_tokens for t in base.turns)
    mismatches = sum(b.output != k.output for b, k in zip(base.turns, with_kv.turns))
    print()
    print(f"prompt tokens: {prompt}")
    print(
        f"without kvoffload: {sum(t.cached_tokens for t in base.turns)} from the engine cache, "
        f"{prompt - sum(t.cached_tokens for t in base.turns)} recomputed; TTFT total {total_base:.2f} s, "
        f"median {statistics.median(t.ttft_s for t in base.turns) * 1e3:.0f} ms"
    )
    cached = sum(t.cached_tokens for t in with_kv.turns)
    offloaded = sum(t.offloaded_tokens for t in with_kv.turns)
    print(
        f"with kvoffload:    {cached} from the engine cache, {offloaded} from kvoffload, "
        f"{prompt - cached - offloaded} recomputed; TTFT total {total_kv:.2f} s, "
        f"median {statistics.median(t.ttft_s for t in with_kv.turns) * 1e3:.0f} ms"
    )
    print(
        f"speed-up in time to first token: {total_base / total_kv:.2f}x; "
        f"outputs identical: {mismatches == 0} ({mismatches} differ)"
    )
    print(
        "KV events seen:",
        ", ".join(f"{name}[{medium}]={n}" for (name, medium), n in sorted(with_kv.events.items(), key=str)),
    )
    return 0 if mismatches == 0 else 1


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    raise SystemExit(main())
