"""``kvoffload.metrics``: components' counters read at scrape time and served over HTTP on
loopback; the transfer meter; tokens by source; the load source of promoted blocks."""

from __future__ import annotations

import gc
import urllib.request

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from kvoffload import metrics
from kvoffload.cpu import CPUOffloadingManager
from kvoffload.keys import make_offload_key
from kvoffload.metrics.samples import Samples, SchedulerSource, TransferMeter, WorkerSource, tier_labels
from kvoffload.scheduler import KVGroup, OffloadingScheduler, StepRequest
from kvoffload.scheduler.sources import tokens_by_source
from kvoffload.tiers.tiered import TieredOffloadingManager
from scheduler_requests import Req
from shelf_tier import Shelf


def scrape(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(values: dict, name: str, **labels) -> float | None:
    return values.get((name, tuple(sorted(labels.items()))))


@pytest.fixture
def server():
    # A scrape reads every registered source: sources other test modules left alive (not
    # yet collected) must not add to what these tests count.
    gc.collect()
    from kvoffload.metrics import exporter

    for source in exporter.registered():
        exporter.unregister(source)
    server = metrics.serve(0)
    yield server
    server.shutdown()


def prefill(sched, req, block_ids, success=True):
    n = sched.match(req, 0)
    sched.on_allocated(req.request_id, block_ids, n)
    plan = sched.build_step([StepRequest(req.request_id, None, req.num_prompt_tokens)])
    sched.complete_jobs(
        [(job.job_id, success if not job.is_store else True) for job in plan.loads + plan.stores]
    )
    return n


def test_scheduler_and_tier_counters_are_scraped_over_http(server):
    manager = CPUOffloadingManager(16, "lru")
    sched = OffloadingScheduler(manager, (KVGroup(4),), hash_block_size=4)
    source = SchedulerSource(sched, tier_labels([]))
    metrics.register(source)
    try:
        tokens = list(range(10))  # 2 full blocks of 4
        assert prefill(sched, Req("a", tokens), [[1, 2, 3]]) == 0
        assert prefill(sched, Req("b", tokens), [[4, 5, 6]]) == 8
        assert prefill(sched, Req("c", tokens), [[7, 8, 9]], success=False) == 8  # a failed load
        got = scrape(server.server_port)
        primary = {"tier": "0:primary"}
        assert value(got, "kvoffload_scheduler_tokens_loaded_total") == 16
        assert value(got, "kvoffload_scheduler_loads_planned_total") == 2
        assert value(got, "kvoffload_scheduler_blocks_loaded_total") == 2
        assert value(got, "kvoffload_scheduler_failed_loads_total") == 1
        assert value(got, "kvoffload_scheduler_failed_load_tokens_total") == 8
        assert value(got, "kvoffload_scheduler_blocks_stored_total") == 2
        assert value(got, "kvoffload_hit_tokens_total", **primary) == 16
        stats = manager.stats()
        assert value(got, "kvoffload_lookups_total", **primary) == stats.hits + stats.misses > 0
        assert value(got, "kvoffload_lookup_hits_total", **primary) == stats.hits == 4
        assert value(got, "kvoffload_blocks", **primary, state="idle") == 2
        assert value(got, "kvoffload_blocks", **primary, state="pinned") == 0
        assert value(got, "kvoffload_capacity_blocks", **primary) == 16
        assert value(got, "vllm:kv_offload_cpu_cache_usage_perc") == 0
        assert value(got, "vllm:kv_offload_stores_skipped_total") == 0
    finally:
        metrics.unregister(source)
    gone = scrape(server.server_port)
    assert value(gone, "kvoffload_scheduler_tokens_loaded_total") is None


def test_a_planned_load_pins_blocks_and_a_cancelled_one_is_not_counted(server):
    manager = CPUOffloadingManager(16, "lru")
    sched = OffloadingScheduler(manager, (KVGroup(4),), hash_block_size=4)
    source = SchedulerSource(sched, tier_labels([]))
    metrics.register(source)
    try:
        tokens = list(range(10))
        prefill(sched, Req("a", tokens), [[1, 2, 3]])
        req = Req("b", tokens)
        sched.on_allocated("b", [[4, 5, 6]], sched.match(req, 0))
        got = scrape(server.server_port)
        assert value(got, "kvoffload_blocks", tier="0:primary", state="pinned") == 2
        assert value(got, "vllm:kv_offload_cpu_cache_read_usage_perc") == 2 / 16
        assert value(got, "kvoffload_hit_tokens_total", tier="0:primary") == 8
        sched.request_finished("b")  # before the step: the load never runs
        got = scrape(server.server_port)
        assert value(got, "kvoffload_hit_tokens_total", tier="0:primary") == 0
        assert value(got, "kvoffload_scheduler_loads_planned_total") == 0
        assert value(got, "kvoffload_blocks", tier="0:primary", state="pinned") == 0
    finally:
        metrics.unregister(source)


def test_transfer_meter_counts_bytes_seconds_and_failures_per_tier_and_direction(server):
    meter = TransferMeter(tier_labels(["DISK"], ["fs"]))
    source = WorkerSource(meter)
    metrics.register(source)
    try:
        meter.started("GPU", "CPU")
        meter.finished("GPU", "CPU", True, 3 << 20, 0.002, 3)
        meter.started("CPU", "GPU")
        meter.finished("CPU", "GPU", True, 1 << 20, 0.001, 1)
        meter.started("CPU", "GPU")
        meter.finished("CPU", "GPU", False, 0, 0.0, 1)
        meter.started("CPU", "DISK")
        meter.finished("CPU", "DISK", False, 0, 0.0, 2)
        meter.started("DISK", "CPU")
        meter.finished("DISK", "CPU", True, 2 << 20, 0.01, 2)
        meter.started("DISK", "CPU")  # still running
        got = scrape(server.server_port)
        assert value(got, "vllm:kv_offload_store_bytes_total") == 3 << 20
        assert value(got, "vllm:kv_offload_store_time_total") == 0.002
        assert value(got, "vllm:kv_offload_load_bytes_total") == 1 << 20
        assert value(got, "vllm:kv_offload_load_size_count") == 1
        assert value(got, "vllm:kv_offload_load_size_bucket", le="1048576.0") == 1
        assert value(got, "vllm:kv_offload_load_size_bucket", le="262144.0") == 0
        assert value(got, "vllm:kv_offload_tiering_read_bytes_total", tier="1:fs") == 2 << 20
        assert value(got, "vllm:kv_offload_tiering_read_time_total", tier="1:fs") == 0.01
        assert value(got, "vllm:kv_offload_tiering_cascade_job_failures_total", tier="1:fs") == 1
        assert value(got, "vllm:kv_offload_tiering_promotion_job_failures_total", tier="1:fs") is None
        primary_load = {"tier": "0:primary", "direction": "load"}
        assert value(got, "kvoffload_transfer_jobs_total", **primary_load, outcome="ok") == 1
        assert value(got, "kvoffload_transfer_jobs_total", **primary_load, outcome="failed") == 1
        assert value(got, "kvoffload_transfer_blocks_total", tier="0:primary", direction="store") == 3
        assert value(got, "kvoffload_transfer_blocks_total", tier="1:fs", direction="load") == 2
        assert value(got, "kvoffload_transfer_seconds_count", tier="1:fs", direction="load") == 1
        assert value(got, "kvoffload_transfer_seconds_sum", tier="1:fs", direction="load") == 0.01
        assert value(got, "kvoffload_transfer_jobs_in_flight", tier="1:fs", direction="load") == 1
        assert value(got, "kvoffload_transfer_jobs_in_flight", **primary_load) == 0
        # the histogram observations are handed out once, for per-interval reports
        taken = meter.take_observations()
        assert taken[("load_size", ())] == [1 << 20]
        assert meter.take_observations() == {}
    finally:
        metrics.unregister(source)


def test_sources_add_up_and_a_dropped_source_stops_counting():
    a, b = TransferMeter(), TransferMeter()
    for meter in (a, b):
        meter.started("GPU", "CPU")
        meter.finished("GPU", "CPU", True, 100, 0.1, 1)
    sa, sb = WorkerSource(a), WorkerSource(b)
    samples = metrics.collect_samples([sa, sb])
    assert samples.get("store_bytes") == 200
    assert samples.get("store_size") == 2
    metrics.register(sb)
    del sb  # held by weak reference only
    assert metrics.collect_samples().get("store_bytes") == 0


def test_tokens_by_source_counts_the_outermost_tier_and_unknown_gaps():
    # two groups: 32-token blocks (host, then disk) and 16-token blocks (all host)
    spans = [(0, 32, "CPU"), (32, 64, "DISK"), *((i, i + 16, "CPU") for i in range(0, 64, 16))]
    assert tokens_by_source(spans, 0, 64) == {"CPU": 32, "DISK": 32}
    assert tokens_by_source([(0, 32, "CPU"), (32, 64, "REMOTE")], 16, 80) == {"CPU": 16, "REMOTE": 32, "": 16}
    assert tokens_by_source([], 5, 9) == {"": 4}
    assert sum(tokens_by_source([(0, 8, "SHELF"), (4, 12, "CPU")], 0, 12).values()) == 12


def test_a_block_promoted_for_a_load_names_its_tier_once():
    primary = CPUOffloadingManager(4, "lru")
    shelf = Shelf(8, "lru")
    tiered = TieredOffloadingManager(primary, [shelf])
    key = make_offload_key(b"\x01" * 32, 0)
    out = tiered.prepare_store([key])
    tiered.complete_store(out.keys_to_store)
    for transfer in tiered.take_transfers():  # write-through
        tiered.complete_transfer(transfer.token, True)
    assert tiered.load_source(key) == "CPU"
    primary.reset()  # only the shelf has it now
    tiered.lookup(key)
    for transfer in tiered.take_transfers():  # promotion
        tiered.complete_transfer(transfer.token, True)
    assert tiered.lookup(key).name == "HIT"
    assert tiered.load_source(key) == "SHELF"
    assert tiered.load_source(key) == "CPU"  # the next load finds it in host memory


def test_flat_samples_for_printing():
    samples = Samples()
    samples.add("lookups", 3, ("0:primary",))
    samples.add("lookups", 2, ("0:primary",))
    assert samples.flat() == {"lookups{0:primary}": 5}


def test_the_metrics_package_loads_neither_torch_nor_zmq():
    from import_probe import imported_top_level_modules

    loaded = imported_top_level_modules(
        "import kvoffload.metrics as m; m.serve; m.SchedulerSource; m.TransferMeter; m.METRICS"
    )
    assert "kvoffload" in loaded and "prometheus_client" in loaded
    assert not loaded & {"torch", "zmq"}


@given(
    st.lists(st.tuples(st.integers(0, 200), st.integers(0, 80)), max_size=12),
    st.integers(0, 150),
    st.integers(0, 150),
    st.sampled_from(["CPU", "DISK", "REMOTE", "GPU"]),
)
def test_tokens_by_source_of_one_medium_equals_the_general_sweep(spans, start, length, medium):
    ranges = [(lo, lo + width, medium) for lo, width in spans]
    end = start + length
    swept = tokens_by_source([*ranges, (0, 0, "CPU" if medium != "CPU" else "DISK")], start, end)
    assert tokens_by_source(ranges, start, end) == swept
    assert sum(swept.values()) == length


def test_counters_as_dict_is_a_fresh_flat_copy_of_every_field():
    import dataclasses

    from kvoffload.counters import Counters
    from kvoffload.scheduler.state import SchedulerStats

    stats = SchedulerStats()
    for i, field in enumerate(dataclasses.fields(stats)):
        setattr(stats, field.name, i + 1)
    flat = stats.as_dict()
    assert flat == dataclasses.asdict(stats) and list(flat) == [f.name for f in dataclasses.fields(stats)]
    stats.loads_planned += 100
    assert flat["loads_planned"] != stats.loads_planned  # later counting does not change it
    assert Counters().as_dict() == {}
