"""The SGLang backend's Prometheus metrics: its tiers, their jobs, its events.

``StorageMetrics`` registers one source with ``kvoffload.metrics`` (read at scrape time):
per tier (labelled ``1:fs``, ``2:redis``, ... in configuration order) the lookups and
hits, evictions, capacity and blocks by state, the tier's own counters (corrupt blocks,
probes, outages, ...) and its transfer jobs (``meter``: loads into and stores from
SGLang's host pool); the backend's page counters (``tier_counter{tier="sglang"}``:
pages asked, loaded, stored, declined, failed, and ``errors``: calls answered as misses
after an exception); the event publisher's counters. With a
port, it also serves them over HTTP on 127.0.0.1 (``serve``; port 0 picks a free one,
logged).
"""

from __future__ import annotations

import logging
from typing import Any

from kvoffload.metrics import exporter
from kvoffload.metrics.samples import (
    Samples,
    TransferMeter,
    read_counters,
    read_manager,
    read_publisher,
    tier_labels,
)

logger = logging.getLogger(__name__)


class StorageMetrics:
    def __init__(self) -> None:
        self.meter = TransferMeter()
        self.server: Any = None
        self._tiers: Any = None
        self._publisher: Any = None
        self._labels: dict[str, str] = {}
        self._errors: Any = None

    def attach(self, tiers: Any, errors: Any = None, port: int | None = None) -> None:
        """Read ``tiers`` (a ``PageTiers``) and ``errors()`` (the backend's count of calls
        answered as misses after an exception) from now on; serve on ``port`` if given."""
        self._tiers = tiers
        self._errors = errors
        self._labels = tier_labels([m.medium for m in tiers.managers], tiers.names)
        self.meter.labels.update(self._labels)
        exporter.register(self)
        if port is not None:
            self.server = exporter.serve(port)
            logger.info("kvoffload metrics on http://127.0.0.1:%d/metrics", self.server.server_port)

    def add_publisher(self, publisher: Any) -> None:
        self._publisher = publisher

    def read_metrics(self, samples: Samples) -> None:
        tiers = self._tiers
        if tiers is None:
            return
        for manager, worker in zip(tiers.managers, tiers.workers):
            read_manager(samples, manager, self._labels)  # (its stats are ints: read without a lock)
            read_counters(samples, worker, self._labels.get(manager.medium, manager.medium.lower()), "worker")
        read_counters(samples, tiers, "sglang", "storage")
        if self._errors is not None:
            samples.add("tier_counter", self._errors(), ("sglang", "storage", "errors"))
        self.meter.read(samples)
        if self._publisher is not None:
            read_publisher(samples, self._publisher)

    def close(self) -> None:
        exporter.unregister(self)
        if self.server is not None:
            self.server.shutdown()
            self.server = None
