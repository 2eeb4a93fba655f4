"""The session control endpoint over real loopback HTTP: token, bind address, answers,
the queue to the scheduler thread, and tenants kept apart."""

from __future__ import annotations

import http.client
import json
import threading

import pytest

from kvoffload.control.queue import ControlQueue
from kvoffload.control.server import ControlServer
from kvoffload.cpu import CPUOffloadingManager
from kvoffload.keys import make_offload_key
from kvoffload.manager import RequestContext
from kvoffload.scheduler.sessions import SessionRegistry
from kvoffload.sessions import SessionDirectives, SessionId
from kvoffload.tiers.tiered import TieredOffloadingManager
from shelf_tier import Shelf


def store(tiered, keys):
    """Stored in CPU and written through to the shelf, as the worker would."""
    out = tiered.prepare_store(keys)
    tiered.complete_store(out.keys_to_store)
    for transfer in tiered.take_transfers():
        tiered.complete_transfer(transfer.token, True)


def make_registry() -> SessionRegistry:
    """The scheduler's registry over a CPU tier of 4 blocks and a shelf below it, where
    tenant A's session "chat" finished a request with three blocks."""
    tiered = TieredOffloadingManager(CPUOffloadingManager(4, retention_fraction=1.0), [Shelf(64, "lru")])
    registry = SessionRegistry(tiered)
    store(tiered, SESSION_KEYS)
    registry.on_finished(RequestContext("r1", directives=SessionDirectives(A)), SESSION_KEYS)
    return registry


SESSION_KEYS = [make_offload_key(bytes([i]) * 32, 0) for i in range(3)]
A, B = SessionId("tenant-a", "chat"), SessionId("tenant-b", "chat")


class Engine:
    """A scheduler thread draining the queue each 'step', under the adapter's lock."""

    def __init__(self, queue: ControlQueue, lock: threading.Lock) -> None:
        self.queue, self.lock, self.stop = queue, lock, threading.Event()
        self.ran = 0
        self.thread = threading.Thread(target=self.run, name="engine-scheduler", daemon=True)
        self.thread.start()

    def run(self) -> None:
        while not self.stop.wait(0.002):
            with self.lock:
                self.ran += self.queue.drain()


@pytest.fixture
def served():
    registry = make_registry()
    lock = threading.Lock()
    queue = ControlQueue(lock)
    engine = Engine(queue, lock)
    server = ControlServer(queue, registry, port=0, token=None, timeout_s=2.0, keys_of=keys_of)
    yield server, registry, engine
    server.close()
    engine.stop.set()
    engine.thread.join()


def keys_of(tenant: str, tokens: list[int]) -> list[bytes]:
    """A stand-in for the engine's hashing: one block per 4 tokens, the last token's key."""
    if len(tokens) % 4:
        raise ValueError(f"{len(tokens)} tokens are not whole blocks")
    return [SESSION_KEYS[t] for t in tokens[3::4]]


def call(server, method, path, body=None, token=None, raw=None):
    conn = http.client.HTTPConnection(*server.address, timeout=10)
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    conn.request(method, path, body=data, headers=headers)
    response = conn.getresponse()
    answer = json.loads(response.read())
    conn.close()
    return response.status, answer


def test_retain_inspect_prefetch_release(served):
    server, registry, engine = served
    assert server.address[0] == "127.0.0.1"
    status, answer = call(server, "POST", "/sessions/chat/retain", {"tenant": "tenant-a", "ttl_s": 60})
    assert status == 200 and answer == {
        "session_id": "chat",
        "tenant": "tenant-a",
        "ttl_s": 60.0,
        "retained": 6,
        "trimmed": 0,
        "absent": 0,
    }  # fmt: skip  (three blocks, each in CPU and on the shelf)
    status, answer = call(server, "GET", "/sessions/chat?tenant=tenant-a")
    assert status == 200 and answer["blocks"] == 6 and set(answer["tiers"]) == {"CPU", "SHELF"}
    cpu = answer["tiers"]["CPU"]
    assert cpu["blocks"] == 3 and 55 < cpu["first_expiry_s"] <= cpu["last_expiry_s"] <= 60
    assert call(server, "POST", "/sessions/chat/release", {"tenant": "tenant-a"})[1]["released"] == 6
    assert call(server, "GET", "/sessions/chat?tenant=tenant-a")[1] == {
        "session_id": "chat", "tenant": "tenant-a", "blocks": 0, "tiers": {},
    }  # fmt: skip
    store(registry.manager, [make_offload_key(bytes([9, i]) * 16, 0) for i in range(4)])  # out of CPU
    assert call(server, "POST", "/sessions/chat/prefetch", {"tenant": "tenant-a"})[1]["prefetching"] == 3
    assert engine.ran == 5  # every command ran on the engine's scheduler thread


