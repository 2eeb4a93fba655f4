"""Metric values read from the components' own counters, and the transfer meter.

``Samples`` holds values by metric key (``kvoffload.metrics.names``) and label values:
counters and gauges as numbers, histograms as ``Hist`` (cumulative bucket counts).
Readers fill one from a component at the moment they are called; they only read
counters the components keep anyway, so nothing on the hot path pays for metrics:

* ``read_scheduler``: an ``OffloadingScheduler``'s counters and hit tokens per tier;
* ``read_sessions``: a scheduler's session controls (``SessionRegistry.stats()``) and,
  given one, a ``DirectiveReader``'s counts of requests' directives by outcome;
* ``read_manager``: every tier of a manager (a tier, or a tiered manager): lookups, hits,
  evictions, blocks by state, capacity, host usage fractions, each tier's own
  ``counters()``;
* ``read_publisher`` / ``read_subscriber``: the event publisher's and subscriber's stats.

``TransferMeter`` is fed one call per finished transfer job on the worker side (a few
dict updates under a lock) and keeps cumulative counters and histograms, plus the
histogram observations not yet taken (for engines that want per-interval deltas).

Tier labels follow vLLM 0.32's tiering metrics: ``0:primary`` for the host tier and
``i:type`` for the ``i``-th secondary tier (``1:fs``, ``2:redis``).
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvoffload.metrics.names import (
    DIRECTIVE_OUTCOMES,
    METRICS,
    PRIMARY_TIER,
    PUBLISHER_FIELDS,
    SUBSCRIBER_FIELDS,
    UNKNOWN_TIER,
)
from kvoffload.specs import MEDIUM_CPU, MEDIUM_DEVICE

Labels = tuple[str, ...]


@dataclass
class Hist:
    """Cumulative histogram: ``counts[i]`` observations <= ``bounds[i]`` (the last one
    +Inf, not cumulative across buckets), ``sum`` and ``count``."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    sum: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def merge(self, other: Hist) -> None:
        for i, n in enumerate(other.counts):
            self.counts[i] += n
        self.sum += other.sum
        self.count += other.count

    def copy(self) -> Hist:
        return Hist(self.bounds, list(self.counts), self.sum, self.count)


class Samples:
    """Values by metric key and label values; ``add`` sums (several sources merge)."""

    def __init__(self) -> None:
        self.values: dict[str, dict[Labels, float]] = {}
        self.hists: dict[str, dict[Labels, Hist]] = {}

    def add(self, key: str, value: float, labels: Labels = ()) -> None:
        series = self.values.setdefault(key, {})
        series[labels] = series.get(labels, 0) + value

    def add_hist(self, key: str, hist: Hist, labels: Labels = ()) -> None:
        series = self.hists.setdefault(key, {})
        if labels in series:
            series[labels].merge(hist)
        else:
            series[labels] = hist.copy()

    def merge(self, other: Samples) -> None:
        for key, series in other.values.items():
            for labels, value in series.items():
                self.add(key, value, labels)
        for key, hists in other.hists.items():
            for labels, hist in hists.items():
                self.add_hist(key, hist, labels)

    def get(self, key: str, labels: Labels = ()) -> float:
        """A value (0 when absent); histograms: their count."""
        if key in self.hists:
            hist = self.hists[key].get(labels)
            return hist.count if hist is not None else 0
        return self.values.get(key, {}).get(labels, 0)

    def flat(self) -> dict[str, float]:
        """``{"key{a,b}": value}`` for printing (histograms as their count and sum)."""
        out: dict[str, float] = {}
        for key, series in self.values.items():
            for labels, value in series.items():
                out[_flat_name(key, labels)] = value
        for key, hists in self.hists.items():
            for labels, hist in hists.items():
                out[_flat_name(key, labels) + "_count"] = hist.count
                out[_flat_name(key, labels) + "_sum"] = hist.sum
        return out


def _flat_name(key: str, labels: Labels) -> str:
    return f"{key}{{{','.join(labels)}}}" if labels else key


# -- tier labels ------------------------------------------------------------------------


def tier_labels(
    secondary_media: Sequence[str], secondary_names: Sequence[str] | None = None
) -> dict[str, str]:
    """Medium -> tier label: the host tier ``0:primary``, secondary ``i`` (1-based, in
    configuration order) ``i:<name>`` (its type name, else its medium in lower case)."""
    labels = {MEDIUM_CPU: PRIMARY_TIER}
    for i, medium in enumerate(secondary_media, 1):
        name = secondary_names[i - 1] if secondary_names and i - 1 < len(secondary_names) else medium.lower()
        labels[medium] = f"{i}:{name}"
    return labels


