"""Prometheus metrics of every kvoffload component, in one place.

Components keep their own counters (``kvoffload.counters``); this package reads them when
scraped, so counting costs the hot path nothing beyond what it did already. The one
addition on the worker side is ``TransferMeter``: a few dict updates per finished
transfer job. Modules: ``names`` (every metric once), ``samples`` (readers, the meter,
sources), ``exporter`` (collector, registry, ``serve``).

Outside vLLM: ``register(source)`` a source (``SchedulerSource``, ``WorkerSource``,
``PublisherSource``, ``SubscriberSource``, or anything with ``read_metrics(samples)``),
then ``serve(port, host="127.0.0.1")`` serves ``/metrics`` from kvoffload's own
``REGISTRY``. The vLLM connector registers its two halves itself, so an engine in this
process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) is served too.

Inside vLLM the same values reach vLLM's own ``/metrics`` through the connector stats
path of vLLM 0.32 (``kvoffload.integrations.vllm.stats``): each side's
``get_kv_connector_stats`` sends what changed since its last report, vLLM aggregates the
workers' and the scheduler's, and the connector's ``build_prom_metrics`` records them in
vLLM's registry with vLLM's ``model_name`` and ``engine`` labels. There every name
without a vLLM counterpart carries vLLM's prefix: ``vllm:kvoffload_<key>``. Tokens
loaded are also reported per source through ``get_external_cache_hit_sources``, so
``vllm:prompt_tokens_cached_by_source_total`` counts them as ``host`` (loaded from host
memory), ``disk`` (promoted from the disk tier for that load) or
``external_unspecified`` (promoted from the shared Redis tier: vLLM 0.32 has no source for
a shared remote store, and uses that one for them).

Mapping. Tier labels are vLLM's: ``0:primary`` (host memory), ``1:fs``, ``2:redis`` (the
index and type of each secondary tier). Counters are exported with ``_total``.

============================================  ==========================================
kvoffload quantity                            exported as
============================================  ==========================================
host->device bytes / copy seconds / bytes     ``vllm:kv_offload_load_bytes``,
per job (histogram)                           ``vllm:kv_offload_load_time``,
                                              ``vllm:kv_offload_load_size``
device->host, the same                        ``vllm:kv_offload_store_bytes``, ``_time``,
                                              ``_size``
secondary->host (promotion) bytes, seconds    ``vllm:kv_offload_tiering_read_bytes{tier}``,
                                              ``vllm:kv_offload_tiering_read_time{tier}``
host->secondary (write-through)               ``vllm:kv_offload_tiering_write_bytes{tier}``,
                                              ``..._write_time{tier}``
failed promotions / write-throughs            ``vllm:kv_offload_tiering_promotion_job_failures``,
                                              ``..._cascade_job_failures`` (``{tier}``)
blocks held back by ``store_threshold``       ``vllm:kv_offload_stores_skipped``
host blocks in use by transfers / being       ``vllm:kv_offload_cpu_cache_usage_perc``,
written / pinned by loads, as fractions       ``..._write_usage_perc``, ``..._read_usage_perc``
jobs by tier, direction, outcome              ``kvoffload_transfer_jobs{tier,direction,outcome}``
blocks, bytes moved; seconds per job          ``kvoffload_transfer_blocks``, ``_bytes``,
(histogram); jobs in flight                   ``_seconds``, ``_jobs_in_flight``
                                              (``{tier,direction}``)
lookups, hits, evictions per tier             ``kvoffload_lookups``, ``kvoffload_lookup_hits``,
                                              ``kvoffload_evictions`` (``{tier}``)
tokens loaded into the device, by source      ``kvoffload_hit_tokens{tier}``
blocks by state, capacity                     ``kvoffload_blocks{tier,state}``,
                                              ``kvoffload_capacity_blocks{tier}``
the host tier's configuration (1, facts in    ``vllm:kv_offload_config_info`` (vLLM 0.34's,
labels: slots, engine blocks per slot,        ``{cpu_num_chunks,cpu_blocks_per_chunk,``
bytes, tokens of max_model_len requests)      ``cpu_kv_cache_size_bytes,_tokens}``)
a tier's own counters (corrupt blocks,        ``kvoffload_tier_counter{tier,side,counter}``
outages, probes, ...)
scheduler: tokens loaded, loads planned,      ``kvoffload_scheduler_<field>``
failed loads and their (recomputed) tokens,   (``SchedulerStats`` fields)
blocks loaded/stored, failed stores, ...
session controls: retains, blocks retained,   ``kvoffload_session_<field>``
trimmed, absent, releases, prefetches, ...    (``SessionStats`` fields)
requests' session directives read, by         ``kvoffload_session_directives{outcome}``
outcome (applied, unknown, invalid)
publisher: published, sent, dropped,          ``kvoffload_events_<...>``
replayed, buffered, ...
subscriber: delivered, gap batches repaired   ``kvoffload_subscriber_<...>``
by replay, lost, malformed, restarts, ...
============================================  ==========================================

Not mapped, on purpose: vLLM's ``kv_offload_tiering_chunk_queries``/``chunk_hits``
count each key once per request; kvoffload's tiers count every HIT/MISS answer (a key
asked again in a later step counts again), so they are ``kvoffload_lookups`` and
``kvoffload_lookup_hits``. ``kv_offload_allocation_failure`` counts refused store
attempts; the scheduler counts refused blocks. vLLM's lookup-delay histograms have no
counterpart (a kvoffload lookup is a dict probe; the shared tier's background lookups
show in its ``probes`` and ``probe_timeouts`` counters). vLLM's deprecated
``kv_offload_total_bytes``/``_total_time``/``_size`` are not exported.
"""

from kvoffload._lazy import lazy_exports

_EXPORTS = {
    "METRICS": "kvoffload.metrics.names",
    "Metric": "kvoffload.metrics.names",
    "exported_name": "kvoffload.metrics.names",
    "Samples": "kvoffload.metrics.samples",
    "TransferMeter": "kvoffload.metrics.samples",
    "SchedulerSource": "kvoffload.metrics.samples",
    "WorkerSource": "kvoffload.metrics.samples",
    "PublisherSource": "kvoffload.metrics.samples",
    "SubscriberSource": "kvoffload.metrics.samples",
    "tier_labels": "kvoffload.metrics.samples",
    "REGISTRY": "kvoffload.metrics.exporter",
    "KVOffloadCollector": "kvoffload.metrics.exporter",
    "collect_samples": "kvoffload.metrics.exporter",
    "register": "kvoffload.metrics.exporter",
    "unregister": "kvoffload.metrics.exporter",
    "serve": "kvoffload.metrics.exporter",
    "exposition_lines": "kvoffload.metrics.exporter",
    "TierSource": "kvoffload.metrics.samples",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
