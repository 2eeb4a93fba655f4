"""vLLM engines (CPU build) in processes of their own, driven one request at a time, so
that engines with different tiers run side by side and take turns (one engine per process:
vLLM's KV-transfer group is global to a process).

``Engine(secondary_tiers, model, log)``: a spawned process with one engine whose CPU tier
holds 140 blocks above ``secondary_tiers``; ``run(seed, tokens)`` generates one token of
``word_text(seed, tokens)`` and answers ``(TTFT s, tokens cached, output token ids)``
after the tier transfers that request started are done (``settle``); ``close``.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import time

CPU_BLOCKS = 140
ANSWER_S = 300  # a hang guard: an engine that does not answer within it is an error


def engine_main(conn, tiers: list[dict], model: str, log: str) -> None:
    """The spawned process: vLLM's output goes to ``log``; ``(command, seed, tokens)``
    messages come on ``conn`` until ``"quit"``."""
    with open(log, "ab") as out:
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vllm import SamplingParams

    from kvoffload.demo.offline import close_llm, kv_block_bytes, make_llm, settle, word_text

    extra = {"cpu_bytes_to_use": CPU_BLOCKS * kv_block_bytes(model), "secondary_tiers": tiers}
    llm = make_llm(model, kvoffload=extra)
    params = SamplingParams(temperature=0, max_tokens=1)
    try:
        conn.send("ready")
        while True:
            command, seed, tokens = conn.recv()
            if command == "quit":
                break
            out = llm.generate([word_text(seed, tokens)], params, use_tqdm=False)[0]
            for _ in range(3):  # its write-through done before the next request
                settle(llm)
            answer = (out.metrics.first_token_latency, out.num_cached_tokens, list(out.outputs[0].token_ids))
            conn.send(answer)
    finally:
        close_llm(llm)


class Engine:
    def __init__(self, tiers: list[dict], model: str, log: str) -> None:
        context = multiprocessing.get_context("spawn")
        self.conn, theirs = context.Pipe()
        self.proc = context.Process(target=engine_main, args=(theirs, tiers, model, log), daemon=True)
        self.proc.start()
        if self._answer() != "ready":
            self.close()
            raise RuntimeError(f"the engine with tiers {tiers} did not start (its log: {log})")

    def _answer(self):
        """The engine's next message; ``None`` if it died or said nothing for ``ANSWER_S``."""
        deadline = time.monotonic() + ANSWER_S
        while not self.conn.poll(1.0):
            if not self.proc.is_alive() or time.monotonic() > deadline:
                return None
        return self.conn.recv()

    def run(self, seed: int, tokens: int) -> tuple[float, int, list[int]]:
        self.conn.send(("run", seed, tokens))
        answer = self._answer()
        if answer is None:
            raise RuntimeError(f"an engine died or did not answer within {ANSWER_S} s")
        return answer

    def close(self) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(OSError):  # it died already
                self.conn.send(("quit", 0, 0))
            self.proc.join(60)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
