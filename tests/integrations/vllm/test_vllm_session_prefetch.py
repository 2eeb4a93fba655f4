"""A session's prefetch at a pause's end on a real vLLM engine (CPU build, tiny Llama) with
the CPU tier over the local-disk tier: after a flood of other prompts the session's blocks
are only on disk; a prefetch through the control endpoint brings them into the CPU tier
with no request in the engine; the resumed turn (the first turn's prompt, its output and
a new message) then loads them from the CPU tier, while a session not prefetched loads
from disk. The session counts and the directives read are scraped from kvoffload's
endpoint and vLLM's registry, and a configured ``retention_fraction`` bounds a retain
hint. Outputs equal those of the engine without kvoffload. No timed assertion."""

from __future__ import annotations

import gc
import urllib.request

import pytest

pytest.importorskip("vllm")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope  # noqa: E402

from json_http import call  # noqa: E402
from kvoffload.demo.offline import (  # noqa: E402
    close_llm,
    kv_block_bytes,
    make_llm,
    scheduler_connector,
    settle,
    word_text,
)
from kvoffload.sessions import SessionId  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

BLOCK = 32
PROMPT = 500  # tokens; with its 8 output tokens, 15 full blocks are offloaded
BLOCKS = 15
HOST_BLOCKS = 64  # a flood of five other prompts (75 blocks) evicts a session from it
FRACTION = 0.1  # of 64 blocks: 6 retained at most
NEW = 24  # tokens of the resumed turn's new message
SESSIONS = ("chat-pre", "chat-cold", "chat-kept")


def turn_ids(tokenizer, seed: int) -> tuple[list[int], list[int]]:
    """A session's first prompt and the new message of its resumed turn, as token ids."""
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    return encode(word_text(seed, PROMPT)), encode(word_text(seed + 50, NEW))


