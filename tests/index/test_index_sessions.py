"""The router index learns retention from the tiers' own events: a replica that retained
a session keeps announcing its blocks while the others' evictions remove theirs, so a
returning session's prefix scores highest where it was kept. vLLM's wire format is
unchanged: the index reads nothing but BlockStored / BlockRemoved. A prefetch's
promotions into CPU are the CPU tier's BlockStored events, so the index sees them too."""

from __future__ import annotations

import hashlib
import time

from kvoffload.cpu import CPUOffloadingManager
from kvoffload.events import BlockRemoved, BlockStored
from kvoffload.index import BlockIndex
from kvoffload.keys import external_hash, key_block_hash, make_offload_key
from kvoffload.sessions import SessionId
from kvoffload.tiers.tiered import TieredOffloadingManager
from shelf_tier import Shelf

MODEL, TENANT, BS = "m", "tenant-a", 16
SESSION = SessionId(TENANT, "chat-42")


def keys(name: str, n: int) -> list[bytes]:
    return [make_offload_key(hashlib.sha256(f"{name}-{i}".encode()).digest(), 0) for i in range(n)]


def store(manager: CPUOffloadingManager, batch: list[bytes]) -> None:
    assert manager.prepare_store(batch) is not None
    manager.complete_store(batch)


def wire(manager, block_size: int = BS) -> list[object]:
    """The tier's events as the scheduler publishes them (``block_size`` 0: the placeholder
    form of a key it holds no record of, e.g. one promoted after the CPU tier dropped it)."""
    out: list[object] = []
    for event in manager.take_events():
        hashes = [external_hash(key_block_hash(k)) for k in event.keys]
        if event.removed:
            out.append(BlockRemoved(hashes, event.medium))
        else:
            out.append(BlockStored(hashes, None, [], block_size, None, event.medium, None))
    return out


def serve_session_then_flood(retain: bool) -> list[object]:
    """One replica's events: the session's 4 blocks stored, retained or not, then 16
    blocks of other prompts through a 16-block host tier."""
    manager = CPUOffloadingManager(16, enable_events=True)
    session = keys("session", 4)
    store(manager, session)
    if retain:
        assert manager.retain(SESSION, session, time.monotonic() + 60).retained == 4
    for i in range(4):
        store(manager, keys(f"flood{i}", 4))
    return wire(manager)


def test_a_returning_session_scores_highest_on_the_replica_that_retained_it():
    index = BlockIndex()
    kept = index.add_engine(MODEL, TENANT, "replica-kept", 0, BS)
    other = index.add_engine(MODEL, TENANT, "replica-other", 0, BS)
    index.apply(kept, serve_session_then_flood(retain=True))
    index.apply(other, serve_session_then_flood(retain=False))
    prompt = [external_hash(key_block_hash(k)) for k in keys("session", 4)]
    result = index.query_hashes(MODEL, TENANT, prompt)
    scores = {m.instance_id: (m.levels, m.weighted) for m in result.matches}
    assert scores["replica-kept"][0] == (0, 4, 4, 4)  # all four blocks in its host tier
    assert scores["replica-other"][0] == (0, 0, 0, 0)
    best = max(result.matches, key=lambda m: m.weighted)
    assert best.instance_id == "replica-kept"


def test_without_retention_the_flood_removes_the_session_everywhere():
    index = BlockIndex()
    for name in ("a", "b"):
        index.apply(index.add_engine(MODEL, TENANT, name, 0, BS), serve_session_then_flood(retain=False))
    prompt = [external_hash(key_block_hash(k)) for k in keys("session", 4)]
    assert all(m.levels == (0, 0, 0, 0) for m in index.query_hashes(MODEL, TENANT, prompt).matches)


def test_a_prefetch_reaches_the_index_as_the_cpu_tier_s_blocks():
    primary = CPUOffloadingManager(4, enable_events=True)
    tiered = TieredOffloadingManager(primary, [Shelf(64, "lru")])
    session = keys("session", 4)

    def through(batch):  # stored in CPU, written through to the shelf as the worker would
        out = tiered.prepare_store(batch)
        tiered.complete_store(out.keys_to_store)
        for transfer in tiered.take_transfers():
            tiered.complete_transfer(transfer.token, True)

    through(session)
    through(keys("other", 4))  # the session now lies below CPU only
    index = BlockIndex()
    engine = index.add_engine(MODEL, TENANT, "replica", 0, BS)
    index.apply(engine, wire(tiered))
    prompt = [external_hash(key_block_hash(k)) for k in session]
    assert index.query_hashes(MODEL, TENANT, prompt).matches[0].levels[1] == 0  # not in host

    assert tiered.prefetch(session) == 4
    for transfer in tiered.take_transfers():  # the promotions, done by the worker
        tiered.complete_transfer(transfer.token, True)
    index.apply(engine, wire(tiered, block_size=0))
    assert index.query_hashes(MODEL, TENANT, prompt).matches[0].levels[1] == 4
