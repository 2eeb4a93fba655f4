"""Synthetic workloads: deterministic, prefix-chained, consistent with their lengths."""

from __future__ import annotations

import dataclasses

import pytest

from kvoffload.sim.workloads import (
    AgentWorkload,
    ChatWorkload,
    DocumentWorkload,
    agentic_sessions,
    builtin_workload,
    multi_turn_chat,
    one_shot_documents,
)

SMALL = [
    (multi_turn_chat, ChatWorkload(conversations=40)),
    (agentic_sessions, AgentWorkload(sessions=30)),
    (one_shot_documents, DocumentWorkload(requests=300, documents=50)),
]


@pytest.mark.parametrize("make, params", SMALL)
def test_same_parameters_same_trace(make, params):
    assert make(params) == make(params)
    other = make(dataclasses.replace(params, seed=params.seed + 1))
    assert other.requests != make(params).requests


@pytest.mark.parametrize("make, params", SMALL)
def test_prefix_chained_and_sized(make, params):
    trace = make(params)
    parent: dict[int, int] = {}
    for request in trace.requests:
        ids = request.hash_ids
        assert len(ids) == -(-request.input_length // trace.block_size)
        assert len(set(ids)) == len(ids)
        for prev, block in zip((-1,) + ids, ids):
            assert parent.setdefault(block, prev) == prev, "a block id follows two different parents"
    timestamps = [r.timestamp for r in trace.requests]
    assert timestamps == sorted(timestamps)


def test_shared_context_is_reused():
    agents = agentic_sessions(AgentWorkload(sessions=20, agent_types=1))
    first_blocks = AgentWorkload().shared_context_tokens // AgentWorkload().block_size
    heads = {r.hash_ids[:first_blocks] for r in agents.requests}
    assert len(heads) == 1
    docs = one_shot_documents(DocumentWorkload(requests=200, documents=5, unique_fraction=0.0))
    assert docs.unique_blocks() < docs.block_references() / 2


def test_builtin_names():
    assert builtin_workload("documents", seed=3) == builtin_workload("documents", seed=3)
    with pytest.raises(ValueError, match="'nope'"):
        builtin_workload("nope")
