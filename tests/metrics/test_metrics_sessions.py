"""Session controls' counts in the metrics: ``SessionRegistry.stats()`` and a
``DirectiveReader``'s counts by outcome, read at scrape time from a scheduler over a CPU
tier and a secondary, served over HTTP on loopback after real calls."""

from __future__ import annotations

import gc
import urllib.request
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvoffload import metrics
from kvoffload.cpu import CPUOffloadingManager
from kvoffload.directives import DirectiveReader
from kvoffload.metrics.names import METRICS, SESSION_FIELDS
from kvoffload.metrics.samples import SchedulerSource, tier_labels
from kvoffload.scheduler import KVGroup, OffloadingScheduler, StepRequest
from kvoffload.scheduler.sessions import SessionRegistry
from kvoffload.sessions import SessionId
from kvoffload.tiers.tiered import TieredOffloadingManager
from manual_clock import ManualClock
from scheduler_requests import Req
from shelf_tier import Shelf

A = SessionId("tenant-a", "chat")
B = SessionId("tenant-b", "chat")


def scrape(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


@pytest.fixture
def server():
    gc.collect()
    from kvoffload.metrics import exporter

    for source in exporter.registered():
        exporter.unregister(source)
    server = metrics.serve(0)
    yield server
    server.shutdown()


def serve(sched, req_id, tokens, directives=None):
    req = Req(req_id, tokens)
    n = sched.match(req, 0, directives=directives)
    sched.on_allocated(req_id, [list(range(len(tokens) // 4 + 1))], n or 0)
    plan = sched.build_step([StepRequest(req_id, None, len(tokens))])
    sched.complete_jobs([(job.job_id, True) for job in plan.loads + plan.stores])
    sched.request_finished(req_id)


def settle(sched):
    for _ in range(10):
        plan = sched.build_step([])
        if not plan.transfers:
            return
        sched.complete_jobs([(job.job_id, True) for job in plan.transfers])


def action(action_id, kind, payload):
    return SimpleNamespace(action_id=action_id, action_type=kind, action_version="1", payload=payload)


def test_every_session_counter_has_a_metric():
    assert {f"session_{name}" for name in SESSION_FIELDS} <= set(METRICS)
    assert METRICS["session_directives"].labels == ("outcome",)


def test_session_counts_and_directive_outcomes_are_scraped_after_real_calls(server):
    clock = ManualClock(100.0)
    primary = CPUOffloadingManager(4, "lru", retention_fraction=0.5, clock=clock)  # budget 2
    shelf = Shelf(32, "lru", retention_fraction=0.5, clock=clock)
    tiered = TieredOffloadingManager(primary, [shelf])
    sched = OffloadingScheduler(tiered, [KVGroup(4)], hash_block_size=4)
    sched.sessions = SessionRegistry(tiered, clock=clock)
    reader = DirectiveReader(frozenset({"CPU", "SHELF"}))
    source = SchedulerSource(sched, tier_labels(["SHELF"], ["shelf"]), directives=reader)
    metrics.register(source)
    try:
        reading = reader.read(
            "a", "chat", "tenant-a", None,
            [action("a1", "kvoffload.retain", {"ttl_s": 60}), action("a2", "other.thing", {}),
             action("a3", "kvoffload.retain", {"ttl_s": -1})],
        )  # fmt: skip
        assert reading.directives.session == A and reading.directives.retain_s == 60
        serve(sched, "a", list(range(13)), reading.directives)  # 3 blocks: retained 2+3, trimmed 1
        settle(sched)
        sessions = sched.sessions
        assert sessions.retain(B, 10, [b.key for b in sessions.inspect(A)][:1]).absent == 1  # refused
        for i in range(4):  # the CPU tier's other blocks evicted: A's tail is only on the shelf
            serve(sched, f"o{i}", list(range(1000 * (i + 1), 1000 * (i + 1) + 9)))
            settle(sched)
        assert sessions.prefetch(A) == 1
        released = sessions.release(A)
        clock.now += 1000
        stats = sessions.stats()
        got = scrape(server.server_port)
        for name in SESSION_FIELDS:
            assert got[(f"kvoffload_session_{name}_total", ())] == getattr(stats, name), name
        assert (stats.retains, stats.retained, stats.trimmed, stats.absent) == (2, 5, 1, 1)
        assert (stats.releases, stats.released, stats.prefetches, stats.prefetched) == (1, released, 1, 1)
        assert stats.tenant_refusals == 1 and released == 5
        outcomes = {o: got[("kvoffload_session_directives_total", (("outcome", o),))] for o in
                    ("applied", "unknown", "invalid")}  # fmt: skip
        assert outcomes == {"applied": 1, "unknown": 1, "invalid": 1}
    finally:
        metrics.unregister(source)
