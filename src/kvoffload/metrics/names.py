"""Every metric kvoffload exports, once: kind, help, labels, buckets and its names.

A metric has a ``key`` and, where vLLM 0.32 exports a metric of the same meaning, that
metric's name (``vllm``). ``exported_name(metric, inside_vllm)`` is the name it carries:
vLLM's where there is one, else ``kvoffload_<key>`` (``vllm:kvoffload_<key>`` inside
vLLM, whose metrics all carry the ``vllm:`` prefix and whose test set-up unregisters
collectors by that prefix). Counter names are given without ``_total``: the exposition
adds it. The mapping table is in ``kvoffload.metrics``'s docstring.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from kvoffload.scheduler.sessions import SessionStats
from kvoffload.scheduler.state import SchedulerStats

COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"

TIER, DIRECTION, OUTCOME, STATE, SIDE, NAME = "tier", "direction", "outcome", "state", "side", "counter"
# vLLM 0.34's label names for its info metric (vllm:kv_offload_config_info)
CONFIG_INFO_LABELS = (
    "cpu_num_chunks",
    "cpu_blocks_per_chunk",
    "cpu_kv_cache_size_bytes",
    "cpu_kv_cache_size_tokens",
)
PRIMARY_TIER = "0:primary"  # vLLM 0.32's label for the primary (host) tier; secondaries "i:type"
UNKNOWN_TIER = "unknown"

# Bytes per transfer job: 64 KiB to 1 GiB by powers of four.
SIZE_BUCKETS = tuple(float(1 << n) for n in range(16, 31, 2))
# Seconds per transfer job, 50 us to 10 s.
SECONDS_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 10.0)


@dataclass(frozen=True)
class Metric:
    key: str
    kind: str
    help: str
    labels: tuple[str, ...] = ()
    vllm: str | None = None  # vLLM 0.32's name for the same quantity
    buckets: tuple[float, ...] | None = None


def exported_name(metric: Metric, inside_vllm: bool = False) -> str:
    if metric.vllm is not None:
        return metric.vllm
    return f"{'vllm:' if inside_vllm else ''}kvoffload_{metric.key}"


_TD = (TIER, DIRECTION)
_DEFS = [
    # -- transfers (worker side, from each job's TransferResult) ---------------------------
    Metric("load_bytes", COUNTER, "Bytes loaded from host memory into the device KV cache",
           vllm="vllm:kv_offload_load_bytes"),
    Metric("load_time", COUNTER, "Seconds spent copying loads from host memory to the device",
           vllm="vllm:kv_offload_load_time"),
    Metric("load_size", HISTOGRAM, "Bytes per load job (host to device)",
           vllm="vllm:kv_offload_load_size", buckets=SIZE_BUCKETS),
    Metric("store_bytes", COUNTER, "Bytes stored from the device KV cache into host memory",
           vllm="vllm:kv_offload_store_bytes"),
    Metric("store_time", COUNTER, "Seconds spent copying stores from the device to host memory",
           vllm="vllm:kv_offload_store_time"),
    Metric("store_size", HISTOGRAM, "Bytes per store job (device to host)",
           vllm="vllm:kv_offload_store_size", buckets=SIZE_BUCKETS),
    Metric("tiering_read_bytes", COUNTER, "Bytes promoted from a secondary tier into host memory",
           (TIER,), vllm="vllm:kv_offload_tiering_read_bytes"),
    Metric("tiering_read_time", COUNTER, "Seconds spent promoting from a secondary tier",
           (TIER,), vllm="vllm:kv_offload_tiering_read_time"),
    Metric("tiering_write_bytes", COUNTER, "Bytes written through from host memory to a secondary tier",
           (TIER,), vllm="vllm:kv_offload_tiering_write_bytes"),
    Metric("tiering_write_time", COUNTER, "Seconds spent writing through to a secondary tier",
           (TIER,), vllm="vllm:kv_offload_tiering_write_time"),
    Metric("tiering_promotion_job_failures", COUNTER, "Failed promotion jobs from a secondary tier",
           (TIER,), vllm="vllm:kv_offload_tiering_promotion_job_failures"),
    Metric("tiering_cascade_job_failures", COUNTER, "Failed write-through jobs to a secondary tier",
           (TIER,), vllm="vllm:kv_offload_tiering_cascade_job_failures"),
    Metric("transfer_jobs", COUNTER, "Transfer jobs finished, by tier, direction and outcome",
           (TIER, DIRECTION, OUTCOME)),
    Metric("transfer_blocks", COUNTER, "Offloaded blocks moved by successful jobs", _TD),
    Metric("transfer_bytes", COUNTER, "Bytes moved by successful jobs", _TD),
    Metric("transfer_seconds", HISTOGRAM, "Seconds per successful job, copying", _TD,
           buckets=SECONDS_BUCKETS),
    Metric("transfer_jobs_in_flight", GAUGE, "Transfer jobs submitted and not finished", _TD),
    # -- tiers (scheduler side, from each tier's stats) ------------------------------------
    Metric("lookups", COUNTER, "Block lookups answered HIT or MISS", (TIER,)),
    Metric("lookup_hits", COUNTER, "Block lookups answered HIT", (TIER,)),
    Metric("hit_tokens", COUNTER, "Tokens of loads handed to the engine, by the tier they were found in "
           "(failed loads included, as in scheduler_failed_load_tokens)", (TIER,)),
    Metric("evictions", COUNTER, "Blocks evicted", (TIER,)),
    Metric("blocks", GAUGE, "Blocks held, by state (in_flight: being written, pinned: being read, idle)",
           (TIER, STATE)),
    Metric("capacity_blocks", GAUGE, "Blocks the tier can hold", (TIER,)),
    Metric("config_info", GAUGE, "The host tier's static configuration in its labels (always 1): "
           "block slots, engine blocks per slot, bytes, and KV tokens of max_model_len requests it holds",
           CONFIG_INFO_LABELS, vllm="vllm:kv_offload_config_info"),
    Metric("cpu_cache_usage_perc", GAUGE, "Fraction of host blocks in use by transfers (written or read)",
           vllm="vllm:kv_offload_cpu_cache_usage_perc"),
    Metric("cpu_cache_write_usage_perc", GAUGE, "Fraction of host blocks being written",
           vllm="vllm:kv_offload_cpu_cache_write_usage_perc"),
    Metric("cpu_cache_read_usage_perc", GAUGE, "Fraction of host blocks pinned by loads",
           vllm="vllm:kv_offload_cpu_cache_read_usage_perc"),
    Metric("tier_counter", COUNTER, "A tier's own counters (disk, shared tier), by name",
           (TIER, SIDE, NAME)),
    # -- events: kvoffload's own publisher and subscriber (outside vLLM) -------------------
    Metric("events_published", COUNTER, "Event batches published"),
    Metric("events_sent", COUNTER, "Event batches handed to the PUB socket"),
    Metric("events_dropped", COUNTER, "Event batch sends dropped (queue full; still replayable)"),
    Metric("events_replayed", COUNTER, "Event batches sent in replay replies"),
    Metric("events_replay_requests", COUNTER, "Replay requests served"),
    Metric("events_malformed_requests", COUNTER, "Malformed replay requests"),
    Metric("events_encode_errors", COUNTER, "Event batches that could not be encoded"),
    Metric("events_buffered", GAUGE, "Event batches in the replay buffer"),
    Metric("subscriber_batches", COUNTER, "Event batches delivered (live and replayed)"),
    Metric("subscriber_batches_live", COUNTER, "Event batches delivered live"),
    Metric("subscriber_batches_replayed", COUNTER, "Event batches of gaps repaired by replay"),
    Metric("subscriber_batches_lost", COUNTER, "Event batches lost beyond repair"),
    Metric("subscriber_malformed", COUNTER, "Messages skipped as malformed"),
    Metric("subscriber_duplicates", COUNTER, "Event batches already delivered, skipped"),
    Metric("subscriber_restarts", COUNTER, "Publisher restarts seen"),
    Metric("subscriber_replay_requests", COUNTER, "Replay requests sent"),
    Metric("subscriber_replay_timeouts", COUNTER, "Replay requests unanswered in time"),
]  # fmt: skip

# The scheduler's counters, one metric each; vLLM has one of the same meaning.
_SCHEDULER_VLLM = {"skipped_stores": "vllm:kv_offload_stores_skipped"}
_SCHEDULER_HELP = {
    "tokens_loaded": "Tokens handed to the engine by load jobs",
    "loads_planned": "Load jobs planned",
    "blocks_loaded": "Blocks of successful load jobs",
    "blocks_stored": "Blocks of successful store jobs",
    "failed_loads": "Failed load jobs (the engine recomputes their tokens)",
    "failed_load_tokens": "Tokens of failed loads, recomputed by the engine",
    "failed_stores": "Failed store jobs",
    "failed_tier_transfers": "Failed copies between tiers",
    "skipped_stores": "Blocks held back by the reuse filter (store_threshold)",
}
SCHEDULER_FIELDS = [f.name for f in fields(SchedulerStats)]
_DEFS += [
    Metric(
        f"scheduler_{name}",
        COUNTER,
        _SCHEDULER_HELP.get(name, f"Scheduler counter {name}"),
        vllm=_SCHEDULER_VLLM.get(name),
    )
    for name in SCHEDULER_FIELDS
]

# The session controls' counters (``SessionRegistry.stats()``), one metric each.
_SESSION_HELP = {
    "retains": "Session retentions asked (by a request's directives or a control)",
    "retained": "Blocks retained by session retentions, summed over tiers",
    "trimmed": "Blocks of session retentions trimmed over a tier's retention budget (retention_fraction)",
    "absent": "Blocks of session retentions a tier did not hold (or a tenant did not produce)",
    "releases": "Session releases asked",
    "released": "Blocks released by session releases, summed over tiers",
    "prefetches": "Session prefetches asked",
    "prefetched": "Blocks queued for promotion into the CPU tier by session prefetches",
    "expired": "Retentions of a block in a tier that reached their deadline",
    "tenant_refusals": "Keys a session control named that its tenant did not produce (refused)",
    "sessions_forgotten": "Sessions whose last keys were forgotten (past max_sessions)",
}
SESSION_FIELDS = [f.name for f in fields(SessionStats)]
_DEFS += [
    Metric(f"session_{name}", COUNTER, _SESSION_HELP.get(name, f"Session counter {name}"))
    for name in SESSION_FIELDS
]
# Requests' directives read (``kvoffload.directives.DirectiveCounts``), by outcome.
DIRECTIVE_OUTCOMES = ("applied", "unknown", "invalid")
_DEFS.append(
    Metric("session_directives", COUNTER, "Session directives read from requests (kvoffload's kv_hints "
           "actions and kv_transfer_params sets) by outcome: applied, unknown (ignored), invalid (warned, "
           "no effect)", (OUTCOME,))
)  # fmt: skip

METRICS: dict[str, Metric] = {metric.key: metric for metric in _DEFS}

PUBLISHER_FIELDS = {
    "published": "events_published",
    "sent": "events_sent",
    "dropped_sends": "events_dropped",
    "replayed": "events_replayed",
    "replay_requests": "events_replay_requests",
    "malformed_requests": "events_malformed_requests",
    "encode_errors": "events_encode_errors",
    "buffered": "events_buffered",
}
SUBSCRIBER_FIELDS = {
    "decoded": "subscriber_batches",
    "live": "subscriber_batches_live",
    "replayed": "subscriber_batches_replayed",
    "lost": "subscriber_batches_lost",
    "malformed": "subscriber_malformed",
    "duplicates": "subscriber_duplicates",
    "restarts": "subscriber_restarts",
    "replay_requests": "subscriber_replay_requests",
    "replay_timeouts": "subscriber_replay_timeouts",
}
