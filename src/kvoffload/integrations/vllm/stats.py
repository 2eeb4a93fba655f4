"""kvoffload's metrics on vLLM 0.32's connector stats path.

vLLM asks each side of a connector, every engine step, for the stats collected since the
last call (``get_kv_connector_stats``): the workers' reach the scheduler process with the
model runner's output and are aggregated across workers, then with the scheduler side's,
and the front end records them (``build_prom_metrics``) in vLLM's own registry, so they
appear on vLLM's ``/metrics``.

* ``KVOffloadConnectorStats``: the payload. ``data`` = ``{"counter": {key: {labels:
  increment}}, "gauge": {key: {labels: value}}, "histogram": {key: {labels:
  [observations]}}}`` with metric keys of ``kvoffload.metrics.names`` and label values
  joined by ``\\x1f`` (plain strings survive vLLM's serialization between processes).
  ``aggregate`` adds increments, keeps the newer gauge value and joins observations.
* ``SchedulerMetrics`` / ``WorkerMetrics``: each side's source (registered with
  ``kvoffload.metrics`` too, so an in-process engine can also be served by
  ``kvoffload.metrics.serve``) and its ``take_stats()``: counters as increments since
  the last report, gauges when they changed, histogram observations not yet sent;
  ``None`` when nothing changed. vLLM asks every step, so the worker side does not even
  read its sources while no job started or finished (and no tier's worker keeps counters
  of its own): a step that moved nothing costs a comparison.
* ``KVOffloadPromMetrics``: vLLM's ``KVConnectorPromMetrics`` for those payloads; every
  metric of ``kvoffload.metrics.names`` the engine feeds, named as
  ``exported_name(metric, inside_vllm=True)``, with vLLM's labels first.
* ``CACHE_HIT_SOURCES``: the medium a load's tokens came from -> vLLM 0.32's
  ``CacheHitSource`` value.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from prometheus_client import Gauge
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvoffload import metrics as kvmetrics
from kvoffload.metrics.names import COUNTER, GAUGE, HISTOGRAM, METRICS, exported_name
from kvoffload.metrics.samples import (
    Samples,
    SchedulerSource,
    TransferMeter,
    WorkerSource,
    manager_tiers,
    tier_labels,
)
from kvoffload.specs import MEDIUM_CPU, MEDIUM_DEVICE, MEDIUM_DISK

_SEP = "\x1f"
STALE_S = 1.0  # the longest the scheduler side's metrics go unread while nothing of it ran

CACHE_HIT_SOURCES = {MEDIUM_CPU: CacheHitSource.HOST, MEDIUM_DISK: CacheHitSource.DISK}


def cache_hit_sources(tokens_by_medium: dict[str, int]) -> dict[CacheHitSource, int]:
    """vLLM's sources for tokens by medium; the shared tier and unknown ranges are
    ``external_unspecified`` (vLLM 0.32 has no source for a shared remote store)."""
    out: dict[CacheHitSource, int] = {}
    for medium, tokens in tokens_by_medium.items():
        if tokens > 0:
            source = CACHE_HIT_SOURCES.get(medium, CacheHitSource.EXTERNAL_UNSPECIFIED)
            out[source] = out.get(source, 0) + tokens
    return out


@dataclass
class KVOffloadConnectorStats(KVConnectorStats):
    def __post_init__(self) -> None:
        for kind in (COUNTER, GAUGE, HISTOGRAM):
            self.data.setdefault(kind, {})

    def reset(self) -> None:
        self.data = {COUNTER: {}, GAUGE: {}, HISTOGRAM: {}}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, series in other.data.get(COUNTER, {}).items():
            mine = self.data[COUNTER].setdefault(key, {})
            for labels, value in series.items():
                mine[labels] = mine.get(labels, 0) + value
        for key, series in other.data.get(GAUGE, {}).items():
            self.data[GAUGE].setdefault(key, {}).update(series)
        for key, series in other.data.get(HISTOGRAM, {}).items():
            mine = self.data[HISTOGRAM].setdefault(key, {})
            for labels, values in series.items():
                mine.setdefault(labels, []).extend(values)
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {}
        for kind in (COUNTER, GAUGE):
            for key, series in self.data[kind].items():
                for labels, value in series.items():
                    out[_flat(key, labels)] = value
        for key, series in self.data[HISTOGRAM].items():
            for labels, values in series.items():
                out[_flat(key, labels) + "_count"] = len(values)
                out[_flat(key, labels) + "_sum"] = sum(values)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.get(kind) for kind in (COUNTER, GAUGE, HISTOGRAM))


def _flat(key: str, labels: str) -> str:
    return f"{key}{{{labels.replace(_SEP, ',')}}}" if labels else key


class _Delta:
    """Increments of cumulative samples since the last ``take``."""

    def __init__(self) -> None:
        self._last: dict[tuple[str, str], float] = {}
        self._joined: dict[tuple[str, ...], str] = {}

    def take(self, samples: Samples, observations: dict | None = None) -> KVOffloadConnectorStats | None:
        stats = KVOffloadConnectorStats()
        joins = self._joined
        for key, series in samples.values.items():
            kind = METRICS[key].kind
            for labels, value in series.items():
                joined = joins.get(labels)
                if joined is None:
                    joined = joins[labels] = _SEP.join(labels)
                last = self._last.get((key, joined))
                if kind == COUNTER and value != (last or 0):
                    stats.data[COUNTER].setdefault(key, {})[joined] = value - (last or 0)
                elif kind == GAUGE and value != last:
                    stats.data[GAUGE].setdefault(key, {})[joined] = value
                self._last[(key, joined)] = value
        for (key, labels), values in (observations or {}).items():
            stats.data[HISTOGRAM].setdefault(key, {})[_SEP.join(labels)] = list(values)
        return None if stats.is_empty() else stats


class SchedulerMetrics:
    """The scheduler side's metrics: its scheduler, its session controls (and the
    ``directives`` reader of its requests' session fields), every tier of its manager."""

    def __init__(
        self, scheduler: Any, secondary_names: list[str], config_info: Any = None, directives: Any = None
    ) -> None:
        media = [tier.medium for tier in manager_tiers(scheduler.manager)[1:]]
        self.labels = tier_labels(media, secondary_names)
        self.source = SchedulerSource(scheduler, self.labels, config_info, directives)
        self._delta = _Delta()
        self._seen: int | None = None
        self._read_at = 0.0
        kvmetrics.register(self.source)

    def take_stats(self, changes: int | None = None) -> KVOffloadConnectorStats | None:
        """``changes``: the scheduler side's count of calls that may have changed a counter;
        while it stands still the read is skipped (most engine steps), except once every
        ``STALE_S`` for what the tiers' own threads change (a Redis tier's lookups)."""
        now = time.monotonic()
        if changes is not None and changes == self._seen and now - self._read_at < STALE_S:
            return None
        self._seen, self._read_at = changes, now
        samples = Samples()
        self.source.read_metrics(samples)
        return self._delta.take(samples)

    def close(self) -> None:
        kvmetrics.unregister(self.source)


