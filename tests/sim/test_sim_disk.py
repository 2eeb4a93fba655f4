"""Replay through CPU + disk (``kvoffload.sim.disk``): hand-computed hits per tier, the
disk capacity bound, bytes per tier, the cost model; capacity parsing; ``SeenTwice``."""

from __future__ import annotations

import pytest

from kvoffload.cpu import CPUOffloadingManager
from kvoffload.keys import make_offload_key
from kvoffload.sim.disk import SimDiskTier, build_tiers, replay_disk
from kvoffload.sim.disk_plan import admission_rule, plan_disk
from kvoffload.sim.planning import CostModel, parse_capacity
from kvoffload.sim.replay import to_key_lists
from kvoffload.sim.tiered import device_prefixes, replay_tiered
from kvoffload.sim.trace import Trace, TraceRequest
from kvoffload.sim.workloads import builtin_workload
from kvoffload.tiers.admission import SeenTwice
from kvoffload.tiers.tiered import TieredOffloadingManager

BLOCK = 4  # tokens per block in the hand-made traces


def requests(*id_lists, lengths=None):
    lengths = lengths or [BLOCK * len(ids) for ids in id_lists]
    return [TraceRequest(i, n, 1, tuple(ids)) for i, (ids, n) in enumerate(zip(id_lists, lengths))]


def replay(reqs, cpu, disk, admit=None):
    tiers = build_tiers(cpu, disk, "lru", admit=admit)
    keys = to_key_lists(reqs)
    result = replay_disk(tiers, keys, [0] * len(keys), [r.input_length for r in reqs], BLOCK)
    return tiers, result


# CPU 2 blocks, disk 3 blocks, LRU in both (a prefix's tail is evicted before its head):
#   R1 [1,2]   miss; store 1,2; write 1,2                 CPU {1,2}  disk {1,2}
#   R2 [1,2]   2 CPU hits
#   R3 [3,4]   miss; store 3,4 (CPU evicts 1,2); write 3,4 (disk evicts 2)      disk {1,3,4}
#   R4 [1,5]   1 is on disk: promoted (CPU evicts 3), 1 disk hit; store 5 (CPU evicts 4);
#              write 5 (disk evicts 3)                   CPU {1,5}  disk {4,1,5}
#   R5 [2]     miss everywhere (gone from disk in R3); store 2 (CPU evicts 1); write 2
#              (disk evicts 4)                           CPU {5,2}  disk {1,5,2}
#   R6 [1]     on disk: promoted (CPU evicts 5), 1 disk hit; its prompt is 3 tokens
TRACE = requests([1, 2], [1, 2], [3, 4], [1, 5], [2], [1], lengths=[8, 8, 8, 8, 4, 3])


def test_write_all_hand_computed():
    tiers, r = replay(TRACE, cpu=2, disk=3)
    assert (r.keys, r.device_hits, r.cpu_hits, r.disk_hits) == (10, 0, 2, 2)
    assert (r.stored, r.promoted, r.written, r.not_promoted) == (6, 2, 6, 0)
    assert (r.cpu_evicted, r.disk_evicted) == (6, 3)
    assert (r.cpu_tokens, r.disk_tokens, r.device_tokens, r.prompt_tokens) == (8, 4 + 3, 0, 39)
    assert (r.cpu_hit_ratio, r.disk_hit_ratio, r.hit_ratio) == (0.2, 0.2, 0.4)
    assert (r.loaded, r.cpu_blocks_read, r.cpu_blocks_written) == (4, 4 + 6, 6 + 2)
    disk = tiers.secondaries[0]
    assert disk.stats().used == 3  # the capacity bound held
    assert [disk.state(k) for k in to_key_lists(requests([1, 5, 2, 3, 4]))[0]] == [0, 0, 0, None, None]
    assert tiers.transfers_in_flight == 0


def test_seen_twice_hand_computed():
    # R1, R3: first offers of 1,2,3,4 are declined. R4 [1,5]: 1 missed everywhere and is
    # stored again -> its second offer is admitted; 5 declined. R5 [2]: admitted likewise.
    # R6 [1]: promoted from disk, the only disk hit.
    rule = SeenTwice(10)
    tiers, r = replay(TRACE, cpu=2, disk=3, admit=rule)
    assert (r.cpu_hits, r.disk_hits, r.written, r.promoted) == (2, 1, 2, 1)
    assert (rule.admitted, rule.declined) == (2, 5)


