"""An object-storage tier under the disk tier in the replay (``kvoffload.sim.object_tier``):
hand-computed hits per tier for write-through and for writes on the disk's evictions, the
cost model's object bandwidth and latency, and the ``kvoffload sim`` flags."""

from __future__ import annotations

import csv

import pytest
from test_sim_disk import BLOCK, TRACE

from kvoffload.cli import main
from kvoffload.sim.disk import replay_disk
from kvoffload.sim.disk_plan import plan_disk
from kvoffload.sim.object_tier import SimObjectTier, build_object_tiers
from kvoffload.sim.planning import CostModel
from kvoffload.sim.replay import to_key_lists
from kvoffload.sim.trace import Trace


def replay(writes: str, objects: int = 8):
    tiers = build_object_tiers(2, 3, objects, "lru", writes=writes)
    keys = to_key_lists(TRACE)
    return tiers, replay_disk(tiers, keys, [0] * len(keys), [r.input_length for r in TRACE], BLOCK)


# test_sim_disk's trace (CPU 2 blocks, disk 3, LRU), with an object tier of 8 below:
#   R1 [1,2] miss; write 1,2 through to disk and objects    disk {1,2}    objects {1,2}
#   R3 [3,4] miss; disk evicts 2                           disk {1,3,4}  objects {1,2,3,4}
#   R4 [1,5] 1 on disk: a disk hit; store 5, disk evicts 3 disk {4,1,5}  objects {1,...,5}
#   R5 [2]   gone from the disk, in the objects: an object hit (4 tokens), nothing stored
#   R6 [1]   on disk: a disk hit (3 tokens)
# Written on eviction instead, the objects hold what the disk evicted: 2 (R3), then 3 (R4);
# R5 still finds 2 there, and each of those writes read a block back from the disk.


def test_write_through_hand_computed():
    tiers, r = replay("through")
    assert (r.cpu_hits, r.disk_hits, r.object_hits, r.keys) == (2, 2, 1, 10)
    assert (r.object_tokens, r.object_requests, r.object_promoted) == (4, 1, 1)
    assert (r.written, r.object_written, r.eviction_reads) == (5, 5, 0)
    assert (r.hit_ratio, r.object_hit_ratio) == (0.5, 0.1)
    assert r.loaded == 5 and r.disk_tokens == 4 + 3 and r.cpu_tokens == 8
    assert isinstance(tiers.secondaries[1], SimObjectTier) and tiers.secondaries[1].stats().used == 5


def test_writes_on_the_disks_evictions_hand_computed():
    tiers, r = replay("on-eviction")
    assert (r.cpu_hits, r.disk_hits, r.object_hits) == (2, 2, 1)
    assert (r.object_written, r.eviction_reads, r.written) == (2, 2, 5)
    assert tiers.secondaries[1].stats().used == 2


def test_a_full_object_tier_evicts_by_its_policy_and_unknown_writes_are_refused():
    # 2 objects: R3 evicts 1, 2; R4 evicts 3; R5 misses 2 everywhere, stores it again and
    # the objects evict 4: {5, 2}
    _, r = replay("through", objects=2)
    assert (r.object_hits, r.object_evicted, r.object_written, r.disk_hits) == (0, 4, 6, 2)
    with pytest.raises(ValueError, match="unknown object writes 'sometimes'"):
        build_object_tiers(2, 3, 8, writes="sometimes")


def test_plan_disk_with_an_object_tier_charges_its_bandwidth_and_latency():
    trace = Trace(TRACE, block_size=BLOCK)  # 5 unique blocks
    cost = CostModel(8000.0, 25e9, 1000, 5e9, 3e9, 1e9, 0.03)
    (row,) = plan_disk(trace, ["lru"], ["2"], ["3"], cost=cost, object_capacity="100%")
    bb = BLOCK * 1000
    assert (row.object_capacity, row.object_blocks, row.object_writes) == ("100%", 5, "through")
    assert (row.object_hit_ratio, row.object_tokens_saved, row.hit_ratio) == (0.1, 4, 0.5)
    assert (row.object_bytes_read, row.object_bytes_written, row.disk_bytes_read) == (bb, 5 * bb, 2 * bb)
    tokens = 8 + 7 + 4
    expected = tokens / 8000 - 5 * bb / 25e9 - 2 * bb / 5e9 - bb / 1e9 - 0.03
    assert row.prefill_s_saved == pytest.approx(expected)
    (evicting,) = plan_disk(trace, ["lru"], ["2"], ["3"], cost=cost, object_capacity="5",
                            object_writes="on-eviction")  # fmt: skip
    assert (evicting.object_bytes_written, evicting.disk_bytes_read) == (2 * bb, (2 + 2) * bb)
    (none,) = plan_disk(trace, ["lru"], ["2"], ["3"], cost=cost)
    assert (none.object_capacity, none.object_blocks, none.object_hit_ratio) == ("", 0, 0.0)
    with pytest.raises(ValueError, match="object_latency_s must be a number >= 0, got -1"):
        CostModel(object_latency_s=-1)


def test_the_cli_prints_and_writes_the_object_tier(tmp_path, capsys):
    out_csv = tmp_path / "o.csv"
    rc = main(["sim", "chat", "--policies", "lru", "--capacities", "5%", "--disk-capacities", "10%",
               "--object-capacity", "100%", "--object-bandwidth", "2GB", "--object-latency", "0.05",
               "--object-writes", "on-eviction", "--csv", str(out_csv), "--png", str(tmp_path / "o.png"),
               "--no-progress"])  # fmt: skip
    assert rc == 0
    printed = capsys.readouterr().out
    header = next(line for line in printed.splitlines() if line.startswith("policy"))
    assert header.split()[:8] == ["policy", "cpu", "disk", "device", "cpu", "disk", "object", "total"]
    assert "object GB r/w" in header
    assert "object tier 100%, reads 2.0 GB/s after 50 ms per request, writes on-eviction" in printed
    (row,) = list(csv.DictReader(out_csv.open()))
    assert (row["object_capacity"], row["object_writes"]) == ("100%", "on-eviction")
    assert float(row["object_hit_ratio"]) > 0


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--object-capacity", "50%"], "--object-capacity '50%' needs --disk-capacities"),
        (["--object-writes", "through"], "--object-writes 'through' needs --disk-capacities"),
        (["--disk-capacities", "10%", "--object-capacity", "lots"], "--object-capacity: bad capacity 'lots'"),
        (["--disk-capacities", "10%", "--object-capacity", "0"], "--object-capacity '0' holds no block"),
        (["--disk-capacities", "10%", "--object-capacity", "5%", "--object-latency", "-1"],
         "--object-latency must be seconds >= 0, got -1"),
        (["--disk-capacities", "10%", "--object-capacity", "5%", "--object-bandwidth", "fast"],
         "--object-bandwidth: not a size: 'fast'"),
    ],
)  # fmt: skip
def test_bad_object_values_are_named(tmp_path, flags, named):
    with pytest.raises(SystemExit) as err:
        main(["sim", "chat", "--csv", str(tmp_path / "x.csv"), "--png", str(tmp_path / "x.png"), *flags])
    assert named in str(err.value)
