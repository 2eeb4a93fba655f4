"""Fleet simulation: one trace replayed over N replicas, a router choosing each request's.

Every replica is an engine with its own device tier (an LRU prefix cache of
``device_blocks``, as in ``kvoffload.sim.tiered``) and its own host tier (a
``CPUOffloadingManager`` of ``host_blocks`` under an eviction policy of the registry).
Per request, in trace order:

1. the router (``kvoffload.sim.routing``) picks replica ``r`` from the load window and,
   for ``kv_aware``, from the index's scores;
2. ``r`` serves it with the protocol of ``kvoffload.sim.tiered``: its device tier serves
   the leading ``d`` blocks it holds, its host tier the run of ``h`` blocks after them;
   the host tier is touched with all the keys, the ``h`` blocks are loaded, the computed
   rest is stored to the host tier, and the device tier then holds the whole request;
3. the tier events of ``r`` go to the router, and the tokens ``r`` computed (prompt tokens
   minus those in the ``d + h`` blocks) join the load window.

With a shared tier (``shared_blocks``: one LRU store all replicas share, as a Redis
server would be), the run of ``s`` blocks after the host hits that the shared tier holds
is promoted into the host tier and loaded too (cached like host hits, but fetched over
the network first); every block a replica computes is written through to it. The router
does not see the shared tier: it is the same for every replica.

With one replica every routing gives exactly the counts of ``device_prefixes`` followed
by ``replay_tiered`` (the single-engine simulator). Costs are those of
``kvoffload.sim.planning.CostModel``: prefill time saved = cached tokens / prefill rate -
host-tier bytes loaded / link bandwidth - shared-tier bytes / remote bandwidth, summed
over the fleet.

Load figures per row: ``imbalance_mean`` is the mean, over the requests, of the window's
max/mean load seen at each arrival (1.0 is perfect balance, N is all on one replica);
``work_imbalance`` is max/mean of the tokens each replica computed over the whole trace.
``index_mismatches`` counts ``kv_aware`` requests whose served (device, device + host)
prefix differs from the index's prediction for the replica chosen: 0 when the index is
exact, as it must be here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvoffload.cpu import CPUOffloadingManager
from kvoffload.extras import require
from kvoffload.index.tiers import TierWeights
from kvoffload.keys import OffloadKey
from kvoffload.sim.planning import BELADY, CostModel, parse_capacity, validate_policies
from kvoffload.sim.replay import to_key_lists
from kvoffload.sim.routing import DEFAULT_BALANCE_THRESHOLD, LoadWindow, make_router, validate_routings
from kvoffload.sim.tiered import block_tokens
from kvoffload.sim.trace import Trace
from kvoffload.validation import non_negative_int, positive_int

LOAD_WINDOW_PER_REPLICA = 16  # default window: 16 requests per replica
DEFAULT_COST = CostModel()


def default_load_window(replicas: int) -> int:
    return LOAD_WINDOW_PER_REPLICA * positive_int("replicas", replicas)


class Replica:
    """One engine's device tier (LRU, ``device_blocks``; none if 0) and host tier, over an
    optional ``shared`` tier common to the fleet."""

    def __init__(
        self,
        device_blocks: int,
        host_blocks: int,
        policy: str,
        events: bool,
        shared: CPUOffloadingManager | None = None,
    ) -> None:
        non_negative_int("device_blocks", device_blocks)
        self.shared = shared
        self.device = None
        if device_blocks:
            self.device = CPUOffloadingManager(device_blocks, "lru", enable_events=events)
        self.host = CPUOffloadingManager(host_blocks, policy, enable_events=events)

    def serve(self, keys: Sequence[OffloadKey]) -> tuple[int, int, int, int, int]:
        """Serve one request; returns (device hits, host hits, shared hits, stored, evicted)
        in blocks (stored and evicted: the host tier's)."""
        d = 0
        device = self.device
        if device is not None:
            d = device.lookup_prefix(keys)
            device.touch(keys)
            out = device.prepare_store(keys[d:])
            if out is not None:
                device.complete_store(out.keys_to_store)
        host = self.host
        rest = keys[d:] if d else keys
        h = host.lookup_prefix(rest)
        shared, s = self.shared, 0
        if shared is not None and d + h < len(keys):
            s = shared.lookup_prefix(rest[h:])
            shared.touch(rest[h : h + s])
        host.touch(keys)
        if h:
            prefix = rest[:h]
            host.prepare_load(prefix)
            host.complete_load(prefix)
        stored = evicted = 0
        if d + h < len(keys):
            # the shared hits are promoted into the host tier, the computed rest stored
            out = host.prepare_store(rest[h:])
            if out is not None:
                host.complete_store(out.keys_to_store)
                stored, evicted = len(out.keys_to_store), len(out.evicted_keys)
            if shared is not None and h + s < len(rest):
                out = shared.prepare_store(rest[h + s :])
                if out is not None:
                    shared.complete_store(out.keys_to_store)
        return d, h, s, stored, evicted

    def take_events(self):
        return (self.device.take_events() if self.device else []), self.host.take_events()


@dataclass(frozen=True)
class FleetRow:
    """One (eviction policy, host capacity per replica, routing) result over the fleet."""

    routing: str
    policy: str
    capacity: str
    blocks: int  # host blocks per replica
    replicas: int
    requests: int
    device_hit_ratio: float
    host_hit_ratio: float
    hit_ratio: float  # device + host + shared
    device_tokens_saved: int
    host_tokens_saved: int
    prompt_tokens: int
    bytes_loaded: int  # host tier -> device, shared hits included
    prefill_s_saved: float
    imbalance_mean: float
    work_imbalance: float
    guarded: int  # requests the load-balance guard routed
    index_mismatches: int
    replay_s: float
    shared_blocks: int = 0
    shared_hit_ratio: float = 0.0
    shared_tokens_saved: int = 0
    shared_bytes: int = 0  # fetched from the shared tier

    @property
    def requests_per_second(self) -> float:
        return self.requests / self.replay_s if self.replay_s > 0 else float("inf")


def simulate(
    trace: Trace,
    replicas: int,
    routing: str,
    host_blocks: int,
    *,
    policy: str = "lru",
    device_blocks: int = 0,
    cost: CostModel = DEFAULT_COST,
    balance_threshold: float = DEFAULT_BALANCE_THRESHOLD,
    load_window: int | None = None,
    seed: int = 0,
    weights: TierWeights | None = None,
    capacity: str = "",
    key_lists: Sequence[Sequence[OffloadKey]] | None = None,
    shared_blocks: int = 0,
) -> FleetRow:
    """Replay ``trace`` over ``replicas`` replicas routed by ``routing`` (module doc);
    ``shared_blocks`` > 0 adds a shared tier of that many blocks under every host tier."""
    positive_int("replicas", replicas)
    non_negative_int("host_blocks", host_blocks)
    non_negative_int("shared_blocks", shared_blocks)
    (routing,) = validate_routings([routing])
    window = LoadWindow(replicas, default_load_window(replicas) if load_window is None else load_window)
    bs = trace.block_size
    router = make_router(
        routing, replicas, block_size=bs, seed=seed, balance_threshold=balance_threshold, weights=weights
    )
    events = router.wants_events
    shared = CPUOffloadingManager(shared_blocks, "lru") if shared_blocks else None
    fleet = [Replica(device_blocks, host_blocks, policy, events, shared) for _ in range(replicas)]
    if key_lists is None:
        key_lists = to_key_lists(trace.requests)
    n_keys = device_hits = host_hits = device_tokens = host_tokens = prompt_tokens = 0
    shared_hits = shared_tokens = 0
    guarded = mismatches = 0
    imbalance_sum = 0.0
    computed = [0] * replicas
    start = time.perf_counter()
    for request, keys in zip(trace.requests, key_lists):
        imbalance_sum += window.imbalance()
        hashes = np.array(request.hash_ids, dtype=np.uint64) if events else None
        r = router.choose(hashes, window)
        guarded += router.guarded
        replica = fleet[r]
        d, h, s, _, _ = replica.serve(keys)
        if events:
            router.observe(r, *replica.take_events())
            if router.predicted != (d, d + h):
                mismatches += 1
        length = request.input_length
        dt = block_tokens(length, d, bs)
        ht = block_tokens(length, d + h, bs)
        cached = block_tokens(length, d + h + s, bs)
        n_keys += len(keys)
        prompt_tokens += length
        device_hits += d
        host_hits += h
        shared_hits += s
        device_tokens += dt
        host_tokens += ht - dt
        shared_tokens += cached - ht
        computed[r] += length - cached
        window.add(r, length - cached)
    seconds = time.perf_counter() - start
    n = len(key_lists)
    block_bytes = bs * cost.kv_bytes_per_token
    loaded = (host_hits + shared_hits) * block_bytes
    fetched = shared_hits * block_bytes
    total_computed = sum(computed)
    return FleetRow(
        routing=routing,
        policy=policy,
        capacity=capacity or str(host_blocks),
        blocks=host_blocks,
        replicas=replicas,
        requests=n,
        device_hit_ratio=device_hits / n_keys if n_keys else 0.0,
        host_hit_ratio=host_hits / n_keys if n_keys else 0.0,
        hit_ratio=(device_hits + host_hits + shared_hits) / n_keys if n_keys else 0.0,
        device_tokens_saved=device_tokens,
        host_tokens_saved=host_tokens,
        prompt_tokens=prompt_tokens,
        bytes_loaded=loaded,
        prefill_s_saved=(device_tokens + host_tokens + shared_tokens) / cost.prefill_tokens_per_s
        - loaded / cost.bandwidth_bytes_per_s
        - fetched / cost.remote_bandwidth_bytes_per_s,
        imbalance_mean=imbalance_sum / n if n else 1.0,
        work_imbalance=max(computed) * replicas / total_computed if total_computed else 1.0,
        guarded=guarded,
        index_mismatches=mismatches,
        replay_s=seconds,
        shared_blocks=shared_blocks,
        shared_hit_ratio=shared_hits / n_keys if n_keys else 0.0,
        shared_tokens_saved=shared_tokens,
        shared_bytes=fetched,
    )


def plan_fleet(
    trace: Trace,
    policies: Sequence[str],
    capacities: Sequence[str],
    routings: Sequence[str],
    replicas: int,
    *,
    device_blocks: int = 0,
    cost: CostModel = DEFAULT_COST,
    balance_threshold: float = DEFAULT_BALANCE_THRESHOLD,
    load_window: int | None = None,
    seed: int = 0,
    weights: TierWeights | None = None,
    progress: Callable[[str], None] | None = None,
    shared_capacity: str | None = None,
) -> list[FleetRow]:
    """``simulate`` for every (policy, per-replica host capacity, routing); rows in that
    order. Capacities read as ``kvoffload.sim.planning.parse_capacity`` does, per replica
    (``5%``: each replica holds 5% of the trace's unique blocks); ``shared_capacity`` (read
    the same way, for the whole fleet) adds a shared tier."""
    positive_int("replicas", replicas)
    routings = validate_routings(routings)
    policies = validate_policies(policies)
    if any(p.lower() == BELADY for p in policies):
        raise ValueError("policy 'belady' has no fleet replay (it is an offline single-tier bound)")
    unique = trace.unique_blocks()
    block_bytes = trace.block_size * cost.kv_bytes_per_token
    sizes = [(spec, parse_capacity(spec, unique, block_bytes)) for spec in capacities]
    shared_blocks = parse_capacity(shared_capacity, unique, block_bytes) if shared_capacity else 0
    key_lists = to_key_lists(trace.requests)
    rows = []
    for policy in policies:
        for spec, blocks in sizes:
            for routing in routings:
                if progress:
                    progress(f"{routing} {policy} @ {spec}")
                rows.append(
                    simulate(
                        trace,
                        replicas,
                        routing,
                        blocks,
                        policy=policy,
                        device_blocks=device_blocks,
                        cost=cost,
                        balance_threshold=balance_threshold,
                        load_window=load_window,
                        seed=seed,
                        weights=weights,
                        capacity=spec,
                        key_lists=key_lists,
                        shared_blocks=shared_blocks,
                    )
                )
    return rows


def format_fleet_table(rows: Sequence[FleetRow]) -> str:
    """A fixed-width table: hit ratio per tier, load imbalance and savings per row."""
    with_shared = any(r.shared_blocks for r in rows)
    shared_header = f"{'shared':>8}" if with_shared else ""
    header = (
        f"{'routing':<12}{'policy':<9}{'capacity':>9}{'device':>8}{'host':>7}{shared_header}{'total':>7}"
        f"{'imbalance':>11}{'work max/mean':>15}{'guarded':>9}{'tokens saved':>15}"
        f"{'prefill s saved':>17}{'req/s':>8}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        guarded = f"{r.guarded / r.requests:.1%}" if r.routing == "kv_aware" and r.requests else "-"
        saved = r.device_tokens_saved + r.host_tokens_saved + r.shared_tokens_saved
        lines.append(
            f"{r.routing:<12}{r.policy:<9}{r.capacity:>9}{r.device_hit_ratio:>8.3f}{r.host_hit_ratio:>7.3f}"
            + (f"{r.shared_hit_ratio:>8.3f}" if with_shared else "")
            + f"{r.hit_ratio:>7.3f}{r.imbalance_mean:>11.2f}{r.work_imbalance:>15.2f}{guarded:>9}"
            f"{saved:>15,}{r.prefill_s_saved:>17,.1f}"
            f"{r.requests_per_second:>8,.0f}"
        )
    return "\n".join(lines)


def write_fleet_plot(rows: Sequence[FleetRow], path, title: str = "") -> list[str]:
    """Two panels against the host capacity per replica, one curve per routing (and
    eviction policy, when there are several): the hit ratio (device + host) and the mean
    load imbalance (max/mean). Returns the x tick labels drawn (capacities as typed)."""
    matplotlib = require("matplotlib", "plot", "drawing the simulator's plots")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullLocator

    from kvoffload.sim.report import capacity_ticks

    several = len({r.policy for r in rows}) > 1
    positions, names = capacity_ticks([(r.blocks, r.capacity) for r in rows])
    log = len(positions) > 2 and positions[0] > 0
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    try:
        for routing, policy in dict.fromkeys((r.routing, r.policy) for r in rows):
            mine = sorted(
                (r.blocks, r.hit_ratio, r.imbalance_mean)
                for r in rows
                if r.routing == routing and r.policy == policy
            )
            label = f"{routing}, {policy}" if several else routing
            xs = [m[0] for m in mine]
            axes[0].plot(xs, [m[1] for m in mine], marker="o", label=label)
            axes[1].plot(xs, [m[2] for m in mine], marker="o", label=label)
        for ax, ylabel in zip(axes, ("hit ratio (device + host)", "load imbalance (mean of max/mean)")):
            if log:
                ax.set_xscale("log")
            ax.set_xticks(positions, names)
            ax.xaxis.set_minor_locator(NullLocator())
            ax.set_xlabel("host tier capacity per replica")
            ax.set_ylabel(ylabel)
            ax.grid(True, alpha=0.3)
        axes[0].set_ylim(bottom=0)
        axes[1].set_ylim(bottom=1.0)
        axes[0].legend()
        if title:
            fig.suptitle(title)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        return [t.get_text() for t in axes[0].get_xticklabels()]
    finally:
        plt.close(fig)