def test_session_ids_are_url_decoded(served):
    server, registry, _ = served
    session = SessionId("", "user 1/chat")
    registry.on_finished(RequestContext("r2", directives=SessionDirectives(session)), SESSION_KEYS)
    assert call(server, "POST", "/sessions/user%201%2Fchat/retain", {"tenant": "", "ttl_s": 1})[0] == 200


def test_another_tenant_never_reaches_a_session(served):
    server, registry, _ = served
    call(server, "POST", "/sessions/chat/retain", {"tenant": "tenant-a", "ttl_s": 60})
    for method, path, body in [
        ("GET", "/sessions/chat?tenant=tenant-b", None),
        ("GET", "/sessions/chat?tenant=", None),
        ("POST", "/sessions/chat/release", {"tenant": "tenant-b"}),
        ("POST", "/sessions/chat/retain", {"tenant": "tenant-b", "ttl_s": 1}),
        ("POST", "/sessions/chat/prefetch", {"tenant": "tenant-b"}),
    ]:
        status, answer = call(server, method, path, body)
        assert status == 404 and "tenant" in answer["error"], (method, path)
    assert len(registry.inspect(A)) == 6 and registry.inspect(B) == []  # A's retention stands
    assert registry.stats().prefetches == 0


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "named"),
    [
        ("GET", "/sessions/chat", None, 400, "tenant is required"),
        ("POST", "/sessions/chat/release", {}, 400, "tenant is required"),
        ("POST", "/sessions/chat/retain", {"tenant": "tenant-a"}, 400, "ttl_s"),
        ("POST", "/sessions/chat/retain", {"tenant": "tenant-a", "ttl_s": -5}, 400, "-5"),
        ("POST", "/sessions/chat/retain", {"tenant": 7, "ttl_s": 5}, 400, "7"),
        ("POST", "/sessions/nobody/release", {"tenant": "tenant-a"}, 404, "'nobody'"),
        ("POST", "/sessions/chat/evict", {"tenant": "tenant-a"}, 404, "evict"),
        ("GET", "/metrics", None, 404, "/metrics"),
        ("POST", "/prefetch", {"tenant": "", "token_ids": [1, 2, 3]}, 400, "3 tokens"),
        ("POST", "/prefetch", {"tenant": "", "token_ids": "1 2"}, 400, "token_ids"),
    ],
)
def test_refusals_name_the_value(served, method, path, body, status, named):
    server, _, _ = served
    got, answer = call(server, method, path, body)
    assert got == status and named in answer["error"]


def test_bodies_that_are_not_json_objects(served):
    server, _, _ = served
    assert call(server, "POST", "/sessions/chat/release", raw=b"{nope")[0] == 400
    assert call(server, "POST", "/sessions/chat/release", raw=b"[1]")[0] == 400


def test_prefetch_of_a_token_prefix(served):
    server, registry, _ = served
    store(registry.manager, [make_offload_key(bytes([9, i]) * 16, 0) for i in range(4)])  # out of CPU
    status, answer = call(server, "POST", "/prefetch", {"tenant": "tenant-a", "token_ids": [0, 0, 0, 1] * 2})
    assert status == 200 and answer == {"tenant": "tenant-a", "blocks": 2, "prefetching": 1}  # key 1, once


def test_a_configured_token_is_required():
    registry = make_registry()
    queue = ControlQueue(threading.Lock())
    server = ControlServer(queue, registry, port=0, token="s3cret")
    try:
        for token in (None, "wrong"):
            status, answer = call(server, "GET", "/sessions/chat?tenant=tenant-a", token=token)
            assert status == 401 and "token" in answer["error"]
        assert call(server, "GET", "/sessions/chat?tenant=tenant-a", token="s3cret")[0] == 200
    finally:
        server.close()


