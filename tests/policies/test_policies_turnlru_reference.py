"""The turn-aware LRU on ``Order`` lists (C loops where built, and its Python versions)
chooses the same victims, levels and turn gap as its earlier OrderedDict version
(``turnlru_reference``), under random calls and through the CPU tier on a trace."""

from __future__ import annotations

import random

import pytest
from turnlru_reference import ReferenceTurnLRU

import kvoffload.policies.turnlru as turnlru_module
from kvoffload.cpu import CPUOffloadingManager
from kvoffload.manager import RequestContext
from kvoffload.policies import TurnLRUPolicy, blocks


def k(i: int) -> bytes:
    return i.to_bytes(8, "big") + b"\x00\x00\x00\x00"


def on_python(monkeypatch) -> None:
    """The policy's per-key paths switched to the Python versions, on Python orders."""
    monkeypatch.setattr(turnlru_module, "Order", blocks.PYTHON_VERSIONS["Order"])
    for name, function in turnlru_module.PYTHON_VERSIONS.items():
        monkeypatch.setattr(turnlru_module, name, function)


def drive(policy_type: type, seed: int, hooks: bool) -> list:
    """A policy alone under random calls (busy and protected keys included, so evictions
    fail), with or without the request hooks: every answer, each key's queue, the gap."""
    rng = random.Random(seed)
    p = policy_type(10, ghost_factor=rng.choice((0.0, 0.5, 3.0)))
    p._reserve_limit = rng.choice((3, 1024))  # reservations dropped, oldest first, or not
    statuses: dict = {}
    seen: list = []
    running: list = []
    for i in range(500):
        op = rng.randrange(6)
        start = rng.randrange(30)
        keys = [k(j) for j in range(start, start + rng.randint(1, 6))]
        if op <= 1:
            if hooks and (not running or rng.random() < 0.5):
                ctx = RequestContext(str(i))
                p.on_new_request(ctx)
                running.append((ctx, keys))
            p.touch(keys)
        elif op == 2:
            new = [key for key in keys if key not in statuses]
            made = [
                blocks.PYTHON_VERSIONS["BlockStatus"](j, rng.choice((-1, 0, 0, 0, 1)))
                for j in range(len(new))
            ]
            p.insert_many(new, made)
            statuses.update(zip(new, made))
        elif op == 3:
            victims = p.evict(rng.randint(1, 4), set(keys[:2]))
            seen.append(("evict", victims))
            for key in victims or ():
                del statuses[key]
        elif op == 4 and running:
            ctx, named = running.pop(rng.randrange(len(running)))
            inserted = frozenset(key for key in named + keys if key in statuses and rng.random() < 0.7)
            p.on_request_finished(ctx, [named, keys[:0]], inserted, frozenset())
        else:
            key = rng.choice(keys)
            if key in statuses and statuses[key].ref == -1:
                p.remove(key)
                del statuses[key]
            for status in rng.sample(list(statuses.values()), min(3, len(statuses))):
                status.ref = rng.choice((-1, 0, 0, 0, 2))
        seen.append((sorted(p._level.items()), p.turn_gap))
    return seen


@pytest.mark.parametrize("hooks", [False, True])
@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("python", [False, True])
def test_same_victims_levels_and_gap_as_the_reference(seed, hooks, python, monkeypatch):
    reference = drive(ReferenceTurnLRU, seed, hooks)
    if python:
        on_python(monkeypatch)
    assert drive(TurnLRUPolicy, seed, hooks) == reference
    evictions = [entry[1] for entry in reference if isinstance(entry, tuple) and entry[0] == "evict"]
    assert None in evictions and len([v for v in evictions if v]) > 20  # some failed, many did not
    states = [entry for entry in reference if isinstance(entry[0], list)]
    assert any(level > 0 for state, _ in states for _, level in state)  # levels above 0 were used
    assert states[-1][1] is not None  # a gap was measured


def serve_all(policy: type | str, seed: int) -> tuple:
    """Requests of random conversations through the CPU tier with the lifecycle: every
    answer, each key's queue at the end and the gap."""
    rng = random.Random(seed)
    m = CPUOffloadingManager(40, policy)
    conversations: list[list[bytes]] = []
    answers = []
    for i in range(400):
        if conversations and rng.random() < 0.6:  # a returning turn extends its prefix
            c = rng.randrange(len(conversations))
            keys = conversations[c] + [k(10_000 + i * 10 + j) for j in range(rng.randint(1, 4))]
            conversations[c] = keys
        else:
            keys = [k(i * 10 + j) for j in range(rng.randint(1, 6))]
            conversations.append(keys)
        ctx = RequestContext(str(i))
        m.on_new_request(ctx)
        h = m.lookup_prefix(keys)
        m.touch(keys)
        if h:
            m.prepare_load(keys[:h])
            m.complete_load(keys[:h])
        out = m.prepare_store(keys[h:])
        inserted: list = []
        if out is not None:
            m.complete_store(out.keys_to_store)
            inserted = out.keys_to_store
            answers.append((h, out.evicted_keys))
        m.on_request_finished(ctx, [keys], frozenset(inserted), frozenset(keys[:h]))
    return answers, sorted(m.policy._level.items()), m.policy.turn_gap


@pytest.mark.parametrize("seed", range(3))
def test_cpu_tier_evicts_as_the_reference(seed, monkeypatch):
    reference = serve_all(ReferenceTurnLRU, seed)
    assert serve_all("turnlru", seed) == reference
    on_python(monkeypatch)
    assert serve_all("turnlru", seed) == reference
    assert sum(h for h, _ in reference[0]) > 100 and sum(len(e) for _, e in reference[0]) > 500
