"""Metrics of a real engine run, scraped over HTTP on loopback and checked against what the
run did: kvoffload's own endpoint (``kvoffload.metrics.serve``, reading the in-process
connector's halves) and vLLM's registry fed through the connector stats path, including
``vllm:prompt_tokens_cached_by_source_total{source="host"}``."""

import urllib.request

import pytest

pytest.importorskip("vllm")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from kvoffload.demo.offline import (  # noqa: E402
    close_llm,
    kv_block_bytes,
    make_llm,
    scheduler_connector,
    settle,
    word_text,
)
from vllm_reference import want  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

PROMPT = 2000  # tokens: 62 full blocks of 32 are offloaded
BLOCKS = 62
OFFLOADED = BLOCKS * 32
SCRAPED = want(word_text(7, PROMPT), word_text(8, PROMPT))


@pytest.fixture(scope="module")
def model(tiny_llama: str) -> str:
    return tiny_llama


def generate(llm, texts):
    from vllm import SamplingParams

    outs = llm.generate(texts, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    return [(list(out.outputs[0].token_ids), out.num_cached_tokens) for out in outs]


def scrape(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(
                sorted((k, v) for k, v in sample.labels.items() if k not in ("model_name", "engine"))
            )
            values[(sample.name, labels)] = sample.value
    return values


def value(values, name, **labels):
    return values.get((name, tuple(sorted(labels.items()))), 0.0)


def test_scraped_metrics_match_the_run(model, reference):
    import prometheus_client

    from kvoffload import metrics

    first, second = SCRAPED
    expected = [reference[text] for text in SCRAPED]  # an engine without kvoffload

    block_bytes = kv_block_bytes(model)
    llm = make_llm(model, kvoffload={"cpu_bytes_to_use": 400 * block_bytes})
    ours = metrics.serve(0)
    vllms, _ = prometheus_client.start_http_server(0, addr="127.0.0.1")  # vLLM's registry
    try:
        outs = [generate(llm, [text])[0] for text in (first, second)]
        assert [cached for _, cached in outs] == [0, 0]
        settle(llm)
        assert llm.reset_prefix_cache()  # the device forgets: the next run is served from kvoffload
        again = generate(llm, [first, second])
        settle(llm)
        assert [tokens for tokens, _ in again] == expected
        served = sum(cached for _, cached in again)  # nothing is in vLLM's own cache any more
        assert served == 2 * OFFLOADED

        got = scrape(ours.server_port)
        stats = scheduler_connector(llm).offload_stats()
        primary = {"tier": "0:primary"}
        load = {**primary, "direction": "load"}
        store = {**primary, "direction": "store"}
        assert value(got, "kvoffload_hit_tokens_total", **primary) == served
        assert value(got, "kvoffload_scheduler_tokens_loaded_total") == served == stats.tokens_loaded
        assert value(got, "kvoffload_transfer_blocks_total", **load) == 2 * BLOCKS == stats.blocks_loaded
        assert value(got, "kvoffload_transfer_blocks_total", **store) == 2 * BLOCKS == stats.blocks_stored
        assert value(got, "vllm:kv_offload_load_bytes_total") == 2 * BLOCKS * block_bytes
        assert value(got, "vllm:kv_offload_store_bytes_total") == 2 * BLOCKS * block_bytes
        assert value(got, "kvoffload_transfer_bytes_total", **load) == 2 * BLOCKS * block_bytes
        loads = value(got, "kvoffload_scheduler_loads_planned_total")
        assert loads >= 1
        assert value(got, "kvoffload_transfer_jobs_total", **load, outcome="ok") == loads
        assert value(got, "kvoffload_transfer_jobs_total", **load, outcome="failed") == 0
        assert value(got, "vllm:kv_offload_load_size_count") == loads
        assert value(got, "vllm:kv_offload_load_size_sum") == 2 * BLOCKS * block_bytes
        assert value(got, "kvoffload_transfer_seconds_count", **load) == loads
        assert value(got, "vllm:kv_offload_load_time_total") > 0
        assert value(got, "kvoffload_lookup_hits_total", **primary) >= 2 * BLOCKS
        assert value(got, "kvoffload_blocks", **primary, state="idle") == 2 * BLOCKS
        assert value(got, "kvoffload_capacity_blocks", **primary) == 400
        assert value(got, "kvoffload_transfer_jobs_in_flight", **load) == 0
        assert value(got, "vllm:kv_offload_cpu_cache_usage_perc") == 0
        # vLLM 0.34's info metric: 400 slots of one engine block; a 4,096-token request
        # (max_model_len) needs 128 of them, so 3 such requests fit
        info = {
            "cpu_num_chunks": "400",
            "cpu_blocks_per_chunk": "1",
            "cpu_kv_cache_size_bytes": str(400 * block_bytes),
            "cpu_kv_cache_size_tokens": str(3 * 4096),
        }
        assert value(got, "vllm:kv_offload_config_info", **info) == 1

        # vLLM's own registry, fed by the connector stats path
        seen = scrape(vllms.server_port)
        assert value(seen, "vllm:prompt_tokens_cached_by_source_total", source="host") == served
        assert value(seen, "vllm:prompt_tokens_cached_by_source_total", source="external_unspecified") == 0
        assert value(seen, "vllm:kv_offload_load_bytes_total") == 2 * BLOCKS * block_bytes
        assert value(seen, "vllm:kv_offload_store_bytes_total") == 2 * BLOCKS * block_bytes
        assert value(seen, "vllm:kvoffload_hit_tokens_total", **primary) == served
        assert value(seen, "vllm:kvoffload_transfer_blocks_total", **load) == 2 * BLOCKS
        assert value(seen, "vllm:kvoffload_scheduler_loads_planned_total") == loads
        assert value(seen, "vllm:kv_offload_load_size_count") == loads
        assert value(seen, "vllm:kvoffload_blocks", **primary, state="idle") == 2 * BLOCKS
        assert value(seen, "vllm:kv_offload_config_info", **info) == 1
    finally:
        ours.shutdown()
        vllms.shutdown()
        close_llm(llm)


def test_connector_stats_are_increments_that_aggregate_and_reach_prometheus():
    import functools
    from types import SimpleNamespace

    import msgspec
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from kvoffload.integrations.vllm.stats import KVOffloadConnectorStats, KVOffloadPromMetrics, WorkerMetrics

    registry = CollectorRegistry()

    def bound(cls):  # vLLM passes its metric classes; these register in a registry of our own
        return functools.partial(cls, registry=registry)

    types = {Counter: bound(Counter), Gauge: bound(Gauge), Histogram: bound(Histogram)}
    prom = KVOffloadPromMetrics(
        SimpleNamespace(kv_transfer_config=None), types, ["model_name", "engine"], {0: ["m", "0"]}
    )
    engine = {"model_name": "m", "engine": "0"}
    workers = [WorkerMetrics(), WorkerMetrics()]  # two tensor-parallel ranks
    try:
        for worker, nbytes in zip(workers, (100, 50)):
            worker.meter.started("GPU", "CPU")
            worker.meter.finished("GPU", "CPU", True, nbytes, 0.5, 1)
        stats = workers[0].take_stats().aggregate(workers[1].take_stats())
        # what vLLM sends between processes
        data = msgspec.msgpack.decode(msgspec.msgpack.encode(stats.to_dict()))
        assert KVOffloadConnectorStats(data=data).reduce()["store_bytes"] == 150
        prom.observe(data, 0)
        assert registry.get_sample_value("vllm:kv_offload_store_bytes_total", engine) == 150
        assert registry.get_sample_value("vllm:kv_offload_store_size_count", engine) == 2
        labels = {**engine, "tier": "0:primary", "direction": "store"}
        assert registry.get_sample_value("vllm:kvoffload_transfer_blocks_total", labels) == 2
        assert registry.get_sample_value("vllm:kvoffload_transfer_jobs_in_flight", labels) == 0
        assert workers[0].take_stats() is None  # nothing new
        workers[0].meter.started("GPU", "CPU")
        workers[0].meter.finished("GPU", "CPU", True, 7, 0.1, 1)
        prom.observe(workers[0].take_stats().to_dict(), 0)
        assert registry.get_sample_value("vllm:kv_offload_store_bytes_total", engine) == 157
        assert KVOffloadConnectorStats().is_empty()
    finally:
        for worker in workers:
            worker.close()


def test_a_step_that_moved_nothing_reads_no_worker_metrics_and_waits_for_no_transfer_thread():
    # vLLM asks the worker side for stats every engine step. A step in which no job started
    # or finished answers at once: it does not wait on the meter's lock, which the transfer
    # threads take as jobs finish (held here, as by a thread recording a job).
    import threading

    from kvoffload.integrations.vllm.stats import WorkerMetrics

    worker = WorkerMetrics()
    try:
        worker.meter.started("GPU", "CPU")
        worker.meter.finished("GPU", "CPU", True, 64, 0.01, 1)
        assert worker.take_stats().reduce()["store_bytes"] == 64
        answers = []
        with worker.meter._lock:
            step = threading.Thread(target=lambda: answers.append(worker.take_stats()), daemon=True)
            step.start()
            step.join(5)
            assert answers == [None], "the step waited for a transfer thread"
        worker.meter.started("GPU", "CPU")  # a job between two steps is reported, once
        assert worker.take_stats() is not None
        worker.meter.finished("GPU", "CPU", True, 8, 0.01, 1)
        assert worker.take_stats().reduce()["store_bytes"] == 8
        assert worker.take_stats() is None
    finally:
        worker.close()


def test_tokens_promoted_from_disk_count_as_disk_in_vllm_and_per_tier(model, tmp_path):
    import prometheus_client

    from kvoffload import metrics

    first, second = word_text(41, PROMPT), word_text(42, PROMPT)
    block_bytes = kv_block_bytes(model)
    extra = {
        "cpu_bytes_to_use": 70 * block_bytes,  # the second prompt evicts most of the first from host memory
        "secondary_tiers": [
            {"type": "fs", "root_dir": str(tmp_path), "bytes_to_use": 400 * (block_bytes + 4096)}
        ],
    }
    llm = make_llm(model, kvoffload=extra)
    ours = metrics.serve(0)
    vllms, _ = prometheus_client.start_http_server(0, addr="127.0.0.1")
    try:
        generate(llm, [first])
        settle(llm)
        generate(llm, [second])
        for _ in range(3):
            settle(llm)  # the write-through of both prompts
        assert llm.reset_prefix_cache()
        ((_, served),) = generate(llm, [first])
        settle(llm)
        assert served == OFFLOADED

        got = scrape(ours.server_port)
        seen = scrape(vllms.server_port)
        disk, host = {"tier": "1:fs"}, {"tier": "0:primary"}
        from_disk = value(got, "kvoffload_hit_tokens_total", **disk)
        from_host = value(got, "kvoffload_hit_tokens_total", **host)
        assert from_disk > 0 and from_disk + from_host == served
        assert value(seen, "vllm:prompt_tokens_cached_by_source_total", source="disk") == from_disk
        assert value(seen, "vllm:prompt_tokens_cached_by_source_total", source="host") == from_host
        assert value(seen, "vllm:kvoffload_hit_tokens_total", **disk) == from_disk
        # every block promoted from disk was promoted for this load, and written through before
        promoted = value(got, "kvoffload_transfer_blocks_total", **disk, direction="load")
        assert promoted == from_disk // 32
        assert value(got, "kvoffload_transfer_blocks_total", **disk, direction="store") == 2 * BLOCKS
        read = value(got, "kvoffload_tier_counter_total", **disk, side="worker", counter="bytes_read")
        assert read > 0 and value(got, "vllm:kv_offload_tiering_read_bytes_total", **disk) == read
        assert value(seen, "vllm:kv_offload_tiering_read_bytes_total", **disk) == read
        written = value(got, "kvoffload_tier_counter_total", **disk, side="worker", counter="bytes_written")
        assert value(got, "vllm:kv_offload_tiering_write_bytes_total", **disk) == written > 0
        disk_stats = scheduler_connector(llm)._scheduler.manager.tier_stats()[1]
        assert value(got, "kvoffload_capacity_blocks", **disk) == disk_stats.capacity > 0
        assert value(got, "kvoffload_blocks", **disk, state="idle") == 2 * BLOCKS
        assert value(got, "kvoffload_lookup_hits_total", **disk) >= promoted
        assert value(got, "kvoffload_evictions_total", **host) > 0
        assert value(got, "vllm:kv_offload_tiering_promotion_job_failures_total", **disk) == 0
    finally:
        ours.shutdown()
        vllms.shutdown()
        close_llm(llm)


def test_a_failed_load_is_counted_as_recomputed_and_not_as_served(model):
    import prometheus_client

    from kvoffload import metrics

    first, second = word_text(21, PROMPT), word_text(22, PROMPT)
    block_bytes = kv_block_bytes(model)
    extra = {"cpu_bytes_to_use": 400 * block_bytes, "fault_injection": {"fail_loads": [0]}}
    llm = make_llm(model, kvoffload=extra)
    ours = metrics.serve(0)
    vllms, _ = prometheus_client.start_http_server(0, addr="127.0.0.1")
    try:
        generate(llm, [first])
        generate(llm, [second])
        settle(llm)
        assert llm.reset_prefix_cache()
        generate(llm, [first])  # its load fails (injected): the engine recomputes it
        settle(llm)
        generate(llm, [second])  # served
        settle(llm)
        got = scrape(ours.server_port)
        load = {"tier": "0:primary", "direction": "load"}
        assert value(got, "kvoffload_transfer_jobs_total", **load, outcome="failed") == 1
        assert value(got, "kvoffload_transfer_jobs_total", **load, outcome="ok") == 1
        assert value(got, "kvoffload_scheduler_failed_loads_total") == 1
        assert value(got, "kvoffload_scheduler_failed_load_tokens_total") == OFFLOADED
        # hit tokens count every load handed out, as vLLM counts cached tokens at admission
        assert value(got, "kvoffload_hit_tokens_total", tier="0:primary") == 2 * OFFLOADED
        assert value(got, "kvoffload_transfer_blocks_total", **load) == BLOCKS  # the good load only
        assert value(got, "vllm:kv_offload_load_bytes_total") == BLOCKS * block_bytes
        seen = scrape(vllms.server_port)
        assert value(seen, "vllm:kvoffload_scheduler_failed_load_tokens_total") == OFFLOADED
        assert value(seen, "vllm:kvoffload_transfer_jobs_total", **load, outcome="failed") == 1
    finally:
        ours.shutdown()
        vllms.shutdown()
        close_llm(llm)


def test_cache_hit_sources_map_media_to_vllm_sources():
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    from kvoffload.integrations.vllm.stats import cache_hit_sources

    got = cache_hit_sources({"CPU": 64, "DISK": 32, "REMOTE": 16, "": 8, "SHELF": 0})
    assert got == {CacheHitSource.HOST: 64, CacheHitSource.DISK: 32, CacheHitSource.EXTERNAL_UNSPECIFIED: 24}