def manager_tiers(manager: Any) -> list[Any]:
    """The tiers of a manager, the primary first (a tiered manager's, or itself)."""
    primary = getattr(manager, "primary", None)
    if primary is None:
        return [manager]
    return [primary, *manager.secondaries]


# -- readers ----------------------------------------------------------------------------


def read_scheduler(samples: Samples, scheduler: Any, labels: Mapping[str, str]) -> None:
    """``scheduler``: an ``OffloadingScheduler``; ``labels``: medium -> tier label."""
    for name, value in scheduler.stats.as_dict().items():
        key = f"scheduler_{name}"
        if key in METRICS:
            samples.add(key, value)
    by_source = scheduler.tokens_by_source
    try:
        items = list(by_source.items())
    except RuntimeError:  # a medium's first load, on the scheduler thread, meanwhile
        items = list(by_source.items())
    for medium, tokens in items:
        samples.add("hit_tokens", tokens, (labels.get(medium, UNKNOWN_TIER),))


def read_sessions(samples: Samples, sessions: Any, directives: Any = None) -> None:
    """``sessions``: a ``SessionRegistry`` (or None); ``directives``: a ``DirectiveReader``
    (or None)."""
    if sessions is not None:
        for name, value in sessions.stats().as_dict().items():
            key = f"session_{name}"
            if key in METRICS:
                samples.add(key, value)
    if directives is not None:
        counts = directives.counts
        for outcome in DIRECTIVE_OUTCOMES:
            samples.add("session_directives", getattr(counts, outcome), (outcome,))


def read_manager(samples: Samples, manager: Any, labels: Mapping[str, str]) -> None:
    for tier in manager_tiers(manager):
        label = (labels.get(tier.medium, tier.medium.lower()),)
        stats = tier.stats()
        samples.add("lookups", stats.hits + stats.misses, label)
        samples.add("lookup_hits", stats.hits, label)
        samples.add("evictions", stats.evictions, label)
        samples.add("capacity_blocks", stats.capacity, label)
        samples.add("blocks", stats.in_flight, (*label, "in_flight"))
        samples.add("blocks", stats.pinned, (*label, "pinned"))
        samples.add("blocks", stats.idle, (*label, "idle"))
        if tier.medium == MEDIUM_CPU and stats.capacity:
            samples.add("cpu_cache_usage_perc", stats.in_use / stats.capacity)
            samples.add("cpu_cache_write_usage_perc", stats.in_flight / stats.capacity)
            samples.add("cpu_cache_read_usage_perc", stats.pinned / stats.capacity)
        read_counters(samples, tier, label[0], "manager")


def read_counters(samples: Samples, component: Any, tier: str, side: str) -> None:
    """A component's own ``counters()`` (a ``Counters``), if it has them."""
    counters = getattr(component, "counters", None)
    if counters is None:
        return
    for name, value in counters().as_dict().items():
        samples.add("tier_counter", value, (tier, side, name))


def read_publisher(samples: Samples, publisher: Any) -> None:
    for name, value in publisher.stats().as_dict().items():
        if name in PUBLISHER_FIELDS:
            samples.add(PUBLISHER_FIELDS[name], value)


def read_subscriber(samples: Samples, subscriber: Any) -> None:
    for name, value in subscriber.stats().as_dict().items():
        if name in SUBSCRIBER_FIELDS:
            samples.add(SUBSCRIBER_FIELDS[name], value)


# -- transfers --------------------------------------------------------------------------

LOAD, STORE = "load", "store"


def route_tier(src: str, dst: str, labels: Mapping[str, str]) -> tuple[str, str]:
    """(tier label, direction) of a job from medium ``src`` to ``dst``: device<->host jobs
    belong to the primary tier (``load`` = to the device), host<->secondary jobs to that
    secondary (``load`` = promotion into host memory, ``store`` = write-through)."""
    if MEDIUM_DEVICE in (src, dst):
        return PRIMARY_TIER, LOAD if dst == MEDIUM_DEVICE else STORE
    if dst == MEDIUM_CPU:
        return labels.get(src, src.lower()), LOAD
    return labels.get(dst, dst.lower()), STORE


