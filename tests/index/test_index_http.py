"""The index's HTTP API on a real server (a free loopback port), fed by real publishers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvoffload.events import BlockStored, ZmqEventPublisher
from kvoffload.index import BlockIndex, IndexServer, IndexService, TierWeights
from kvoffload.keys import BlockHasher, external_hash

pytestmark = pytest.mark.timeout(60)

BS = 4


def call(server: IndexServer, path: str, body: object = None, raw: bytes | None = None) -> tuple[int, object]:
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    request = urllib.request.Request(server.url + path, data=data, method="GET" if data is None else "POST")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            status, payload = response.status, response.read()
    except urllib.error.HTTPError as exc:
        status, payload = exc.code, exc.read()
    text = payload.decode()
    return status, (json.loads(text) if path != "/metrics" else text)


def wait_for(predicate: Callable[[], bool], what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


@pytest.fixture
def server() -> Iterator[IndexServer]:
    service = IndexService(BlockIndex(TierWeights()), replay_timeout=0.5, idle_catch_up=0.2)
    with IndexServer(service, "127.0.0.1", 0) as srv:
        yield srv


@pytest.fixture
def publishers(tmp_path: Path) -> Iterator[list[ZmqEventPublisher]]:
    pubs = [ZmqEventPublisher(f"ipc://{tmp_path}/p{i}", f"ipc://{tmp_path}/r{i}") for i in range(2)]
    yield pubs
    for pub in pubs:
        pub.close()


def register(server: IndexServer, pub: ZmqEventPublisher, instance_id: object, **extra) -> tuple[int, object]:
    body = {
        "instance_id": instance_id,
        "endpoint": pub.endpoint,
        "replay_endpoint": pub.replay_endpoint,
        "model_name": "llama",
        "block_size": BS,
        **extra,
    }
    return call(server, "/register", body)


def test_register_query_workers_dump_and_metrics(server: IndexServer, publishers) -> None:
    a, b = publishers
    tokens = list(range(6 * BS + 1))
    hashes = [external_hash(h) for h in BlockHasher().hash_request(tokens, BS)]
    a.publish([BlockStored(hashes[:2], None, [], BS, None, "GPU", None)])
    a.publish([BlockStored(hashes[:5], None, [], BS, None, "CPU", None)])
    b.publish([BlockStored(hashes, None, [], BS, None, "STORAGE", None, locality="REMOTE")])

    status, body = register(server, a, 11)
    assert status == 201
    assert body == {
        "status": "ok",
        "instance_id": 11,
        "dp_rank": 0,
        "model_name": "llama",
        "tenant_id": "default",
        "endpoint": a.endpoint,
        "replay_endpoint": a.replay_endpoint,
        "state": body["state"],
    }
    assert register(server, b, "worker-b", dp_rank=2)[0] == 201

    def applied() -> bool:
        workers = call(server, "/workers")[1]
        return sum(s["batches"] for w in workers for s in w["sources"].values()) == 3

    wait_for(applied, "three batches")
    status, scored = call(server, "/query", {"token_ids": tokens, "model_name": "llama"})
    assert status == 200
    by_hash = call(server, "/query_by_hash", {"block_hashes": hashes, "model_name": "llama"})[1]
    assert scored == by_hash
    assert scored == {
        "model_name": "llama",
        "tenant_id": "default",
        "block_size": BS,
        "num_blocks": 6,
        "scores": {"11": {"0": 2 * BS}},
        "frequencies": [1, 1],
        "tree_sizes": {"11": {"0": 2}},
        "instances": {
            "11": {
                "longest_matched": 5 * BS,
                "dp": {
                    "0": {
                        "gpu": 2 * BS,
                        "cpu": 5 * BS,
                        "disk": 5 * BS,
                        "shared": 5 * BS,
                        "weighted": (2 + 3 * 0.75) * BS,
                        "state": "EXACT",
                    }
                },
            },
            "worker-b": {
                "longest_matched": 6 * BS,
                "dp": {
                    "2": {
                        "gpu": 0,
                        "cpu": 0,
                        "disk": 0,
                        "shared": 6 * BS,
                        "weighted": 6 * 0.5 * BS,
                        "state": "EXACT",
                    }
                },
            },
        },
    }
    # i64 hashes, as Dynamo sends them, and Mooncake's field names
    signed = [h - 2**64 if h >= 2**63 else h for h in hashes]
    assert call(server, "/query_by_hash", {"seq_hashes": signed, "model": "llama"})[1] == scored

    workers = sorted(call(server, "/workers")[1], key=lambda w: str(w["instance_id"]))
    assert [(w["instance_id"], list(w["endpoints"]), w["block_size"]) for w in workers] == [
        (11, ["0"], BS),
        ("worker-b", ["2"], BS),
    ]
    source = workers[0]["sources"]["0"]
    assert source["state"] == "EXACT" and source["blocks"] == {"gpu": 2, "cpu": 5, "disk": 0, "shared": 0}
    assert source["lost"] == 0 and source["subscriber"]["malformed"] == 0

    dump = call(server, "/dump")[1]
    entries = dump["llama:default"]["entries"]
    assert dump["llama:default"]["block_size"] == BS
    assert {(e["instance_id"], e["tier"], len(e["block_hashes"])) for e in entries} == {
        (11, "gpu", 2),
        (11, "cpu", 5),
        ("worker-b", "shared", 6),
    }

    metrics = call(server, "/metrics")[1]
    assert 'kvoffload_index_events_total{status="applied",type="BlockStored"} 3.0' in metrics
    assert 'kvoffload_index_block_hashes_total{op="stored"} 13.0' in metrics
    assert 'kvoffload_index_sources{state="EXACT"} 2.0' in metrics
    assert 'kvoffload_index_query_seconds_count{endpoint="query_by_hash"} 2.0' in metrics
    assert 'kvoffload_index_query_seconds_count{endpoint="query"} 1.0' in metrics
    assert (
        'kvoffload_index_blocks{dp_rank="0",instance_id="11",model="llama",tenant="default",tier="cpu"} 5.0'
        in metrics
    )
    for name in (
        "gaps_repaired_total",
        "batches_lost_total",
        "sources_degraded_total",
        "publisher_restarts_total",
    ):
        assert f"kvoffload_index_{name}{{" in metrics

    status, body = call(server, "/unregister", {"instance_id": 11, "model_name": "llama"})
    assert status == 200
    assert body == {
        "status": "ok",
        "removed": [{"instance_id": 11, "dp_rank": 0, "model_name": "llama", "tenant_id": "default"}],
    }
    assert list(
        call(server, "/query_by_hash", {"block_hashes": hashes, "model_name": "llama"})[1]["instances"]
    ) == ["worker-b"]


@pytest.mark.parametrize(
    ("path", "body", "status", "field", "words"),
    [
        (
            "/register",
            {"endpoint": "tcp://127.0.0.1:1", "model_name": "m", "block_size": 4},
            400,
            "instance_id",
            [],
        ),
        ("/register", {"instance_id": 1, "model_name": "m", "block_size": 4}, 400, "endpoint", []),
        (
            "/register",
            {"instance_id": 1, "endpoint": "tcp://127.0.0.1:1", "block_size": 4},
            400,
            "model_name",
            [],
        ),
        (
            "/register",
            {"instance_id": 1, "endpoint": "tcp://127.0.0.1:1", "model_name": "m", "block_size": "4"},
            400,
            "block_size",
            ["got `str`"],
        ),
        (
            "/register",
            {"instance_id": 1, "endpoint": "tcp://127.0.0.1:1", "model_name": "m", "block_size": 0},
            400,
            "block_size",
            ["got 0"],
        ),
        (
            "/register",
            {"instance_id": 1, "endpoint": "udp://x:1", "model_name": "m", "block_size": 4},
            400,
            "endpoint",
            ["'udp://x:1'"],
        ),
        (
            "/register",
            {
                "instance_id": 1,
                "endpoint": "tcp://127.0.0.1:1",
                "model_name": "m",
                "block_size": 4,
                "dp_rank": -1,
            },
            400,
            "dp_rank",
            ["-1"],
        ),
        ("/query", {"model_name": "m"}, 400, "token_ids", []),
        ("/query", {"model_name": "m", "token_ids": [1, "x"]}, 400, "token_ids", ["$.token_ids[1]"]),
        ("/query", {"model_name": "m", "token_ids": [1, -2]}, 400, "token_ids", ["-2"]),
        ("/query", {"token_ids": [1]}, 400, "model_name", []),
        ("/query_by_hash", {"model_name": "m"}, 400, "block_hashes", []),
        ("/query_by_hash", {"model_name": "m", "block_hashes": [2**64]}, 400, "block_hashes", [str(2**64)]),
        ("/query_by_hash", {"model_name": "m", "block_hashes": [1.5]}, 400, "block_hashes", ["float"]),
        ("/query_by_hash", {"model_name": "nope", "block_hashes": [1]}, 404, None, ["'nope'"]),
        ("/query", {"model_name": "nope", "token_ids": [1], "tenant_id": "t"}, 404, None, ["'nope'", "'t'"]),
        ("/unregister", {"model_name": "m"}, 400, "instance_id", []),
        ("/unregister", {"instance_id": 5, "model_name": "m"}, 404, None, ["instance 5"]),
        ("/query", [1, 2], 400, None, ["object"]),
    ],
)
def test_bad_requests_get_4xx_naming_the_field(server, path, body, status, field, words) -> None:
    got_status, got = call(server, path, body)
    assert got_status == status, got
    assert got["field"] == field
    message = got["error"]
    assert field is None or field in message
    for word in words:
        assert word in message


def test_malformed_json_and_conflicts(server: IndexServer, publishers) -> None:
    status, body = call(server, "/query", raw=b"{not json")
    assert status == 400 and "not valid JSON" in body["error"]
    assert call(server, "/query", raw=b"")[0] == 400
    assert register(server, publishers[0], 1)[0] == 201
    status, body = register(server, publishers[1], 1)
    assert status == 409 and "already registered" in body["error"]
    status, body = register(server, publishers[1], 2, block_size=2 * BS)
    assert status == 409 and "block_size 8 differs from the 4" in body["error"]
    assert call(server, "/health") == (200, {"status": "ok"})


def test_the_cli_serves_on_loopback_until_terminated(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvoffload.cli", "index", "serve", "--port", "0", "--weights", "host=0.5"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        assert line.startswith("kvoffload index serving on http://127.0.0.1:"), line
        url = line.split(" on ", 1)[1].strip()
        with urllib.request.urlopen(url + "/health", timeout=10) as response:
            assert json.loads(response.read()) == {"status": "ok"}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_cli_names_a_bad_option() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvoffload.cli", "index", "serve", "--port", "0", "--weights", "ssd=1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0 and "'ssd=1'" in proc.stderr


def test_score_response_counts_engines_per_matched_depth() -> None:
    from kvoffload.index.core import EngineMatch, QueryResult
    from kvoffload.index.server import score_response
    from kvoffload.index.state import SourceState

    def match(instance: int, rank: int, levels: tuple[int, int, int, int]) -> EngineMatch:
        return EngineMatch(instance, rank, levels, float(levels[0]), SourceState.EXACT, (9, 9, 0, 0))

    result = QueryResult("llama", "default", BS, 5)
    result.matches = [match(1, 0, (3, 5, 5, 5)), match(1, 1, (1, 1, 2, 2)), match(2, 0, (0, 4, 4, 4))]
    result.matches.append(match(3, 0, (3, 3, 3, 3)))
    body = score_response(result)
    # Depth 1 is matched on the device by 3 engines, depths 2-3 by the two reaching 3.
    assert body["frequencies"] == [3, 2, 2]
    assert body["scores"] == {"1": {"0": 3 * BS, "1": BS}, "3": {"0": 3 * BS}}
    assert body["tree_sizes"] == {"1": {"0": 9, "1": 9}, "3": {"0": 9}}
    assert body["instances"]["1"]["longest_matched"] == 5 * BS
    tiers = {"gpu": 0, "cpu": 4 * BS, "disk": 4 * BS, "shared": 4 * BS, "weighted": 0.0, "state": "EXACT"}
    assert body["instances"]["2"] == {"longest_matched": 4 * BS, "dp": {"0": tiers}}


def test_without_uvloop_the_server_runs_on_asyncio_and_still_answers_errors(monkeypatch) -> None:
    import asyncio

    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop now raises ImportError
    service = IndexService(BlockIndex(TierWeights()))
    with IndexServer(service, "127.0.0.1", 0) as srv:
        assert isinstance(srv._loop, asyncio.BaseEventLoop)
        assert not type(srv._loop).__module__.startswith("uvloop")
        assert call(srv, "/health") == (200, {"status": "ok"})
        status, body = call(srv, "/query_by_hash", {"block_hashes": [1], "model_name": "nope"})
        assert status == 404 and "nope" in body["error"]
        status, body = call(srv, "/query_by_hash", {"block_hashes": ["x"], "model_name": "m"})
        assert status == 400 and body["field"] == "block_hashes"