def test_only_the_leading_part_of_a_disk_prefix_that_fits_is_promoted():
    # R2 hits 1,2 in the CPU tier, stores 3 (evicting 2); R3 evicts 1,3; R4 finds 1,2,3 on
    # disk but three blocks do not fit a CPU tier of two: the promotion halves to block 1,
    # which is served; 2 and 3 are declined (recomputed, not stored again).
    reqs = requests([1, 2], [1, 2, 3], [4, 5], [1, 2, 3])
    tiers, r = replay(reqs, cpu=2, disk=8)
    assert (r.cpu_hits, r.disk_hits, r.promoted, r.not_promoted) == (2, 1, 1, 2)
    assert tiers.primary.stats().used == 2


def test_device_tier_in_front_is_skipped_by_the_lookups():
    reqs = requests([1, 2], [1, 2], [1, 2, 3])
    keys = to_key_lists(reqs)
    served = device_prefixes(keys, 2)
    assert served == [0, 2, 2]
    r = replay_disk(build_tiers(4, 8), keys, served, [r.input_length for r in reqs], BLOCK)
    assert (r.device_hits, r.cpu_hits, r.disk_hits, r.hit_ratio) == (4, 0, 0, 4 / 7)
    assert r.device_tokens == 16


def test_a_disk_that_admits_nothing_replays_like_the_cpu_tier_alone():
    trace = builtin_workload("chat")
    keys = to_key_lists(trace.requests)
    lengths = [r.input_length for r in trace.requests]
    served = device_prefixes(keys, 40)
    alone = replay_tiered(CPUOffloadingManager(60, "lru"), keys, served, lengths, trace.block_size)
    tiers = build_tiers(60, 500, "lru", admit=lambda key: False)
    both = replay_disk(tiers, keys, served, lengths, trace.block_size)
    assert (both.device_hits, both.cpu_hits, both.stored, both.cpu_evicted) == (
        alone.device_hits,
        alone.host_hits,
        alone.stored,
        alone.evicted,
    )
    assert (both.disk_hits, both.written, both.device_tokens, both.cpu_tokens) == (
        0,
        0,
        alone.device_tokens,
        alone.host_tokens,
    )


def test_replay_disk_checks_its_arguments():
    keys = to_key_lists(requests([1]))
    with pytest.raises(ValueError, match="one entry per request"):
        replay_disk(build_tiers(2, 2), keys, [0, 0], [4], BLOCK)

    class Remote(CPUOffloadingManager):
        medium = "REMOTE"

    tiers = TieredOffloadingManager(CPUOffloadingManager(2), [SimDiskTier(2), Remote(2)])
    with pytest.raises(ValueError, match=r"a disk over an object tier, got \['DISK', 'REMOTE'\]"):
        replay_disk(tiers, keys, [0], [4], BLOCK)


def test_sim_disk_tier_speaks_disk_specs():
    tier = SimDiskTier(2)
    (key,) = to_key_lists(requests([7]))[0]
    out = tier.prepare_store([key])
    assert out.store_spec.medium == "DISK" and out.store_spec.keys == [key]
    tier.complete_store([key])
    assert tier.prepare_load([key]).block_ids.tolist() == out.store_spec.block_ids.tolist()


def test_plan_disk_bytes_and_cost_model():
    trace = Trace(TRACE, block_size=BLOCK)  # 5 unique blocks
    cost = CostModel(8000.0, 25e9, 1000, 5e9)
    (row,) = plan_disk(trace, ["lru"], ["2"], ["60%"], cost=cost)
    bb = BLOCK * 1000
    assert (row.blocks, row.disk_blocks, row.fraction, row.disk_fraction) == (2, 3, 0.4, 0.6)
    assert (row.cpu_hit_ratio, row.disk_hit_ratio, row.hit_ratio) == (0.2, 0.2, 0.4)
    assert (row.cpu_tokens_saved, row.disk_tokens_saved, row.bytes_loaded) == (8, 7, 4 * bb)
    assert (row.cpu_bytes_read, row.cpu_bytes_written) == (10 * bb, 8 * bb)
    assert (row.disk_bytes_read, row.disk_bytes_written) == (2 * bb, 6 * bb)
    assert row.prefill_s_saved == pytest.approx(15 / 8000 - 4 * bb / 25e9 - 2 * bb / 5e9)
    # SeenTwice remembers as many keys as the disk has blocks (3): 1 and 2 are forgotten
    # by their second offers (R4, R5); R6 offers 1 a third time and writes it, too late.
    (seen,) = plan_disk(trace, ["lru"], ["2"], ["3"], cost=cost, admit="seen-twice")
    assert (seen.admit, seen.disk_hit_ratio, seen.disk_bytes_written) == ("seen-twice", 0.0, 1 * bb)


