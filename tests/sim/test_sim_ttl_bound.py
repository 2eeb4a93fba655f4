"""Class-TTL hit-ratio estimate: hand-computed gaps, features and LP optima; the oracle on top."""

from __future__ import annotations

import numpy as np
import pytest

from kvoffload.sim.trace import TraceRequest
from kvoffload.sim.ttl_bound import (
    FEATURE_SETS,
    RequestFeatures,
    block_references,
    oracle_bound,
    reference_classes,
    request_features,
    tau_grid,
    ttl_bound,
)
from kvoffload.sim.workloads import builtin_workload


def requests(*id_lists):
    return [TraceRequest(i, 4 * len(ids), 1, tuple(ids)) for i, ids in enumerate(id_lists)]


def test_gaps_and_weights_hand_computed():
    refs = block_references(requests([1, 2], [3], [1, 2, 4], [2, 2]))
    got = sorted(
        zip(refs.request.tolist(), refs.weight.tolist(), refs.gap.tolist(), refs.next_weight.tolist())
    )
    # block 2 twice in request 3 is one reference of weight 2; keeping request 2's copy earns both
    assert got == [
        (0, 1, 2, 1),
        (0, 1, 2, 1),
        (1, 1, 0, 0),
        (2, 1, 0, 0),
        (2, 1, 0, 0),
        (2, 1, 1, 2),
        (3, 2, 0, 0),
    ]
    assert (refs.requests, refs.total) == (4, 8)
    prior = sorted(zip(refs.request.tolist(), refs.prior.tolist()))
    assert prior == [
        (0, 0),
        (0, 0),
        (1, 0),
        (2, 0),
        (2, 1),
        (2, 1),
        (3, 2),
    ]  # block 2: requests 0, 2 before 3


def test_features_of_a_small_conversation():
    trace = requests([1, 2, 3], [9], [1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 6], [1, 7], [1, 2, 8])
    f = request_features(trace)
    assert f.level.tolist() == [0, 0, 1, 2, 0, 3]
    assert f.prev_gap.tolist() == [
        -1,
        -1,
        2,
        1,
        -1,
        2,
    ]  # request 5's run ends at block 2, last named by 3 (level 2)
    assert f.new_blocks.tolist() == [3, 1, 2, 1, 1, 1]


def test_level_saturates_at_three():
    chain = [list(range(k + 2)) for k in range(6)]
    assert request_features(requests(*chain)).level.tolist() == [0, 1, 2, 3, 3, 3]


def test_feature_set_buckets():
    level, prev_gap, new = [0, 0, 0, 0, 1, 1], [-1, 63, 64, 1024, 5, 5], [1, 1, 2, 3, 15, 16]
    f = RequestFeatures(np.array(level), np.array(prev_gap), np.array(new))
    refs = block_references(requests([1], [2], [3], [4], [5], [6]))  # one reference each, in order
    assert reference_classes(refs, f, "none").tolist() == [0] * 6
    assert reference_classes(refs, f, "level").tolist() == [0, 0, 0, 0, 1, 1]
    prevgap = reference_classes(refs, f, "level+prevgap").tolist()
    assert len(set(prevgap[:4])) == 4 and prevgap[4] == prevgap[5]  # -1, <64, 64..255, >=1024
    new = reference_classes(refs, f, "level+new").tolist()
    assert new[0] == new[1] and new[2] == new[3] and new[4] != new[5]  # cuts at 2 and 16
    assert len(set(reference_classes(refs, f, "level+prevgap+new").tolist())) == 6
    with pytest.raises(ValueError, match=r"'level\+age'"):
        reference_classes(refs, f, "level+age")
    with pytest.raises(ValueError, match="cover 6 requests, references 5"):
        reference_classes(block_references(requests(*[[b] for b in range(5)])), f, "level")


def test_freq_classes_count_earlier_requests_capped():
    # block 1 named by 7 requests: prior 0..6, capped at 4; block 2 once (prior 0)
    trace = requests(*[[1]] * 7, [2])
    refs = block_references(trace)
    freq = reference_classes(refs, request_features(trace), "level+freq")
    by_ref = dict(zip(zip(refs.request.tolist(), refs.prior.tolist()), freq.tolist()))
    assert [by_ref[(i, i)] for i in range(4)] == sorted({by_ref[(i, i)] for i in range(4)})  # 0..3 distinct
    assert by_ref[(4, 4)] == by_ref[(5, 5)] == by_ref[(6, 6)] != by_ref[(3, 3)]
    assert by_ref[(7, 0)] == by_ref[(0, 0)]


