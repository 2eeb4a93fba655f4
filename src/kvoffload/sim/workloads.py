"""Seeded synthetic workloads in the trace format.

* ``multi_turn_chat``: conversations that share one of a few system prompts and grow turn
  by turn; each turn's prompt is the whole conversation so far.
* ``agentic_sessions``: agent sessions opening with a long context shared by every session
  of the same agent, growing fast by tool results and replies, steps seconds apart.
* ``one_shot_documents``: instruction + document (Zipf-popular pool, plus one-time
  documents) + a fresh question; no follow-ups.

Block ids are prefix-chained like Mooncake's: a full block has the same id in every
request that contains the same prefix; each request's trailing partial block gets a fresh
id. The same parameters (seed included) always give the same trace. ``builtin_workload``
names the defaults: ``chat``, ``agentic``, ``documents``.
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


# -- agentic sessions and one-shot documents ----------------------------------------------


@dataclass(frozen=True)
class AgentWorkload:
    """Parameters of ``agentic_sessions``; lengths in tokens, times in seconds.

    Each session belongs to one of ``agent_types`` agents whose long shared context (tool
    definitions, instructions, a code base) opens every request of the session; a session
    then grows by a task prompt and, step after step, a tool result and a model reply, with
    a short gap between steps (a tool call). Its requests carry their session's id.
    """

    sessions: int = 200
    agent_types: int = 3
    shared_context_tokens: int = 8192
    mean_task_tokens: int = 400
    mean_steps: float = 10.0
    mean_tool_output_tokens: int = 700
    mean_output_tokens: int = 150
    mean_step_gap_s: float = 8.0
    duration_s: float = 1800.0
    block_size: int = 256
    seed: int = 0


@dataclass(frozen=True)
class DocumentWorkload:
    """Parameters of ``one_shot_documents``; lengths in tokens, times in seconds.

    Each request is an instruction prompt (one of ``instruction_prompts``), a document
    drawn from a pool of ``documents`` with Zipf popularity of exponent ``zipf_s``, and a
    fresh question; nothing is asked twice in a conversation. A share ``unique_fraction``
    of the requests carries a document nobody else sends (one-time blocks).
    """

    requests: int = 3000
    documents: int = 500
    zipf_s: float = 1.0
    unique_fraction: float = 0.3
    mean_document_tokens: int = 3000
    instruction_prompts: int = 2
    instruction_tokens: int = 512
    mean_question_tokens: int = 100
    mean_output_tokens: int = 200
    duration_s: float = 1800.0
    block_size: int = 256
    seed: int = 0


def _segment_ids(ids: _BlockIds, segments: list[tuple[object, int]], block_size: int) -> tuple[int, ...]:
    """Chained block ids of a prompt made of ``(owner, tokens)`` segments.

    Equal owners mean equal tokens; owner ``None`` marks tokens no other request has. A
    block is shared only if every token in it comes from owned segments; from the first
    block touching a fresh segment on, and for a trailing partial block, ids are fresh.
    """
    bounds = []
    end = 0
    for owner, tokens in segments:
        end += tokens
        bounds.append((end, owner))
    out = []
    parent = -1
    fresh = False
    seg = 0
    for index in range(-(-end // block_size)):
        start, stop = index * block_size, min((index + 1) * block_size, end)
        owners = []
        while seg < len(bounds) and bounds[seg][0] <= start:
            seg += 1
        probe = seg
        while probe < len(bounds):
            owners.append(bounds[probe][1])
            if bounds[probe][0] >= stop:
                break
            probe += 1
        fresh = fresh or stop - start < block_size or any(owner is None for owner in owners)
        parent = ids.fresh() if fresh else ids.chain(parent, (tuple(owners), index))
        out.append(parent)
    return tuple(out)


def _positive(rng: random.Random, mean: float) -> int:
    return max(1, round(rng.expovariate(1.0 / mean)))


def agentic_sessions(params: AgentWorkload = AgentWorkload()) -> Trace:
    """An agentic trace; the same ``params`` always give the same trace."""
    if params.block_size <= 0 or params.sessions < 0 or params.agent_types <= 0:
        raise ValueError(f"invalid agent workload parameters: {params!r}")
    rng = random.Random(params.seed)
    ids = _BlockIds()
    requests: list[TraceRequest] = []
    for session in range(params.sessions):
        agent = rng.randrange(params.agent_types)
        private = _positive(rng, params.mean_task_tokens)
        t = rng.uniform(0.0, params.duration_s)
        for _ in range(_positive(rng, params.mean_steps)):
            shared = ("agent", agent)
            segments = [(shared, params.shared_context_tokens), (("session", session), private)]
            output = _positive(rng, params.mean_output_tokens)
            length = params.shared_context_tokens + private
            hash_ids = _segment_ids(ids, segments, params.block_size)
            requests.append(TraceRequest(int(t * 1000), length, output, hash_ids, f"agentic-{session}"))
            private += output + _positive(rng, params.mean_tool_output_tokens)
            t += rng.expovariate(1.0 / params.mean_step_gap_s)
    requests.sort(key=lambda r: r.timestamp)
    return Trace(requests, params.block_size, "agentic_sessions")


def one_shot_documents(params: DocumentWorkload = DocumentWorkload()) -> Trace:
    """A one-shot document trace; the same ``params`` always give the same trace."""
    if (
        params.block_size <= 0
        or params.requests < 0
        or params.documents <= 0
        or params.instruction_prompts <= 0
    ):
        raise ValueError(f"invalid document workload parameters: {params!r}")
    if not 0.0 <= params.unique_fraction <= 1.0:
        raise ValueError(f"unique_fraction must be in [0, 1], got {params.unique_fraction!r}")
    rng = random.Random(params.seed)
    ids = _BlockIds()
    doc_tokens = [_positive(rng, params.mean_document_tokens) for _ in range(params.documents)]
    weights = [1.0 / (rank + 1) ** params.zipf_s for rank in range(params.documents)]
    requests: list[TraceRequest] = []
    for index in range(params.requests):
        instruction = ("instruction", rng.randrange(params.instruction_prompts))
        if rng.random() < params.unique_fraction:
            document, tokens = ("unique", index), _positive(rng, params.mean_document_tokens)
        else:
            doc = rng.choices(range(params.documents), weights)[0]
            document, tokens = ("document", doc), doc_tokens[doc]
        question = _positive(rng, params.mean_question_tokens)
        segments = [(instruction, params.instruction_tokens), (document, tokens), (None, question)]
        length = params.instruction_tokens + tokens + question
        t = rng.uniform(0.0, params.duration_s)
        output = _positive(rng, params.mean_output_tokens)
        requests.append(
            TraceRequest(int(t * 1000), length, output, _segment_ids(ids, segments, params.block_size))
        )
    requests.sort(key=lambda r: r.timestamp)
    return Trace(requests, params.block_size, "one_shot_documents")


WORKLOADS = {
    "chat": lambda seed: multi_turn_chat(ChatWorkload(seed=seed)),
    "agentic": lambda seed: agentic_sessions(AgentWorkload(seed=seed)),
    "documents": lambda seed: one_shot_documents(DocumentWorkload(seed=seed)),
}


def builtin_workload(name: str, seed: int = 0) -> Trace:
    """A built-in workload with default parameters: ``chat``, ``agentic`` or ``documents``."""
    factory = WORKLOADS.get(name)
    if factory is None:
        raise ValueError(f"unknown workload {name!r}; built-in: {', '.join(WORKLOADS)}")
    return factory(seed)