@pytest.mark.parametrize(
    "kwargs, named",
    [
        ({"policies": ["belady"]}, "'belady'"),
        ({"policies": ["nope"]}, "'nope'"),
        ({"disk_policy": "nope"}, "'nope'"),
        ({"admit": "sometimes"}, "'sometimes'"),
        ({"disk_capacities": ["3 furlongs"]}, "'3 furlongs'"),
    ],
)
def test_plan_disk_errors_name_the_value(kwargs, named):
    args = {"policies": ["lru"], "capacities": ["2"], "disk_capacities": ["3"], **kwargs}
    with pytest.raises(ValueError) as err:
        plan_disk(Trace(TRACE, block_size=BLOCK), **args)
    assert named in str(err.value)


def test_admission_rule_names():
    assert admission_rule("all", 5) is None
    assert isinstance(admission_rule("seen-twice", 5), SeenTwice)
    with pytest.raises(ValueError, match="'twice'.*all, seen-twice"):
        admission_rule("twice", 5)


# -- capacities in bytes, fractions and blocks ------------------------------------------------

BLOCK_BYTES = 512 * 131072  # 64 MiB: a Mooncake block of Llama-3-8B


@pytest.mark.parametrize(
    "text, blocks",
    [
        ("64GiB", 1024),
        ("64 GiB", 1024),
        ("500MB", 500 * 10**6 // BLOCK_BYTES),
        ("1.5gib", 24),
        ("1TB", 10**12 // BLOCK_BYTES),
        ("5%", 500),
        ("0.05", 500),
        ("100%", 10_000),
        ("2000", 2000),
    ],
)
def test_capacity_forms(text, blocks):
    assert parse_capacity(text, 10_000, BLOCK_BYTES) == blocks


@pytest.mark.parametrize(
    "text, why",
    [
        ("12parsecs", "not a size"),
        ("GiB", "not a size"),
        ("64GiBs", "not a size"),
        ("-5%", "in (0, 1]"),
        ("150%", "in (0, 1]"),
        ("1.5", "in (0, 1]"),
        ("1MiB", "holds no block of 67108864 bytes"),
        ("", "not a size"),
    ],
)
def test_bad_capacities_name_the_value(text, why):
    with pytest.raises(ValueError) as err:
        parse_capacity(text, 10_000, BLOCK_BYTES)
    assert f"bad capacity {text!r}" in str(err.value) and why in str(err.value)


def test_cost_model_names_a_bad_disk_bandwidth():
    with pytest.raises(ValueError, match="disk_bandwidth_bytes_per_s.*-1"):
        CostModel(disk_bandwidth_bytes_per_s=-1)


# -- SeenTwice --------------------------------------------------------------------------------


def key(i):
    return make_offload_key(i.to_bytes(8, "big"), 0)


def test_seen_twice_admits_from_the_second_offer():
    rule = SeenTwice(4)
    assert [rule(key(1)), rule(key(1)), rule(key(1)), rule(key(2))] == [False, True, True, False]
    assert (rule.admitted, rule.declined, len(rule)) == (2, 2, 2)


def test_seen_twice_forgets_the_least_recently_seen_beyond_its_capacity():
    rule = SeenTwice(2)
    rule(key(1))
    rule(key(2))
    rule(key(1))  # refreshes 1: 2 is now the least recently seen
    rule(key(3))  # forgets 2
    assert key(2) not in rule and key(1) in rule and key(3) in rule and len(rule) == 2
    assert rule(key(2)) is False  # a forgotten key counts as never seen


def test_seen_twice_membership_records_nothing():
    rule = SeenTwice(2)
    assert key(1) not in rule
    assert rule(key(1)) is False and len(rule) == 1
    rule.clear()
    assert len(rule) == 0 and rule(key(1)) is False


@pytest.mark.parametrize("capacity", [0, -3, 2.5, True, None])
def test_seen_twice_capacity_is_checked(capacity):
    with pytest.raises(ValueError, match=f"capacity must be a positive int, got {capacity!r}"):
        SeenTwice(capacity)


def test_seen_twice_as_the_tiered_managers_rule():
    rule = SeenTwice(8)
    tiers = build_tiers(4, 8, admit=rule)
    for _ in range(2):
        out = tiers.prepare_store([key(1)])
        tiers.complete_store(out.keys_to_store)
        transfers = tiers.take_transfers()
        for transfer in transfers:
            tiers.complete_transfer(transfer.token, True)
        tiers.primary.discard([key(1)])  # as if evicted: the next store offers it again
    assert len(transfers) == 1 and tiers.secondaries[0].state(key(1)) == 0
    assert (rule.declined, rule.admitted) == (1, 1)
