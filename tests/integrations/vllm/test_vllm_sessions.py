"""Session controls end to end on a real vLLM engine (CPU build, tiny Llama): a retain hint
(vLLM's ``kv_hints``, or ``kv_transfer_params``) keeps a session's blocks through a flood
of other prompts that evicts an unretained session's; the control endpoint inspects,
releases and keeps tenants apart over real HTTP (each tenant with its own token); a token
prefix's keys are the engine's. Every output equals the output computed from scratch."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402
from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope  # noqa: E402

from json_http import call  # noqa: E402
from kvoffload.demo.offline import close_llm, kv_block_bytes, make_llm, scheduler_connector, settle, word_text  # noqa: E402
from kvoffload.sessions import SessionId  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

BLOCK = 32
PROMPT = 500  # tokens: 15 full blocks are offloaded
OFFLOADED = 15 * BLOCK
HOST_BLOCKS = 64  # the retention budget is a quarter: 16 blocks, one session
A, B, OPERATOR = ({"Authorization": f"Bearer {token}"} for token in ("token-a", "token-b", "operator"))


@pytest.fixture(scope="module")
def llm(tiny_llama: str):
    extra = {
        "cpu_bytes_to_use": HOST_BLOCKS * kv_block_bytes(tiny_llama, BLOCK),
        "control_port": 0,
        "control_token": "operator",
        "control_tenant_tokens": {"tenant-a": "token-a", "tenant-b": "token-b"},
    }
    engine = make_llm(tiny_llama, kvoffload=extra)
    try:
        yield engine
    finally:
        close_llm(engine)


def run(llm, req_id: str, text: str, params: dict | None = None, salt: str | None = None, **kw):
    """One request through the engine (``kw``: ``session_id``, ``kv_hints``): its output."""
    sampling = SamplingParams(temperature=0, max_tokens=8, extra_args={"kv_transfer_params": params or {}})
    prompt = {"prompt": text} if salt is None else {"prompt": text, "cache_salt": salt}
    engine = llm.llm_engine
    engine.add_request(req_id, prompt, sampling, **kw)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished and out.request_id == req_id:
                final = out
    return final


def flood(llm, seed: int) -> None:
    """Five other prompts: 75 blocks through a 64-block host tier."""
    for i in range(5):
        run(llm, f"flood-{seed}-{i}", word_text(seed * 100 + i, PROMPT))
        settle(llm)


def returning(llm, req_id: str, text: str, salt: str | None = None):
    """The prompt again with the device cache emptied: what kvoffload served comes back."""
    assert llm.reset_prefix_cache()
    return run(llm, req_id, text, salt=salt)


def retain_hint(ttl_s: float) -> KvHintsEnvelope:
    return KvHintsEnvelope("1", "m1", [KvHintAction("a1", "kvoffload.retain", "1", {"ttl_s": ttl_s})])


def test_a_retain_hint_keeps_a_session_through_a_flood(llm):
    kept, lost = word_text(1, PROMPT), word_text(2, PROMPT)
    first_kept = run(llm, "kept-1", kept, session_id="chat-kept", kv_hints=retain_hint(600))
    assert first_kept.kv_transfer_params["kvoffload"] == {
        "session_id": "chat-kept", "retain_s": 600.0, "applied": ["a1"],
    }  # fmt: skip
    settle(llm)
    first_lost = run(llm, "lost-1", lost, session_id="chat-lost")
    settle(llm)
    flood(llm, 1)
    again = returning(llm, "kept-2", kept)
    assert again.outputs[0].token_ids == first_kept.outputs[0].token_ids
    assert again.num_cached_tokens == OFFLOADED  # loaded from the host tier
    settle(llm)
    again = returning(llm, "lost-2", lost)
    assert again.outputs[0].token_ids == first_lost.outputs[0].token_ids
    assert again.num_cached_tokens == 0  # evicted by the flood: recomputed
    settle(llm)
    sessions = scheduler_connector(llm)._scheduler.scheduler.sessions
    assert sessions.release(SessionId("", "chat-kept")) == 15


def test_kv_transfer_params_retain_and_a_bad_hint(llm, caplog):
    text = word_text(3, PROMPT)
    params = {"kvoffload": {"session_id": "chat-p", "retain_s": 600}}
    bad = KvHintsEnvelope("1", "m2", [KvHintAction("b1", "kvoffload.retain", "1", {"ttl_s": -1})])
    first = run(llm, "p-1", text, params, salt="tenant-a", kv_hints=bad)
    assert first.kv_transfer_params["kvoffload"] == {
        "session_id": "chat-p", "retain_s": 600.0, "applied": ["kv_transfer_params"], "invalid": ["b1"],
    }  # fmt: skip
    assert any("ttl_s" in r.getMessage() and "-1" in r.getMessage() for r in caplog.records)
    settle(llm)
    flood(llm, 2)
    again = returning(llm, "p-2", text, salt="tenant-a")
    assert again.outputs[0].token_ids == first.outputs[0].token_ids and again.num_cached_tokens == OFFLOADED
    settle(llm)
    side = scheduler_connector(llm)._scheduler.scheduler.sessions
    assert side.release(SessionId("tenant-a", "chat-p")) == 15


def test_the_control_endpoint_on_an_idle_engine(llm):
    connector = scheduler_connector(llm)
    host, port = connector._sessions.server.address
    assert host == "127.0.0.1"
    text = word_text(4, PROMPT)
    first = run(llm, "c-1", text, salt="tenant-a", session_id="chat-c")
    settle(llm)
    # the engine is idle between calls: commands run on the endpoint's thread, under the lock
    assert call(port, "GET", "/sessions/chat-c?tenant=tenant-a")[0] == 401  # no token
    status, answer = call(port, "POST", "/sessions/chat-c/retain", {"tenant": "tenant-a", "ttl_s": 600}, A)
    assert status == 200 and answer["retained"] == 15
    status, answer = call(port, "GET", "/sessions/chat-c?tenant=tenant-a", headers=A)
    assert status == 200 and answer["blocks"] == 15 and answer["tiers"]["CPU"]["blocks"] == 15
    assert 590 < answer["tiers"]["CPU"]["last_expiry_s"] <= 600
    # another tenant (and no tenant) never reaches it
    assert call(port, "GET", "/sessions/chat-c?tenant=tenant-b", headers=B)[0] == 404
    assert call(port, "POST", "/sessions/chat-c/release", {"tenant": ""}, OPERATOR)[0] == 404
    assert call(port, "POST", "/sessions/chat-c/release", {"tenant": "tenant-a"}, B)[0] == 403  # B's token
    # the engine's keys of the prompt are the ones the session holds
    keys = connector._sessions.prefix_keys("tenant-a", list(first.prompt_token_ids))
    held = connector._scheduler.scheduler.sessions.inspect(SessionId("tenant-a", "chat-c"))
    assert set(keys) == {block.key for block in held} and len(keys) == 15
    prefix = {"tenant": "tenant-a", "token_ids": list(first.prompt_token_ids)}
    answer = call(port, "POST", "/prefetch", prefix, A)[1]
    assert answer == {"tenant": "tenant-a", "blocks": 15, "prefetching": 0}  # one tier: none below CPU
    flood(llm, 3)
    again = returning(llm, "c-2", text, salt="tenant-a")
    assert again.outputs[0].token_ids == first.outputs[0].token_ids and again.num_cached_tokens == OFFLOADED
    settle(llm)
    status, answer = call(port, "POST", "/sessions/chat-c/release", {"tenant": "tenant-a"}, A)
    assert status == 200 and answer["released"] == 15
    assert call(port, "GET", "/sessions/chat-c?tenant=tenant-a", headers=OPERATOR)[1]["blocks"] == 0


def test_a_one_off_prompt_is_stored_nowhere(llm):
    text = word_text(5, PROMPT)
    first = run(llm, "once-1", text, {"kvoffload": {"store_to": []}})
    assert first.kv_transfer_params["kvoffload"]["store_to"] == []
    settle(llm)
    again = returning(llm, "once-2", text)
    assert again.outputs[0].token_ids == first.outputs[0].token_ids and again.num_cached_tokens == 0
    settle(llm)
    again = returning(llm, "once-3", text)  # stored this time, as any prompt
    assert again.num_cached_tokens == OFFLOADED
