"""Seeded synthetic workloads in the trace format.

``multi_turn_chat``: conversations that share one of a few system prompts and grow turn
by turn; each turn's prompt is the whole conversation so far. Block ids are prefix-chained
like Mooncake's: a full block has the same id in every request that contains the same
prefix; each request's trailing partial block gets a fresh id.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvoffload.sim.trace import Trace, TraceRequest


@dataclass(frozen=True)
class ChatWorkload:
    """Parameters of ``multi_turn_chat``; lengths in tokens, times in seconds."""

    conversations: int = 300
    mean_turns: float = 6.0
    system_prompts: int = 4
    system_prompt_tokens: int = 1536
    mean_user_tokens: int = 300
    mean_output_tokens: int = 250
    mean_think_time_s: float = 60.0
    duration_s: float = 1800.0
    block_size: int = 256
    seed: int = 0


class _BlockIds:
    """Hands out chained block ids: equal (parent, content) pairs get equal ids."""

    def __init__(self) -> None:
        self._ids: dict[tuple[int, object], int] = {}

    def chain(self, parent: int, content: object) -> int:
        return self._ids.setdefault((parent, content), len(self._ids))

    def fresh(self) -> int:
        return self.chain(-2, len(self._ids))


def multi_turn_chat(params: ChatWorkload = ChatWorkload()) -> Trace:
    """A multi-turn chat trace; the same ``params`` always give the same trace."""
    if params.block_size <= 0 or params.conversations < 0 or params.system_prompts <= 0:
        raise ValueError(f"invalid chat workload parameters: {params!r}")
    rng = random.Random(params.seed)
    ids = _BlockIds()
    requests: list[TraceRequest] = []
    for conv in range(params.conversations):
        prompt = rng.randrange(params.system_prompts)
        length = params.system_prompt_tokens
        t = rng.uniform(0.0, params.duration_s)
        turns = max(1, round(rng.expovariate(1.0 / params.mean_turns)))
        for _ in range(turns):
            length += max(1, round(rng.expovariate(1.0 / params.mean_user_tokens)))
            output = max(1, round(rng.expovariate(1.0 / params.mean_output_tokens)))
            requests.append(
                TraceRequest(
                    timestamp=int(t * 1000),
                    input_length=length,
                    output_length=output,
                    hash_ids=_chain_ids(ids, conv, prompt, length, params),
                )
            )
            length += output
            t += rng.expovariate(1.0 / params.mean_think_time_s)
    requests.sort(key=lambda r: r.timestamp)
    return Trace(requests, params.block_size, "multi_turn_chat")


def _chain_ids(ids: _BlockIds, conv: int, prompt: int, length: int, params: ChatWorkload) -> tuple[int, ...]:
    bs = params.block_size
    out = []
    parent = -1
    for index in range(length // bs):
        # A block inside the system prompt is shared by every conversation using it.
        owner = ("system", prompt) if (index + 1) * bs <= params.system_prompt_tokens else conv
        parent = ids.chain(parent, (owner, index))
        out.append(parent)
    if length % bs:
        out.append(ids.fresh())
    return tuple(out)
