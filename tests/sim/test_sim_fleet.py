"""Fleet simulation: N replicas, routing policies, the load-balance guard, ``kvoffload sim --replicas``."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest

from kvoffload.cli import main
from kvoffload.cpu import CPUOffloadingManager
from kvoffload.sim.fleet import Replica, default_load_window, plan_fleet, simulate
from kvoffload.sim.planning import plan
from kvoffload.sim.replay import to_key_lists
from kvoffload.sim.routing import ROUTINGS, LoadWindow, make_router
from kvoffload.sim.tiered import device_prefixes, replay_tiered
from kvoffload.sim.trace import Trace, TraceRequest
from kvoffload.sim.workloads import ChatWorkload, multi_turn_chat


@pytest.fixture(scope="module")
def chat() -> Trace:
    return multi_turn_chat(ChatWorkload(conversations=80, seed=3))


def shared_prefix_trace(requests: int, prefix_blocks: int = 8, block_size: int = 16) -> Trace:
    """Every request: the same ``prefix_blocks`` blocks, then two blocks of its own."""
    out = []
    for i in range(requests):
        ids = (*range(prefix_blocks), 1000 + 2 * i, 1001 + 2 * i)
        out.append(TraceRequest(i, len(ids) * block_size, 10, ids))
    return Trace(out, block_size, "shared")


@pytest.mark.parametrize("policy", ["lru", "s3fifo"])
def test_one_replica_every_routing_is_the_single_engine_replay(chat, policy):
    (single,) = plan(chat, [policy], ["120"], device_blocks=40)
    keys = to_key_lists(chat.requests)
    served = device_prefixes(keys, 40)
    lengths = [r.input_length for r in chat.requests]
    counts = replay_tiered(CPUOffloadingManager(120, policy), keys, served, lengths, chat.block_size)
    assert counts.device_hits and counts.host_hits  # both tiers take part
    for routing in ROUTINGS:
        row = simulate(chat, 1, routing, 120, policy=policy, device_blocks=40)
        assert row.device_tokens_saved == counts.device_tokens
        assert row.host_tokens_saved == counts.host_tokens
        assert (row.device_hit_ratio, row.host_hit_ratio, row.hit_ratio) == (
            single.device_hit_ratio,
            single.host_hit_ratio,
            single.hit_ratio,
        )
        assert row.prefill_s_saved == pytest.approx(single.prefill_s_saved)
        assert row.bytes_loaded == single.bytes_loaded
        assert row.imbalance_mean == row.work_imbalance == 1.0
        assert row.guarded == 0 and row.index_mismatches == 0


def test_kv_aware_beats_round_robin_and_random_on_multi_turn_chat(chat):
    rows = {r.routing: r for r in plan_fleet(chat, ["lru"], ["60"], ROUTINGS, 4, device_blocks=30)}
    kv = rows["kv_aware"]
    for other in ("round_robin", "random", "least_load"):
        assert kv.hit_ratio > rows[other].hit_ratio + 0.1, (other, kv, rows[other])
        assert kv.prefill_s_saved > rows[other].prefill_s_saved
    assert kv.index_mismatches == 0  # the index predicted every replica's hits exactly
    assert kv.work_imbalance < 2.0  # affinity did not pile the fleet onto one replica


def test_pure_affinity_piles_on_one_replica_and_the_guard_spreads_it():
    trace = shared_prefix_trace(200)
    pure = simulate(trace, 4, "kv_aware", 50, device_blocks=20, balance_threshold=float("inf"))
    assert pure.guarded == 0
    assert pure.work_imbalance == pytest.approx(4.0)  # everything went where the prefix lives
    guarded = simulate(trace, 4, "kv_aware", 50, device_blocks=20, balance_threshold=1.5)
    assert guarded.guarded > 0
    assert guarded.work_imbalance < 2.0 and guarded.imbalance_mean < pure.imbalance_mean
    assert guarded.index_mismatches == 0


def _served_on(router, replica: Replica, index: int, ids) -> None:
    keys = to_key_lists([TraceRequest(0, len(ids) * 16, 1, tuple(ids))])[0]
    replica.serve(keys)
    router.observe(index, *replica.take_events())


def test_guard_decides_by_the_threshold():
    router = make_router("kv_aware", 3, block_size=16, balance_threshold=1.5)
    replicas = [Replica(10, 10, "lru", events=True) for _ in range(3)]
    _served_on(router, replicas[2], 2, [1, 2, 3])
    hashes = np.array([1, 2, 3, 4], dtype=np.uint64)
    window = LoadWindow(3, 10)
    window.add(2, 100)
    window.add(0, 90)
    window.add(1, 80)  # max/mean = 100 / 90 = 1.11: affinity
    assert router.choose(hashes, window) == 2 and not router.guarded
    assert router.predicted == (3, 3)
    window.add(2, 400)  # max/mean = 500 / 223 = 2.24 > 1.5: the guard sends it to replica 1
    assert window.imbalance() == pytest.approx(500 * 3 / 670)
    assert router.choose(hashes, window) == 1 and router.guarded


def test_kv_aware_weighs_tiers_and_breaks_ties_by_load():
    router = make_router("kv_aware", 3, block_size=16)
    replicas = [Replica(2, 10, "lru", events=True) for _ in range(3)]
    _served_on(router, replicas[0], 0, [1, 2, 3, 4])  # device holds 2 blocks: 1, 2 ... then host
    _served_on(router, replicas[0], 0, [9, 8])  # device now holds 9, 8; 1..4 only in host
    _served_on(router, replicas[1], 1, [1, 2, 3])  # device: nothing left of a 3-block request
    window = LoadWindow(3, 10)
    window.add(2, 5)
    # replica 0: 4 host blocks x 0.75 = 3.0; replica 1: 3 host blocks = 2.25
    assert router.choose(np.array([1, 2, 3, 4], dtype=np.uint64), window) == 0
    assert router.predicted == (0, 4)
    # nobody holds block 77: a tie at 0, replica 2 is loaded, 0 and 1 are not: lowest index
    assert router.choose(np.array([77], dtype=np.uint64), window) == 0


def test_load_window_counts_the_last_requests_only():
    window = LoadWindow(2, 3)
    assert window.imbalance() == 1.0
    for replica, tokens in [(0, 10), (1, 30), (0, 20), (1, 5)]:
        window.add(replica, tokens)
    assert window.loads == [20, 35]  # the first request (10 tokens on 0) left the window
    assert window.least_loaded() == 0
    assert window.imbalance() == pytest.approx(35 / 27.5)
    assert default_load_window(8) == 128


def test_round_robin_and_seeded_random_routes():
    trace = shared_prefix_trace(30)
    rr = make_router("round_robin", 3, block_size=16)
    window = LoadWindow(3, 5)
    assert [rr.choose(None, window) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    a, b, c = (make_router("random", 4, block_size=16, seed=s) for s in (7, 7, 8))
    seq = [[r.choose(None, window) for _ in range(50)] for r in (a, b, c)]
    assert seq[0] == seq[1] != seq[2] and set(seq[0]) == {0, 1, 2, 3}
    x = simulate(trace, 3, "random", 20, device_blocks=5, seed=1)
    y = simulate(trace, 3, "random", 20, device_blocks=5, seed=1)
    assert (x.hit_ratio, x.work_imbalance) == (y.hit_ratio, y.work_imbalance)


@pytest.mark.parametrize(
    "kwargs, named",
    [
        ({"replicas": 0}, "replicas must be a positive int, got 0"),
        ({"routing": "nearest"}, "unknown routing 'nearest'"),
        ({"routing": "kv_aware", "balance_threshold": 0.5}, "got 0.5"),
        ({"load_window": 0}, "load_window must be a positive int, got 0"),
        ({"host_blocks": -2}, "host_blocks must be a non-negative int, got -2"),
        ({"device_blocks": -1}, "device_blocks must be a non-negative int, got -1"),
        ({"policy": "nope"}, "'nope'"),
    ],
)
def test_bad_arguments_name_the_value(kwargs, named):
    args = {"replicas": 2, "routing": "round_robin", "host_blocks": 10} | kwargs
    trace = shared_prefix_trace(3)
    with pytest.raises(ValueError, match=named):
        simulate(trace, args.pop("replicas"), args.pop("routing"), args.pop("host_blocks"), **args)


def test_plan_fleet_refuses_belady(chat):
    with pytest.raises(ValueError, match="'belady'"):
        plan_fleet(chat, ["lru", "belady"], ["1%"], ["kv_aware"], 2)


def write_trace(path, trace: Trace) -> None:
    with path.open("w") as fh:
        for r in trace.requests:
            fh.write(
                json.dumps(
                    {
                        "timestamp": r.timestamp,
                        "input_length": r.input_length,
                        "output_length": r.output_length,
                        "hash_ids": list(r.hash_ids),
                    }
                )
                + "\n"
            )


def test_cli_fleet_end_to_end(tmp_path, capsys, monkeypatch):
    import kvoffload.cli.sim as cli

    drawn = []
    real = cli.write_fleet_plot
    monkeypatch.setattr(cli, "write_fleet_plot", lambda *a, **k: drawn.append(real(*a, **k)))
    path = tmp_path / "chat.jsonl"
    write_trace(path, multi_turn_chat(ChatWorkload(conversations=40, seed=5, block_size=512)))
    out_csv, out_png = tmp_path / "f.csv", tmp_path / "f.png"
    rc = main(
        ["sim", str(path), "--replicas", "3", "--routing", "round_robin,kv_aware", "--policies", "lru,belady",
         "--capacities", "5%,40", "--device-blocks", "20", "--balance-threshold", "3",
         "--csv", str(out_csv), "--png", str(out_png), "--no-progress"]
    )  # fmt: skip
    assert rc == 0
    printed = capsys.readouterr().out
    assert "belady left out" in printed and "guard at max/mean load > 3" in printed
    assert "last 48 requests" in printed  # the default window: 16 per replica
    header = next(line for line in printed.splitlines() if line.startswith("routing"))
    assert header.split()[:6] == ["routing", "policy", "capacity", "device", "host", "total"]
    rows = list(csv.DictReader(out_csv.open()))
    assert [(r["policy"], r["capacity"], r["routing"]) for r in rows] == [
        ("lru", "5%", "round_robin"),
        ("lru", "5%", "kv_aware"),
        ("lru", "40", "round_robin"),
        ("lru", "40", "kv_aware"),
    ]
    assert all(r["replicas"] == "3" and r["index_mismatches"] == "0" for r in rows)
    ratio = {(r["capacity"], r["routing"]): float(r["hit_ratio"]) for r in rows}
    assert ratio["40", "kv_aware"] > ratio["40", "round_robin"]
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert drawn and sorted(drawn[0]) == ["40", "5%"]


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--replicas", "0"], "--replicas must be >= 1, got 0"),
        (["--replicas", "2", "--routing", "kv_aware,nearest"], "--routing: unknown routing 'nearest'"),
        (["--replicas", "2", "--routing", " , "], "--routing is empty"),
        (["--replicas", "2", "--balance-threshold", "0.5"], "--balance-threshold must be >= 1"),
        (["--replicas", "2", "--balance-threshold", "nan"], "got nan"),
        (["--replicas", "2", "--load-window", "0"], "--load-window must be >= 1, got 0"),
        (["--replicas", "2", "--tier-weights", "host=2"], "--tier-weights: tier weight host"),
        (["--replicas", "2", "--disk-capacities", "10%"], "--disk-capacities '10%'"),
        (["--replicas", "2", "--policies", "belady"], "--policies 'belady'"),
        (["--routing", "kv_aware"], "--routing 'kv_aware' needs --replicas"),
        (["--balance-threshold", "2"], "--balance-threshold 2.0 needs --replicas"),
        (["--shared-capacity", "10%"], "--shared-capacity '10%' needs --replicas"),
        (["--replicas", "2", "--shared-capacity", "lots"], "--shared-capacity"),
        (["--replicas", "2", "--shared-capacity", "0"], "--shared-capacity '0' holds no block"),
        (["--replicas", "2", "--shared-capacity", "10%", "--remote-bandwidth", "fast"], "--remote-bandwidth"),
        (["--shared-segment", "5%"], "--shared-segment '5%' needs --replicas"),
        (["--replicas", "2", "--shared-segment", "0"], "--shared-segment '0' holds no block"),
        (["--replicas", "2", "--shared-segment", "-3"], "--shared-segment"),
        (["--replicas", "2", "--shared-segment", "5%", "--shared-capacity", "9%"], "give one"),
    ],
)
def test_cli_bad_fleet_values_are_named(tmp_path, flags, named):
    with pytest.raises(SystemExit) as err:
        main(["sim", "chat", "--csv", str(tmp_path / "x.csv"), "--png", str(tmp_path / "x.png"), *flags])
    assert named in str(err.value)


def test_a_shared_tier_serves_what_other_replicas_computed(chat):
    without = simulate(chat, 4, "round_robin", 30, device_blocks=20)
    shared = simulate(chat, 4, "round_robin", 30, device_blocks=20, shared_blocks=100_000)
    assert without.shared_hit_ratio == 0 and without.shared_bytes == 0
    assert shared.shared_hit_ratio > 0.1 and shared.hit_ratio > without.hit_ratio + 0.1
    assert shared.hit_ratio == pytest.approx(
        shared.device_hit_ratio + shared.host_hit_ratio + shared.shared_hit_ratio
    )
    # the shared hits are fetched over the network, then loaded like host hits
    block_bytes = chat.block_size * 131072
    assert shared.shared_bytes % block_bytes == 0 and shared.shared_bytes > 0
    assert shared.bytes_loaded > shared.shared_bytes
    # one replica with a shared tier as large as everything: the shared tier holds only
    # what its own host tier evicted, so it never serves a block the host tier holds
    alone = simulate(chat, 1, "round_robin", 30, device_blocks=20, shared_blocks=100_000)
    single = simulate(chat, 1, "round_robin", 30, device_blocks=20)
    assert alone.host_hit_ratio == pytest.approx(single.host_hit_ratio, abs=0.05)
    assert alone.hit_ratio >= single.hit_ratio


def test_shared_tier_replica_promotes_into_its_host_tier_and_writes_through():
    shared = CPUOffloadingManager(100)
    a, b = Replica(0, 10, "lru", False, shared), Replica(0, 10, "lru", False, shared)
    keys = [bytes([i]) * 36 for i in range(4)]
    assert a.serve(keys) == (0, 0, 0, 4, 0)  # computed, stored to a's host and the shared tier
    assert all(shared.lookup(k).name == "HIT" for k in keys)
    assert b.serve(keys) == (0, 0, 4, 4, 0)  # b finds all four below and promotes them
    assert b.serve(keys) == (0, 4, 0, 0, 0)  # now its own host tier has them


def test_cli_shared_segments_make_a_store_of_every_replicas_memory(tmp_path, capsys):
    """``--shared-segment S`` (Mooncake Store: each engine contributes a segment) is the same
    replay as ``--shared-capacity`` of replicas x S blocks, and the report says which."""
    path = tmp_path / "chat.jsonl"
    write_trace(path, multi_turn_chat(ChatWorkload(conversations=40, seed=5, block_size=512)))
    rows = {}
    for name, flags in (("segment", ["--shared-segment", "7"]), ("total", ["--shared-capacity", "21"])):
        out_csv = tmp_path / f"{name}.csv"
        rc = main(
            ["sim", str(path), "--replicas", "3", "--routing", "round_robin", "--policies", "lru",
             "--capacities", "5", "--device-blocks", "20", "--remote-bandwidth", "20GB",
             "--csv", str(out_csv), "--png", str(tmp_path / f"{name}.png"), "--no-progress", *flags]
        )  # fmt: skip
        assert rc == 0
        printed = capsys.readouterr().out
        rows[name] = next(csv.DictReader(out_csv.open()))
        assert "read at 20.0 GB/s" in printed
        assert ("3 segments of 7 (21 blocks)" in printed) == (name == "segment")
    assert float(rows["segment"]["shared_hit_ratio"]) > 0
    timing = ("replay_s", "requests_per_second")
    assert {k: v for k, v in rows["segment"].items() if k not in timing} == {
        k: v for k, v in rows["total"].items() if k not in timing
    }