def test_loop_that_thrashes_lru_hand_computed():
    # A B C A B C ... 4 rounds, capacity 2: LRU hits nothing, Belady 6 of 12. With one
    # class, tau >= 3 keeps all 9 reusable references (cost 3 each) plus the last three
    # for the 2 + 1 + 0 requests left: 30 block-requests for 9 hits; the budget is
    # 2 * 12 = 24, so 0.8 of the hull step: 7.2 hits of 12 references.
    refs = block_references(requests(*[[b] for b in [1, 2, 3] * 4]))
    assert ttl_bound(refs, np.zeros(12, int), 2) == pytest.approx(0.6)
    assert oracle_bound(refs, 2) == pytest.approx(8 / 12)  # 24 / 3 references kept
    assert ttl_bound(refs, np.zeros(12, int), 2, taus=[1, 2]) == 0.0  # no TTL reaches a reuse


def test_classes_that_separate_one_shot_requests_hand_computed():
    # A X A Y A Z: A's requests in class 0 reuse after 2 requests; X, Y, Z never come back.
    refs = block_references(requests([1], [2], [1], [3], [1], [4]))
    split = np.array([0, 1, 0, 1, 0, 1])
    # class 0 at tau 2 costs 2 + 2 + 1 (A's last reference, one request left) for 2 hits
    assert ttl_bound(refs, split, 1, taus=[1, 2, 4]) == pytest.approx(2 / 6)
    assert ttl_bound(refs, split, 0.5, taus=[1, 2, 4]) == pytest.approx(2 * 3 / 5 / 6)
    # one class pays for X, Y too: 2 + 4->2 + 2 + 2 + 1 + 0 = 9 for 2 hits, budget 6
    assert ttl_bound(refs, np.zeros(6, int), 1, taus=[1, 2, 4]) == pytest.approx(2 * 6 / 9 / 6)
    assert oracle_bound(refs, 1) == pytest.approx(2 / 6)


def infinite_cache_ratio(trace):
    seen, hits, total = set(), 0, 0
    for request in trace:
        hits += sum(b in seen for b in request.hash_ids)
        total += len(request.hash_ids)
        seen.update(request.hash_ids)
    return hits / total


@pytest.mark.parametrize("name", ["chat", "agentic", "documents"])
def test_unbounded_budget_reaches_the_infinite_cache(name):
    trace = builtin_workload(name).requests[:400]
    refs = block_references(trace)
    expected = infinite_cache_ratio(trace)
    assert 0 < expected < 1
    everything = refs.total * 3  # more than any tau up to 2 * requests can spend
    assert ttl_bound(
        refs, reference_classes(refs, request_features(trace), "none"), everything
    ) == pytest.approx(expected)
    assert oracle_bound(refs, everything) == pytest.approx(expected)


@pytest.mark.parametrize("name", ["chat", "agentic", "documents"])
def test_oracle_is_above_every_class_estimate(name):
    trace = builtin_workload(name).requests[:600]
    refs, features = block_references(trace), request_features(trace)
    unique = len({b for r in trace for b in r.hash_ids})
    for fraction in (0.01, 0.05, 0.25):
        capacity = max(1, int(unique * fraction))
        oracle = oracle_bound(refs, capacity)
        estimates = [ttl_bound(refs, reference_classes(refs, features, fs), capacity) for fs in FEATURE_SETS]
        assert all(e <= oracle + 1e-12 for e in estimates), (fraction, estimates, oracle)
        # "none" is one class of every finer feature set, so it cannot beat them
        assert all(estimates[0] <= e + 1e-12 for e in estimates[1:]), (fraction, estimates)


def test_estimate_grows_with_capacity():
    trace = builtin_workload("chat").requests[:500]
    refs = block_references(trace)
    classes = reference_classes(refs, request_features(trace), "level+new")
    ratios = [ttl_bound(refs, classes, c) for c in (0, 5, 20, 80, 320)]
    assert ratios[0] == 0.0 and all(a < b for a, b in zip(ratios, ratios[1:]))


def test_bad_arguments_are_named():
    refs = block_references(requests([1], [1]))
    with pytest.raises(ValueError, match="-1"):
        ttl_bound(refs, np.zeros(2, int), -1)
    with pytest.raises(ValueError, match="'4'"):
        oracle_bound(refs, "4")
    with pytest.raises(ValueError, match="shape"):
        ttl_bound(refs, np.zeros(3, int), 1)
    with pytest.raises(ValueError, match="taus"):
        ttl_bound(refs, np.zeros(2, int), 1, taus=[0, 1])
    assert tau_grid(12_000)[[0, -1]].tolist() == [1, 24_000]


def test_class_labels_are_only_names():
    refs = block_references(requests([1], [2], [1], [3], [1], [4]))
    assert ttl_bound(refs, np.array([7, -3, 7, -3, 7, -3]), 1, taus=[1, 2, 4]) == pytest.approx(2 / 6)