class WorkerMetrics:
    """The worker side's metrics: every transfer job's outcome, the tiers' workers' own
    counters. ``attach`` once the worker exists."""

    def __init__(self) -> None:
        self.meter = TransferMeter()
        self.source = WorkerSource(self.meter)
        self._delta = _Delta()
        self._seen = -1  # meter.changes at the last read
        self._own_counters = False  # a tier's worker with counters(): always read
        kvmetrics.register(self.source)

    def attach(self, worker: Any, secondary_names: list[str]) -> None:
        workers = _router_workers(worker)
        media = []
        for mover in workers:
            media += sorted({m for route in mover.routes for m in route} - {MEDIUM_CPU, MEDIUM_DEVICE})
        self.meter.labels = tier_labels(media, secondary_names)
        self.source.workers = [(self.meter.labels[m], w) for w, m in _movers_by_medium(workers)]
        self._own_counters = any(hasattr(w, "counters") for _, w in self.source.workers)

    def started(self, job: Any) -> None:
        self.meter.started(job.src_spec.medium, job.dst_spec.medium)

    def finished(self, job: Any, success: bool, result: Any = None) -> None:
        src, dst = job.src_spec, job.dst_spec
        host = src if src.medium == MEDIUM_CPU else dst
        nbytes = result.bytes if result is not None else 0
        seconds = result.seconds if result is not None else 0.0
        self.meter.finished(src.medium, dst.medium, success, nbytes, seconds, len(host.block_ids))

    def take_stats(self) -> KVOffloadConnectorStats | None:
        changes = self.meter.changes  # before the read: a job finishing meanwhile is read again
        if changes == self._seen and not self._own_counters:
            return None
        self._seen = changes
        samples = Samples()
        self.source.read_metrics(samples)
        return self._delta.take(samples, self.meter.take_observations())

    def close(self) -> None:
        kvmetrics.unregister(self.source)


