"""Session retention in the disk tier: its eviction (the slot LRU and every other policy's
order) passes over retained blocks until their deadline or a release; budget, discard and
reset keep the retention consistent. Real directories in tmp_path."""

from __future__ import annotations

import pytest

from kvoffload.keys import make_offload_key
from kvoffload.policies import available_policies
from kvoffload.sessions import RetainOutcome, SessionId
from kvoffload.tiers.fs.format import RECORD_BYTES
from kvoffload.tiers.fs.manager import FSOffloadingManager
from manual_clock import ManualClock

BLOCK = 4096
STORED = BLOCK + RECORD_BYTES
A = SessionId("a", "chat")
B = SessionId("b", "chat")


def keys(*ids: int) -> list[bytes]:
    return [make_offload_key(i.to_bytes(32, "big"), 0) for i in ids]


def make(tmp_path, blocks=8, policy="lru", fraction=0.25):
    clock = ManualClock(100.0)
    m = FSOffloadingManager(
        tmp_path, "ns", BLOCK, blocks * STORED, policy, retention_fraction=fraction, clock=clock
    )
    return m, clock


def fill(m, ids) -> list[bytes]:
    evicted = []
    for i in ids:
        out = m.prepare_store(keys(i))
        assert out is not None
        evicted += out.evicted_keys
        m.complete_store(out.keys_to_store)
    return evicted


@pytest.mark.parametrize("policy", available_policies())
def test_retained_blocks_survive_until_their_deadline(tmp_path, policy):
    m, clock = make(tmp_path, policy=policy)
    try:
        fill(m, range(8))
        assert m.retain(A, keys(0, 1, 2), clock.now + 30) == RetainOutcome(retained=2, trimmed=1)
        assert not set(keys(0, 1)) & set(fill(m, range(100, 140)))
        assert [m.state(k) for k in keys(0, 1)] == [0, 0]
        assert [b.medium for b in m.retained(A)] == ["DISK", "DISK"]
        clock.now += 30
        assert m.retained(A) == []
        fill(m, range(200, 260))
        assert [m.state(k) for k in keys(0, 1)] == [None, None]
    finally:
        m.close()


def test_release_discard_and_reset_end_retention(tmp_path):
    m, clock = make(tmp_path, fraction=0.5)
    try:
        fill(m, range(8))
        m.retain(A, keys(0, 1, 2), clock.now + 30)
        assert m.release(B) == 0  # another tenant's session of the same name
        m.discard(keys(1))
        assert [b.key for b in m.retained(A)] == keys(0, 2)
        assert m.release(A) == 2
        assert set(keys(0, 2)) <= set(fill(m, range(100, 108)))
        m.retain(A, keys(100), clock.now + 30)
        m.reset()
        assert m.retained(A) == []
        assert len(fill(m, range(300, 316))) == 8  # nothing is held back any more
    finally:
        m.close()