def run(llm, req_id: str, ids: list[int], **kw):
    engine = llm.llm_engine
    engine.add_request(req_id, {"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=8), **kw)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished and out.request_id == req_id:
                final = out
    return final


@pytest.fixture(scope="module")
def expected(tiny_llama: str):
    """Each session's first and resumed turns' outputs on the engine without kvoffload."""
    llm = make_llm(tiny_llama)
    try:
        tokenizer = llm.get_tokenizer()
        out = {}
        for seed, name in enumerate(SESSIONS, 1):
            first, new = turn_ids(tokenizer, seed)
            answer = list(run(llm, f"{name}-1", first).outputs[0].token_ids)
            resumed = first + answer + new
            out[name] = (first, answer, resumed, list(run(llm, f"{name}-2", resumed).outputs[0].token_ids))
        return out
    finally:
        close_llm(llm)


@pytest.fixture(scope="module")
def llm(tiny_llama: str, expected, tmp_path_factory):
    block = kv_block_bytes(tiny_llama, BLOCK)
    root = tmp_path_factory.mktemp("disk")
    extra = {
        "cpu_bytes_to_use": HOST_BLOCKS * block,
        "secondary_tiers": [{"type": "fs", "root_dir": str(root), "bytes_to_use": 400 * (block + 4096)}],
        "control_port": 0,
        "retention_fraction": FRACTION,
        "prefetch_batch": 4,  # the session's 15 blocks in several prefetch transfers
    }
    engine = make_llm(tiny_llama, kvoffload=extra)
    try:
        yield engine
    finally:
        close_llm(engine)


def flood(llm, seed: int) -> None:
    ids = llm.get_tokenizer().encode
    for i in range(5):
        run(llm, f"flood-{seed}-{i}", ids(word_text(seed * 100 + i, PROMPT), add_special_tokens=False))
        settle(llm)


def where(connector, keys) -> list[str]:
    """Per key: the tiers holding it loadable, e.g. ``"DISK"`` or ``"CPU+DISK"``."""
    manager = connector._scheduler.scheduler.manager
    out = []
    for key in keys:
        states = [(tier.medium, tier.state(key)) for tier in (manager.primary, *manager.secondaries)]
        held = [medium for medium, state in states if state is not None and state >= 0]
        out.append("+".join(held) or "-")
    return out


def moved() -> dict[str, float]:
    """Blocks moved so far: loaded into the device, promoted from disk into CPU."""
    from kvoffload.demo.offline import worker_connector
    from kvoffload.metrics.samples import Samples

    samples = Samples()
    worker_connector()._worker.metrics.meter.read(samples)
    return {
        "load": samples.get("transfer_blocks", ("0:primary", "load")),
        "promote": samples.get("transfer_blocks", ("1:fs", "load")),
    }


def scrape(port: int) -> dict:
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


def test_a_prefetch_at_the_pauses_end_brings_the_session_into_cpu_and_the_next_turn_loads_it_there(
    llm, expected
):
    connector = scheduler_connector(llm)
    scheduler = connector._scheduler.scheduler
    port = connector._sessions.server.address[1]
    outs = {}
    for name in ("chat-pre", "chat-cold"):
        first, answer, _, _ = expected[name]
        out = run(llm, f"{name}-1", first, session_id=name)
        assert list(out.outputs[0].token_ids) == answer
        settle(llm)
        outs[name] = connector._sessions.prefix_keys("", first + answer)
        assert len(outs[name]) == BLOCKS
    flood(llm, 1)  # the pause: others' prompts
    for name in ("chat-pre", "chat-cold"):
        assert where(connector, outs[name]) == ["DISK"] * BLOCKS, name  # only on disk now
    assert llm.reset_prefix_cache()  # and not on the device

    # the pause's end: a prefetch with no request in the engine
    status, answer = call(port, "POST", "/sessions/chat-pre/prefetch", {"tenant": ""})
    assert status == 200 and answer["prefetching"] == BLOCKS
    assert not llm.llm_engine.has_unfinished_requests()
    steps = 0
    while connector.has_pending_push_work() and steps < 10_000:  # vLLM's loop: steps while pending
        llm.llm_engine.step()
        steps += 1
    assert not connector.has_pending_push_work()
    assert where(connector, outs["chat-pre"]) == ["CPU+DISK"] * BLOCKS
    assert where(connector, outs["chat-cold"]) == ["DISK"] * BLOCKS

    # the blocks each resumed turn moved (the worker's transfer meter): a load from the CPU
    # tier, and promotions from disk only for the session not prefetched (vLLM's cached
    # tokens by source count a prefetched block as the disk's: it is what brought it)
    for name, promoted in (("chat-pre", 0), ("chat-cold", BLOCKS)):
        _, _, resumed, want = expected[name]
        before = moved()
        out = run(llm, f"{name}-2", resumed, session_id=name)
        settle(llm)
        assert list(out.outputs[0].token_ids) == want
        assert out.num_cached_tokens == BLOCKS * BLOCK  # none recomputed
        after = moved()
        assert after["load"] - before["load"] == BLOCKS, name  # CPU -> device
        assert after["promote"] - before["promote"] == promoted, name  # disk -> CPU
    stats = scheduler.sessions.stats()
    assert (stats.prefetches, stats.prefetched) == (1, BLOCKS)


def test_session_metrics_and_the_configured_retention_fraction_on_a_scrape(llm, expected):
    import prometheus_client

    from kvoffload import metrics
    from kvoffload.metrics import exporter

    gc.collect()
    for source in exporter.registered():  # sources of engines closed earlier in the session
        if source is not scheduler_connector(llm)._scheduler_metrics.source:
            exporter.unregister(source)
    ours = metrics.serve(0)
    vllms, _ = prometheus_client.start_http_server(0, addr="127.0.0.1")
    try:
        first, answer, _, _ = expected["chat-kept"]
        hints = KvHintsEnvelope("1", "m1", [
            KvHintAction("a1", "kvoffload.retain", "1", {"ttl_s": 600}),
            KvHintAction("a2", "someone.else", "1", {}),
            KvHintAction("a3", "kvoffload.prefetch", "1", {"x": 1}),
        ])  # fmt: skip
        out = run(llm, "chat-kept-1", first, session_id="chat-kept", kv_hints=hints)
        assert list(out.outputs[0].token_ids) == answer
        report = out.kv_transfer_params["kvoffload"]
        assert report["applied"] == ["a1"] and report["unknown"] == ["a2"] and report["invalid"] == ["a3"]
        settle(llm)
        sessions = scheduler_connector(llm)._scheduler.scheduler.sessions
        held = sessions.inspect(SessionId("", "chat-kept"))
        by_tier = {}
        for block in held:
            by_tier[block.medium] = by_tier.get(block.medium, 0) + 1
        assert by_tier["CPU"] == int(HOST_BLOCKS * FRACTION)  # 10% of 64 blocks, the tail trimmed
        stats = sessions.stats()
        assert stats.trimmed >= BLOCKS - int(HOST_BLOCKS * FRACTION)
        for _ in range(3):  # steps that report the scheduler side's stats to vLLM
            settle(llm)
        got, seen = scrape(ours.server_port), scrape(vllms.server_port)
        for name in ("retains", "retained", "trimmed", "prefetches", "prefetched"):
            assert got[(f"kvoffload_session_{name}_total", ())] == getattr(stats, name), name
            assert seen[(f"vllm:kvoffload_session_{name}_total", ())] == getattr(stats, name), name
        assert stats.prefetched == BLOCKS and stats.retains == 1
        for outcome in ("applied", "unknown", "invalid"):
            assert got[("kvoffload_session_directives_total", (("outcome", outcome),))] == 1
            assert seen[("vllm:kvoffload_session_directives_total", (("outcome", outcome),))] == 1
    finally:
        ours.shutdown()
        vllms.shutdown()