def _router_workers(worker: Any) -> list[Any]:
    """The movers behind a ``WorkerRouter`` (also when wrapped, e.g. by fault injection)."""
    while not hasattr(worker, "workers") and hasattr(worker, "inner"):
        worker = worker.inner
    return list(getattr(worker, "workers", [worker]))


def _movers_by_medium(workers: list[Any]) -> list[tuple[Any, str]]:
    out = []
    for mover in workers:
        media = {m for route in mover.routes for m in route} - {MEDIUM_DEVICE}
        if media == {MEDIUM_CPU}:
            out.append((mover, MEDIUM_CPU))
        else:
            out += [(mover, m) for m in sorted(media - {MEDIUM_CPU})]
    return out


class KVOffloadPromMetrics(KVConnectorPromMetrics):
    def __init__(
        self, vllm_config: Any, metric_types: dict, labelnames: list[str], per_engine_labelvalues: dict
    ):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._metrics: dict[str, Any] = {}
        self._children: dict[tuple[str, int, str], Any] = {}
        for key, metric in METRICS.items():
            if key.startswith(("events_", "subscriber_")):
                continue  # kvoffload's own event transport: not used inside vLLM
            kwargs: dict[str, Any] = {
                "name": exported_name(metric, inside_vllm=True),
                "documentation": metric.help,
                "labelnames": [*labelnames, *metric.labels],
            }
            if metric.kind == COUNTER:
                cls = self._counter_cls
            elif metric.kind == GAUGE:
                cls = self._gauge_cls
                if isinstance(cls, type) and issubclass(cls, Gauge):
                    kwargs["multiprocess_mode"] = "mostrecent"
            else:
                cls = self._histogram_cls
                kwargs["buckets"] = metric.buckets
            self._metrics[key] = cls(**kwargs)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        children = self._children
        for kind in (COUNTER, GAUGE, HISTOGRAM):
            for key, series in transfer_stats_data.get(kind, {}).items():
                metric = self._metrics.get(key)
                if metric is None:
                    continue
                for labels, value in series.items():
                    # a labelled child looked up once (prometheus_client's lookup takes a
                    # lock and builds tuples: most of this call's time on every step)
                    child = children.get((key, engine_idx, labels))
                    if child is None:
                        engine = [str(v) for v in self.per_engine_labelvalues[engine_idx]]
                        child = metric.labels(*engine, *(labels.split(_SEP) if labels else ()))
                        children[key, engine_idx, labels] = child
                    if kind == COUNTER:
                        child.inc(value)
                    elif kind == GAUGE:
                        child.set(value)
                    else:
                        for observation in value:
                            child.observe(observation)
