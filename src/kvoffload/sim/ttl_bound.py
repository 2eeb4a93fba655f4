"""An estimate of the best hit ratio an online policy deciding by (request class, block age)
can reach on a trace: a relaxation, not a proof.

The modelled policy keeps each referenced block for a time-to-live ``tau`` (counted in
requests) chosen by the class of the request making the reference, possibly for only a
fraction of that class's references (fractional admission). A reference hits iff the
block's previous reference was kept and came at most ``tau`` requests earlier. Keeping a
reference costs ``min(gap, tau)`` block-requests, where ``gap`` is the number of requests
to the block's next reference; a block never named again costs ``tau``, cut at the end of
the trace (occupancy after the last request spends none of the budget).

Relaxations, each of which can only raise the estimate above what a real policy of this
kind reaches in ``kvoffload.sim.replay``:

* average occupancy: the budget is ``capacity_blocks * requests`` block-requests in
  total, not ``capacity_blocks`` at every instant (so the cold start's empty cache and
  bursts are free to trade against each other);
* no prefix constraint: a reference hits on its own, even if an earlier block of its
  request misses (the replay counts only the leading run of hits);
* fractional admission: each class mixes two TTLs on its upper concave hull, so the
  optimum is a fractional knapsack filled greedily by hits per unit cost.

TTL classes come from what an online policy can observe at the reference: its request's
past (``request_features``) and how many earlier requests named the block (``freq``). It is
an estimate of the ceiling for age-and-class policies, valid for the chosen feature set,
TTL grid and coarse buckets only. ``oracle_bound`` gives each reference its exact gap as
its class (the fractional knapsack over references, value = the hits its keeping earns,
cost = ``gap``): it bounds every class estimate from above and calibrates the relaxation
against Belady. Every block id of every request is a reference, the trailing block
included: hit ratio = hit references / all references, as the replay counts keys. A block
named twice in one request is one reference of weight 2 (both copies hit or miss together).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Real

import numpy as np

from kvoffload.sim.trace import TraceRequest

FEATURE_SETS = (
    "none",
    "level",
    "level+new",
    "level+prevgap",
    "level+prevgap+new",
    "level+freq",
    "level+prevgap+new+freq",
)
PREV_GAP_CUTS = (64, 256, 1024)
NEW_BLOCKS_CUTS = (2, 4, 8, 16)
MAX_LEVEL = 3
MAX_FREQ = 4


@dataclass(frozen=True)
class References:
    """Distinct (request, block) references in request order, with their reuse gaps.

    ``gap[r]`` is the number of requests to the next reference of the same block, 0 when
    there is none; ``next_weight[r]`` the hits keeping ``r`` through its gap earns (the
    next reference's weight, 0 when there is none); ``prior[r]`` the number of earlier
    requests that named the block. ``total`` counts all block ids.
    """

    request: np.ndarray
    weight: np.ndarray
    gap: np.ndarray
    next_weight: np.ndarray
    prior: np.ndarray
    requests: int
    total: int


@dataclass(frozen=True)
class RequestFeatures:
    """Per request, from the past only: conversation ``level``, ``prev_gap``, ``new_blocks``."""

    level: np.ndarray
    prev_gap: np.ndarray
    new_blocks: np.ndarray


def block_references(requests: Sequence[TraceRequest]) -> References:
    """Every block id of every request as references, with the gap to each one's next use."""
    codes: dict[int, int] = {}
    flat = [codes.setdefault(b, len(codes)) for r in requests for b in r.hash_ids]
    lengths = np.fromiter((len(r.hash_ids) for r in requests), np.int64, len(requests))
    req = np.repeat(np.arange(len(requests), dtype=np.int64), lengths)
    blk = np.asarray(flat, dtype=np.int64)
    pair, weight = np.unique(req * max(len(codes), 1) + blk, return_counts=True)
    req, blk = np.divmod(pair, max(len(codes), 1))
    by_block = np.lexsort((req, blk))
    same = blk[by_block[1:]] == blk[by_block[:-1]]
    gap = np.zeros(len(pair), np.int64)
    next_weight = np.zeros(len(pair), np.int64)
    gap[by_block[:-1][same]] = (req[by_block[1:]] - req[by_block[:-1]])[same]
    next_weight[by_block[:-1][same]] = weight[by_block[1:]][same]
    starts = np.flatnonzero(np.concatenate(([True], ~same)))  # first reference of each block
    rank = np.arange(len(pair)) - np.repeat(starts, np.diff(np.append(starts, len(pair))))
    prior = np.empty(len(pair), np.int64)
    prior[by_block] = rank
    return References(req, weight, gap, next_weight, prior, len(requests), int(lengths.sum()))


def request_features(requests: Sequence[TraceRequest]) -> RequestFeatures:
    """Features of each request from earlier requests only.

    The leading seen run is the request's longest prefix of blocks named by earlier
    requests. Runs under 2 blocks give ``level`` 0 and ``prev_gap`` -1; otherwise ``j`` is
    the request that last named the run's deepest block, ``level = min(3, level[j] + 1)``
    and ``prev_gap = i - j``. ``new_blocks`` counts the blocks after the run.
    """
    n = len(requests)
    level = np.zeros(n, np.int64)
    prev_gap = np.full(n, -1, np.int64)
    new_blocks = np.zeros(n, np.int64)
    last: dict[int, int] = {}
    for i, request in enumerate(requests):
        ids = request.hash_ids
        seen = 0
        for block in ids:
            if block not in last:
                break
            seen += 1
        new_blocks[i] = len(ids) - seen
        if seen >= 2:
            j = last[ids[seen - 1]]
            level[i] = min(MAX_LEVEL, level[j] + 1)
            prev_gap[i] = i - j
        for block in ids:
            last[block] = i
    return RequestFeatures(level, prev_gap, new_blocks)


def reference_classes(refs: References, features: RequestFeatures, feature_set: str) -> np.ndarray:
    """Dense class codes per reference for ``feature_set`` (one of ``FEATURE_SETS``).

    Request features apply to all of a request's references. Buckets: ``prev_gap`` -1
    (none) or the number of ``PREV_GAP_CUTS`` it reaches; ``new_blocks`` the number of
    ``NEW_BLOCKS_CUTS`` it reaches; ``freq`` the block's ``prior`` capped at ``MAX_FREQ``.
    """
    if feature_set not in FEATURE_SETS:
        raise ValueError(f"unknown feature set {feature_set!r}; known: {', '.join(FEATURE_SETS)}")
    if len(features.level) != refs.requests:
        raise ValueError(f"features cover {len(features.level)} requests, references {refs.requests}")
    pg = np.where(features.prev_gap < 0, -1, np.searchsorted(PREV_GAP_CUTS, features.prev_gap, "right"))
    nb = np.searchsorted(NEW_BLOCKS_CUTS, features.new_blocks, "right")
    at = refs.request
    parts = {
        "level": features.level[at],
        "prevgap": pg[at] + 1,
        "new": nb[at],
        "freq": np.minimum(refs.prior, MAX_FREQ),
    }
    code = np.zeros(len(at), np.int64)
    if feature_set != "none":
        for name in feature_set.split("+"):
            code = code * 16 + parts[name]
    return np.unique(code, return_inverse=True)[1].reshape(-1)


def tau_grid(requests: int, points: int = 60) -> np.ndarray:
    """About ``points`` integer TTLs, log-spaced from 1 to twice ``requests``."""
    if points < 1:
        raise ValueError(f"points must be positive, got {points!r}")
    return np.unique(np.round(np.geomspace(1, max(2, 2 * requests), points)))


def ttl_bound(
    refs: References, classes: np.ndarray, capacity_blocks: float, taus: Sequence[float] | None = None
) -> float:
    """Estimated best hit ratio of class-TTL policies; ``classes`` holds one label per reference."""
    budget = _budget(refs, capacity_blocks)
    classes = np.asarray(classes)
    if classes.shape != refs.request.shape:
        raise ValueError(
            f"classes must hold one code per reference ({refs.request.size}), got shape {classes.shape}"
        )
    taus = tau_grid(refs.requests) if taus is None else np.asarray(sorted(taus), float)
    if taus.size == 0 or taus[0] <= 0:
        raise ValueError(f"taus must be positive, got {taus!r}")
    ref_class = np.unique(classes, return_inverse=True)[1].reshape(-1)
    # a reference is held for min(tau, span) requests: span is its gap, or the requests
    # left in the trace when it has no next use (and then earns nothing)
    span = np.where(refs.gap > 0, refs.gap, refs.requests - 1 - refs.request)
    order = np.lexsort((span, ref_class))
    ref_class, span, value = ref_class[order], span[order], refs.next_weight[order]
    bounds = np.searchsorted(ref_class, np.arange(ref_class.max() + 2 if ref_class.size else 1))
    steps = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        within = np.searchsorted(span[lo:hi], taus, "right")  # references with span <= tau
        cum_span = np.concatenate(([0.0], np.cumsum(span[lo:hi])))
        cum_value = np.concatenate(([0.0], np.cumsum(value[lo:hi])))
        steps += _hull_steps(cum_span[within] + taus * (hi - lo - within), cum_value[within])
    costs, values = zip(*steps) if steps else ((), ())
    return _fill(costs, values, budget) / refs.total if refs.total else 0.0


def oracle_bound(refs: References, capacity_blocks: float) -> float:
    """The same relaxation with each reference's exact gap as its class (the knapsack ceiling)."""
    budget = _budget(refs, capacity_blocks)
    kept = refs.gap > 0
    return _fill(refs.gap[kept], refs.next_weight[kept], budget) / refs.total if refs.total else 0.0


def _budget(refs: References, capacity_blocks: float) -> float:
    if isinstance(capacity_blocks, bool) or not isinstance(capacity_blocks, Real) or not capacity_blocks >= 0:
        raise ValueError(f"capacity_blocks must be a non-negative number, got {capacity_blocks!r}")
    return float(capacity_blocks) * refs.requests


def _hull_steps(costs: np.ndarray, values: np.ndarray) -> list[tuple[float, float]]:
    """(cost, value) increments along the upper concave hull of the points and the origin."""
    hull = [(0.0, 0.0)]
    for c, v in zip(costs.tolist(), values.tolist()):
        if v <= hull[-1][1]:
            continue  # costs grow with tau, so a point without more hits is dominated
        while len(hull) >= 2:
            (x1, y1), (x2, y2) = hull[-2], hull[-1]
            if (y2 - y1) * (c - x1) > (v - y1) * (x2 - x1):
                break
            hull.pop()
        hull.append((c, v))
    return [(x2 - x1, y2 - y1) for (x1, y1), (x2, y2) in zip(hull, hull[1:])]


def _fill(costs: Sequence[float], values: Sequence[float], budget: float) -> float:
    """Fractional knapsack: value bought with ``budget`` taking steps by value per cost."""
    costs, values = np.asarray(costs, float), np.asarray(values, float)
    if costs.size == 0:
        return 0.0
    order = np.argsort(-values / costs, kind="stable")
    costs, values = costs[order], values[order]
    spent = np.cumsum(costs)
    whole = int(np.searchsorted(spent, budget, "right"))  # steps bought entirely
    got = float(values[:whole].sum())
    if whole < costs.size:
        got += values[whole] * (budget - (spent[whole - 1] if whole else 0.0)) / costs[whole]
    return got
