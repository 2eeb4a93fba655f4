"""Replay protocol: hand-computed hits for LRU, the device tier, and Belady as the ceiling."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload.cpu import CPUOffloadingManager
from kvoffload.policies import available_policies
from kvoffload.sim.belady import replay_belady
from kvoffload.sim.planning import plan
from kvoffload.sim.replay import replay_keys, to_key_lists
from kvoffload.sim.tiered import device_prefixes, replay_tiered
from kvoffload.sim.trace import Trace, TraceRequest


def requests(*id_lists, lengths=None):
    lengths = lengths or [4 * len(ids) for ids in id_lists]
    return [TraceRequest(i, n, 1, tuple(ids)) for i, (ids, n) in enumerate(zip(id_lists, lengths))]


def test_lru_hand_computed():
    # capacity 3: R2 hits 1; R3 evicts 2 then 1; R4 misses 1 and evicts 3, 4; R5 hits 1, 2
    # and evicts 5. Stored: 2 + 1 + 2 + 2 + 1.
    keys = to_key_lists(requests([1, 2], [1, 3], [4, 5], [1, 2], [1, 2, 6]))
    result = replay_keys(CPUOffloadingManager(3, "lru"), keys)
    assert (result.keys, result.hit_keys, result.stored_keys, result.evicted_keys) == (11, 3, 8, 5)


def test_device_tier_in_front_hand_computed():
    reqs = requests([1, 2], [1, 2], [1, 2, 3], [1, 2], lengths=[8, 8, 10, 8])
    keys = to_key_lists(reqs)
    served = device_prefixes(keys, 2)
    assert served == [0, 2, 2, 1]  # R3 stores 3 and evicts 2 (the tail) from the device
    result = replay_tiered(CPUOffloadingManager(3, "lru"), keys, served, [r.input_length for r in reqs], 4)
    assert (result.device_hits, result.host_hits, result.keys) == (5, 1, 9)
    assert (result.device_tokens, result.host_tokens, result.prompt_tokens) == (20, 4, 34)


def test_no_device_tier_is_plain_replay():
    keys = to_key_lists(requests([1, 2], [1, 3], [4, 5], [1, 2], [1, 2, 6]))
    tiered = replay_tiered(CPUOffloadingManager(3, "lru"), keys, [0] * 5, [8] * 5, 4)
    assert tiered.host_hits == 3 and tiered.device_hits == 0


def test_belady_bypasses_one_time_keys():
    keys = to_key_lists(requests([1], [2], [1]))
    assert replay_belady(keys, 1).hit_keys == 1
    assert replay_keys(CPUOffloadingManager(1, "lru"), keys).hit_keys == 0


@st.composite
def chained_traces(draw):
    """Requests that extend a prefix of an earlier request with fresh blocks."""
    out: list[list[int]] = []
    next_id = 0
    for _ in range(draw(st.integers(1, 25))):
        base = draw(st.sampled_from(out)) if out and draw(st.booleans()) else []
        ids = base[: draw(st.integers(0, len(base)))]
        for _ in range(draw(st.integers(0 if ids else 1, 4))):
            ids = ids + [next_id]
            next_id += 1
        out.append(ids)
    return out


@settings(max_examples=150, deadline=None)
@given(trace=chained_traces(), capacity=st.integers(1, 8))
def test_belady_is_never_below_an_online_policy(trace, capacity):
    keys = to_key_lists(requests(*trace))
    ceiling = replay_belady(keys, capacity).hit_keys
    for policy in available_policies():
        assert replay_keys(CPUOffloadingManager(capacity, policy), keys).hit_keys <= ceiling, policy


def test_plan_rows_and_cost_model():
    trace = Trace(requests([1, 2], [1, 2], [1, 2, 3], [1, 2], lengths=[8, 8, 10, 8]), block_size=4)
    rows = plan(trace, ["lru", "belady"], ["2", "100%"], device_blocks=0)
    assert [(r.policy, r.capacity, r.blocks) for r in rows] == [
        ("lru", "2", 2),
        ("lru", "100%", 3),
        ("belady", "2", 2),
        ("belady", "100%", 3),
    ]
    lru_full = rows[1]
    assert lru_full.host_hit_ratio == 6 / 9 and lru_full.host_tokens_saved == 24
    block_bytes = 4 * 131072
    assert lru_full.bytes_loaded == 6 * block_bytes and lru_full.bytes_stored == 3 * block_bytes
    assert abs(lru_full.prefill_s_saved - (24 / 8000 - 6 * block_bytes / 25e9)) < 1e-12
