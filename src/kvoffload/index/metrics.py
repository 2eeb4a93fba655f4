"""Prometheus metrics of the index service, in a registry of their own.

Contract: ``IndexMetrics(service)`` owns a ``CollectorRegistry`` (several servers in one
process never collide) with:

* ``kvoffload_index_events_total{type, status}``: wire events by type (``BlockStored``,
  ``BlockRemoved``, ``AllBlocksCleared``) and status (``applied``, ``unknown_tier``,
  ``bad_block_size``, ``bad_hash``);
* ``kvoffload_index_block_hashes_total{op}``: hashes announced stored, holds ended by
  removals, removals of hashes not held;
* per source (labels ``model``, ``tenant``, ``instance_id``, ``dp_rank``):
  ``kvoffload_index_batches_total``, ``..._gaps_total``, ``..._gaps_repaired_total``,
  ``..._batches_lost_total``, ``..._publisher_restarts_total``,
  ``..._sources_degraded_total`` (times the source became DEGRADED),
  ``..._malformed_messages_total``, ``..._batches_replayed_total``,
  ``kvoffload_index_blocks{..., tier}`` (blocks held now) and
  ``kvoffload_index_source_state{..., state}`` (1 for the current state);
* ``kvoffload_index_sources{state}``, ``kvoffload_index_entries`` (distinct hashes);
* ``kvoffload_index_query_seconds{endpoint}``: request latency, observed by the server.

Counters are read from the index's and sources' own counters at scrape time: ingestion
pays nothing for metrics.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvoffload.index.service import IndexService
from kvoffload.index.state import SourceState
from kvoffload.index.tiers import TIER_NAMES

_EVENT_FIELDS = {
    ("BlockStored", "applied"): "stored_applied",
    ("BlockStored", "unknown_tier"): "stored_unknown_tier",
    ("BlockStored", "bad_block_size"): "stored_bad_block_size",
    ("BlockStored", "bad_hash"): "stored_bad_hash",
    ("BlockRemoved", "applied"): "removed_applied",
    ("BlockRemoved", "unknown_tier"): "removed_unknown_tier",
    ("BlockRemoved", "bad_hash"): "removed_bad_hash",
    ("AllBlocksCleared", "applied"): "cleared_applied",
}
_SOURCE_COUNTERS = {
    "batches": ("batches", "Batches applied"),
    "gaps": ("gaps", "Deliveries preceded by missing batches"),
    "gaps_repaired": ("gaps_repaired", "Gaps filled completely by replay"),
    "batches_lost": ("lost", "Batches lost beyond repair"),
    "publisher_restarts": ("restarts", "Publisher restarts (entries dropped)"),
    "sources_degraded": ("degraded", "Times the source became DEGRADED"),
}
_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1, 0.5, 2.5)


class _Collector(Collector):
    def __init__(self, service: IndexService) -> None:
        self._service = service

    def collect(self) -> Iterator:
        index = self._service.index
        stats = index.stats().as_dict()
        events = CounterMetricFamily(
            "kvoffload_index_events", "KV events by type and status", labels=["type", "status"]
        )
        for (kind, status), name in _EVENT_FIELDS.items():
            events.add_metric([kind, status], stats[name])
        yield events
        hashes = CounterMetricFamily(
            "kvoffload_index_block_hashes", "Block hashes by operation", labels=["op"]
        )
        hashes.add_metric(["stored"], stats["stored_hashes"])
        hashes.add_metric(["removed"], stats["removed_hashes"])
        hashes.add_metric(["removed_unknown"], stats["removed_unknown"])
        yield hashes

        labels = ["model", "tenant", "instance_id", "dp_rank"]
        counters = {
            key: CounterMetricFamily(f"kvoffload_index_{key}", help_text, labels=labels)
            for key, (_, help_text) in _SOURCE_COUNTERS.items()
        }
        malformed = CounterMetricFamily(
            "kvoffload_index_malformed_messages", "Messages that were not event batches", labels=labels
        )
        replayed = CounterMetricFamily(
            "kvoffload_index_batches_replayed", "Batches received by replay", labels=labels
        )
        blocks = GaugeMetricFamily("kvoffload_index_blocks", "Blocks held now", labels=[*labels, "tier"])
        state = GaugeMetricFamily(
            "kvoffload_index_source_state", "1 for the source's state", labels=[*labels, "state"]
        )
        by_state = dict.fromkeys(SourceState, 0)
        for reg, source in self._service.sources():
            values = [reg.model_name, reg.tenant_id, str(reg.instance_id), str(reg.dp_rank)]
            own = source.stats().as_dict()
            for key, (field, _) in _SOURCE_COUNTERS.items():
                counters[key].add_metric(values, own[field])
            sub = source.subscriber_stats()
            malformed.add_metric(values, sub["malformed"])
            replayed.add_metric(values, sub["replayed"])
            for tier, name in enumerate(TIER_NAMES):
                blocks.add_metric([*values, name], source.engine.blocks[tier])
            current = source.state
            by_state[current] += 1
            for option in SourceState:
                state.add_metric([*values, option.value], 1.0 if option is current else 0.0)
        yield from counters.values()
        yield from (malformed, replayed, blocks, state)
        sources = GaugeMetricFamily("kvoffload_index_sources", "Sources by state", labels=["state"])
        for option, count in by_state.items():
            sources.add_metric([option.value], count)
        yield sources
        yield GaugeMetricFamily(
            "kvoffload_index_entries", "Distinct indexed block hashes", value=index.sizes()["entries"]
        )


class IndexMetrics:
    def __init__(self, service: IndexService) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_Collector(service))
        self.query_seconds = Histogram(
            "kvoffload_index_query_seconds",
            "Time to answer an index request",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