class TransferMeter:
    """Counts finished transfer jobs; thread-safe (scrapes read while the worker counts)."""

    def __init__(self, labels: Mapping[str, str] | None = None) -> None:
        self.labels = dict(labels or {MEDIUM_CPU: PRIMARY_TIER})
        self._lock = threading.Lock()
        self._samples = Samples()
        self._in_flight: dict[tuple[str, str], int] = {}
        self._pending: dict[tuple[str, Labels], list[float]] = {}  # observations not taken
        # Bumped by every ``started`` and ``finished``: a reader that saw the same value
        # before and after has nothing new to read.
        self.changes = 0

    def started(self, src: str, dst: str) -> None:
        key = route_tier(src, dst, self.labels)
        with self._lock:
            self._in_flight[key] = self._in_flight.get(key, 0) + 1
            self.changes += 1

    def finished(self, src: str, dst: str, success: bool, nbytes: int, seconds: float, blocks: int) -> None:
        """One job's outcome (``started`` must have been called for it)."""
        tier, direction = route_tier(src, dst, self.labels)
        with self._lock:
            self.changes += 1
            self._in_flight[(tier, direction)] = max(0, self._in_flight.get((tier, direction), 0) - 1)
            s = self._samples
            s.add("transfer_jobs", 1, (tier, direction, "ok" if success else "failed"))
            primary = tier == PRIMARY_TIER
            if not success:
                if not primary:
                    s.add(
                        f"tiering_{'promotion' if direction == LOAD else 'cascade'}_job_failures", 1, (tier,)
                    )
                return
            s.add("transfer_blocks", blocks, (tier, direction))
            s.add("transfer_bytes", nbytes, (tier, direction))
            self._observe("transfer_seconds", seconds, (tier, direction))
            if primary:
                s.add(f"{direction}_bytes", nbytes)
                s.add(f"{direction}_time", seconds)
                self._observe(f"{direction}_size", nbytes, ())
            else:
                verb = "read" if direction == LOAD else "write"
                s.add(f"tiering_{verb}_bytes", nbytes, (tier,))
                s.add(f"tiering_{verb}_time", seconds, (tier,))

    def _observe(self, key: str, value: float, labels: Labels) -> None:
        series = self._samples.hists.setdefault(key, {})
        hist = series.get(labels)
        if hist is None:
            hist = series[labels] = Hist(METRICS[key].buckets or ())
        hist.observe(value)
        self._pending.setdefault((key, labels), []).append(value)

    def read(self, samples: Samples) -> None:
        """Add the cumulative values (and the jobs in flight now) to ``samples``."""
        with self._lock:
            samples.merge(self._samples)
            for (tier, direction), count in self._in_flight.items():
                samples.add("transfer_jobs_in_flight", count, (tier, direction))

    def take_observations(self) -> dict[tuple[str, Labels], list[float]]:
        """Histogram observations since the last call."""
        with self._lock:
            pending, self._pending = self._pending, {}
        return pending


# -- sources (``kvoffload.metrics.register``) -------------------------------------------


class SchedulerSource:
    """An ``OffloadingScheduler``, its session controls and its manager's tiers;
    ``labels``: medium -> tier."""

    def __init__(
        self,
        scheduler: Any,
        labels: Mapping[str, str],
        config_info: Sequence[str] | None = None,
        directives: Any = None,
    ) -> None:
        """``config_info``: the values of ``CONFIG_INFO_LABELS`` (the host tier's static
        configuration), reported as one ``config_info`` series; none without it.
        ``directives``: the ``DirectiveReader`` of the engine's requests, if any."""
        self.scheduler = scheduler
        self.labels = dict(labels)
        self.config_info = tuple(config_info) if config_info is not None else None
        self.directives = directives

    def read_metrics(self, samples: Samples) -> None:
        read_scheduler(samples, self.scheduler, self.labels)
        read_sessions(samples, getattr(self.scheduler, "sessions", None), self.directives)
        read_manager(samples, self.scheduler.manager, self.labels)
        if self.config_info is not None:
            samples.add("config_info", 1, self.config_info)


class WorkerSource:
    """A ``TransferMeter`` and the workers whose own ``counters()`` belong to a tier
    (``workers``: ``(tier label, worker)``)."""

    def __init__(self, meter: TransferMeter, workers: Sequence[tuple[str, Any]] = ()) -> None:
        self.meter = meter
        self.workers = list(workers)

    def read_metrics(self, samples: Samples) -> None:
        self.meter.read(samples)
        for tier, worker in self.workers:
            read_counters(samples, worker, tier, "worker")


class TierSource:
    """A manager's tiers alone (no scheduler), e.g. the tier a trace replay drives."""

    def __init__(self, manager: Any, labels: Mapping[str, str] | None = None) -> None:
        self.manager = manager
        self.labels = dict(labels or tier_labels([]))

    def read_metrics(self, samples: Samples) -> None:
        read_manager(samples, self.manager, self.labels)


class PublisherSource:
    def __init__(self, publisher: Any) -> None:
        self.publisher = publisher

    def read_metrics(self, samples: Samples) -> None:
        read_publisher(samples, self.publisher)


class SubscriberSource:
    def __init__(self, subscriber: Any) -> None:
        self.subscriber = subscriber

    def read_metrics(self, samples: Samples) -> None:
        read_subscriber(samples, self.subscriber)