def test_a_tenants_token_opens_its_own_tenant_only():
    """Tenant B's token is refused (403) on every control naming tenant A, before anything
    runs; A's token and the operator's open A's session."""
    registry = make_registry()
    lock = threading.Lock()
    queue = ControlQueue(lock)
    engine = Engine(queue, lock)
    tokens = {"tenant-a": "token-a", "tenant-b": "token-b"}
    server = ControlServer(queue, registry, port=0, token="operator", keys_of=keys_of, tenant_tokens=tokens)
    try:
        retain = ("POST", "/sessions/chat/retain", {"tenant": "tenant-a", "ttl_s": 60})
        assert call(server, *retain, token="token-a")[0] == 200
        ran = engine.ran
        for method, path, body in [
            ("GET", "/sessions/chat?tenant=tenant-a", None),
            ("POST", "/sessions/chat/release", {"tenant": "tenant-a"}),
            retain,
            ("POST", "/sessions/chat/prefetch", {"tenant": "tenant-a"}),
            ("POST", "/prefetch", {"tenant": "tenant-a", "token_ids": [0, 0, 0, 1]}),
        ]:
            status, answer = call(server, method, path, body, token="token-b")
            assert status == 403, (method, path)
            assert answer["error"] == "this token opens tenant 'tenant-b' only, not 'tenant-a'"
            assert call(server, method, path, body, token="nobody's")[0] == 401
        assert engine.ran == ran  # refused before the scheduler saw them
        assert len(registry.inspect(A)) == 6 and registry.stats().prefetches == 0
        # B's own tenant has no session "chat"
        assert call(server, "GET", "/sessions/chat?tenant=tenant-b", token="token-b")[0] == 404
        assert call(server, "GET", "/sessions/chat?tenant=tenant-a", token="operator")[1]["blocks"] == 6
        release = {"tenant": "tenant-a"}
        assert call(server, "POST", "/sessions/chat/release", release, token="token-a")[0] == 200
        assert registry.inspect(A) == []
    finally:
        server.close()
        engine.stop.set()
        engine.thread.join()


def test_one_token_for_two_scopes_is_refused():
    registry, queue = make_registry(), ControlQueue()
    with pytest.raises(ValueError, match="given to the operator and 'tenant-a'"):
        ControlServer(queue, registry, port=0, token="t", tenant_tokens={"tenant-a": "t"})
    with pytest.raises(ValueError, match="given to 'tenant-a' and 'tenant-b'"):
        ControlServer(queue, registry, port=0, tenant_tokens={"tenant-a": "t", "tenant-b": "t"})


def test_an_idle_engine_answers_from_the_control_thread_under_its_lock():
    """vLLM's idle loop takes no steps: the command runs on the HTTP thread, holding the lock."""
    registry = make_registry()
    lock = threading.Lock()
    server = ControlServer(ControlQueue(lock), registry, port=0, timeout_s=2.0)
    try:
        assert call(server, "POST", "/sessions/chat/prefetch", {"tenant": "tenant-a"})[0] == 200
        assert registry.stats().prefetches == 1
    finally:
        server.close()


def test_a_busy_engine_that_does_not_drain_in_time_is_503():
    registry = make_registry()
    lock = threading.Lock()
    queue = ControlQueue(lock)
    server = ControlServer(queue, registry, port=0, timeout_s=0.3)
    try:
        with lock:  # the engine is inside one of its calls all along
            status, answer = call(server, "POST", "/sessions/chat/retain", {"tenant": "tenant-a", "ttl_s": 9})
        assert status == 503 and "0.3 s" in answer["error"]
        assert len(queue) == 1 and queue.drain() == 0  # dropped, never run late
        assert registry.inspect(A) == []
    finally:
        server.close()


def test_it_binds_where_it_is_told_and_refuses_a_taken_port():
    registry, queue = make_registry(), ControlQueue()
    server = ControlServer(queue, registry, host="127.0.0.2", port=0)
    try:
        assert server.address[0] == "127.0.0.2"
        with pytest.raises(OSError, match=f"127.0.0.2:{server.address[1]}"):
            ControlServer(queue, registry, host="127.0.0.2", port=server.address[1])
    finally:
        server.close()
