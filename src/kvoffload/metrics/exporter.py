"""The Prometheus side: a collector over registered sources, a registry, a server.

A *source* is any object with ``read_metrics(samples)`` that adds its current values to a
``Samples`` (``kvoffload.metrics.samples``). ``register(source)`` adds it to the
process-wide list, held by weak reference (a source that is gone stops counting);
``unregister`` removes it. ``KVOffloadCollector`` reads every source at scrape time and
yields one metric family per metric that has values (several sources' values add up).
``REGISTRY`` is a ``CollectorRegistry`` of kvoffload's own, with that collector;
``serve(port, host="127.0.0.1")`` serves it over HTTP (``start_http_server``) and
returns the server (``server.shutdown()`` stops it); port 0 picks a free port
(``server.server_port``).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable, Iterator
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from kvoffload.metrics.names import COUNTER, GAUGE, METRICS, exported_name
from kvoffload.metrics.samples import Samples


class MetricSource(Protocol):
    def read_metrics(self, samples: Samples) -> None: ...


_lock = threading.Lock()
_sources: list[weakref.ref] = []


def register(source: MetricSource) -> None:
    with _lock:
        _sources[:] = [ref for ref in _sources if ref() is not None and ref() is not source]
        _sources.append(weakref.ref(source))


def unregister(source: MetricSource) -> None:
    with _lock:
        _sources[:] = [ref for ref in _sources if ref() is not None and ref() is not source]


def registered() -> list[MetricSource]:
    with _lock:
        return [source for ref in _sources if (source := ref()) is not None]


def collect_samples(sources: Iterable[MetricSource] | None = None) -> Samples:
    """Every source's values now (the registered ones by default)."""
    samples = Samples()
    for source in registered() if sources is None else sources:
        source.read_metrics(samples)
    return samples


def families(samples: Samples, inside_vllm: bool = False) -> Iterator[Metric]:
    """Prometheus metric families of ``samples``, in ``METRICS`` order."""
    for key, metric in METRICS.items():
        name = exported_name(metric, inside_vllm)
        labels = list(metric.labels)
        if key in samples.hists:
            family = HistogramMetricFamily(name, metric.help, labels=labels)
            for values, hist in samples.hists[key].items():
                buckets, total = [], 0
                for bound, count in zip((*hist.bounds, float("inf")), hist.counts):
                    total += count
                    buckets.append((_le(bound), total))
                family.add_metric(list(values), buckets, hist.sum)
            yield family
        elif key in samples.values:
            cls = CounterMetricFamily if metric.kind == COUNTER else GaugeMetricFamily
            assert metric.kind in (COUNTER, GAUGE)
            family = cls(name, metric.help, labels=labels)
            for values, value in samples.values[key].items():
                family.add_metric(list(values), value)
            yield family


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(float(bound))


class KVOffloadCollector(Collector):
    """Reads ``sources`` (default: the registered ones) at every scrape."""

    def __init__(self, sources: Iterable[MetricSource] | None = None) -> None:
        self._sources = None if sources is None else list(sources)

    def collect(self) -> Iterator[Metric]:
        yield from families(collect_samples(self._sources))


REGISTRY = CollectorRegistry(auto_describe=False)
REGISTRY.register(KVOffloadCollector())


def serve(port: int, host: str = "127.0.0.1", registry: CollectorRegistry = REGISTRY) -> Any:
    """Serve ``registry`` on ``http://host:port/metrics`` from a daemon thread."""
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return server


def exposition_lines(sources: Iterable[MetricSource]) -> list[str]:
    """The samples ``/metrics`` would serve for ``sources``, one ``name{labels} value``
    line each (what the command-line tools print)."""
    from prometheus_client import generate_latest

    registry = CollectorRegistry(auto_describe=False)
    registry.register(KVOffloadCollector(sources))
    text = generate_latest(registry).decode()
    return [line for line in text.splitlines() if line and not line.startswith("#")]
