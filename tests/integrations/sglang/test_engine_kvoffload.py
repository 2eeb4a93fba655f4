"""kvoffload's backend on real SGLang 0.5.23 engines (tiny random Llama, this CPU): a prompt
flushed from the device and host caches comes back from each tier with the same output; a
second engine is served from the first one's disk; corrupt disk bytes are counted misses;
two engines share one Redis server, which is killed mid-run (no errors, same outputs);
TP=2. The backend runs in each engine's scheduler process: what it counts is read from
its Prometheus endpoint (``metrics_port``)."""

from __future__ import annotations

import itertools
import re
import time
import urllib.request
from pathlib import Path

import pytest
from engine import PAGE_SIZE, RunningEngine, kvoffload_extra_config, prompt_of, start_engine, wait_until

from free_ports import free_port
from redis_server import RedisServer

pytestmark = pytest.mark.slow

PROMPT_TOKENS = 600
PAGES = PROMPT_TOKENS // PAGE_SIZE  # full pages of a prompt that reach storage
FROM_STORAGE = PAGES * PAGE_SIZE


def counters(port: int) -> dict[str, float]:
    """The backend's own counters (``tier_counter{tier="sglang"}``) from its endpoint."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    pattern = r'kvoffload_tier_counter_total\{counter="(\w+)",side="storage",tier="sglang"\} ([0-9.e+]+)'
    return {name: float(value) for name, value in re.findall(pattern, text)}


def stored(port: int, pages: int) -> bool:
    return counters(port).get("stored_pages", 0) >= pages


def two_free_ports() -> int:
    """A free port whose next one is free too (rank r of two serves on port + r)."""
    while True:
        port = free_port()
        if port < 65535 and _free(port + 1):
            return port


def _free(port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def stop(engine: RunningEngine) -> None:
    engine.shutdown()
    assert not engine.alive_children(), f"engine processes left behind: {engine.alive_children()}"


def cold_then_from_storage(engine: RunningEngine, prompt: str, port: int, stored_before: int = 0):
    """``prompt`` computed, its pages written, the device and host caches flushed, then
    ``prompt`` again: from storage, the same output. Returns the first generation."""
    first = engine.generate(prompt)
    assert first.storage == 0 and first.prompt_tokens == PROMPT_TOKENS, first.details
    assert wait_until(lambda: stored(port, stored_before + PAGES)), counters(port)
    engine.flush_cache()
    again = engine.generate(prompt)
    assert again.device == 0 and again.host == 0 and again.storage == FROM_STORAGE, again.details
    assert again.output_ids == first.output_ids and again.text == first.text
    return first


# -- the disk tier: one engine, then a second on the same folder ------------------------------


@pytest.fixture(scope="module")
def disk(tmp_path_factory):
    """The disk tier's folder, and what its first engine computed (for the second)."""
    return {"root": tmp_path_factory.mktemp("sglang-disk"), "outputs": {}}


@pytest.fixture(scope="class")
def disk_engine(tiny_llama: str, disk):
    port = free_port()
    config = kvoffload_extra_config(disk["root"], metrics_port=port)
    engine = start_engine(tiny_llama, storage_backend="dynamic", extra_config=config)
    yield engine, port
    stop(engine)


def _data_files(root: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in root.rglob("*") if p.is_file() and p.stat().st_size > 64 << 10}


class TestDiskTier:
    def test_a_flushed_prompt_comes_back_from_disk(self, disk_engine, disk) -> None:
        engine, port = disk_engine
        prompt = prompt_of(PROMPT_TOKENS, 31)
        first = cold_then_from_storage(engine, prompt, port)
        disk["outputs"][prompt] = first.output_ids
        assert counters(port)["loaded_pages"] == PAGES
        assert counters(port)["errors"] == 0

    def test_corrupt_bytes_are_counted_misses_and_the_output_stays(self, disk_engine, disk) -> None:
        engine, port = disk_engine
        before = _data_files(disk["root"])
        prompt = prompt_of(PROMPT_TOKENS, 32)
        first = engine.generate(prompt)
        assert wait_until(lambda: stored(port, 2 * PAGES)), counters(port)
        # the bytes this prompt's pages changed; flip one in the middle of them
        changed = []
        for path, data in _data_files(disk["root"]).items():
            old = before.get(path, b"")
            spots = [i for i in range(0, len(data), 512) if data[i : i + 512] != old[i : i + 512]]
            changed += [(path, i) for i in spots]
        assert changed, "the prompt's pages changed no file"
        path, at = changed[len(changed) // 2]
        data = bytearray(path.read_bytes())
        data[at + 100] ^= 0xFF
        path.write_bytes(bytes(data))

        engine.flush_cache()
        again = engine.generate(prompt)
        assert again.output_ids == first.output_ids and again.text == first.text
        assert again.storage < FROM_STORAGE, again.details  # the pages from the bad one on were recomputed
        assert counters(port)["failed_load_pages"] == 1
        assert counters(port)["errors"] == 0


@pytest.fixture(scope="class")
def second_disk_engine(tiny_llama: str, disk):
    port = free_port()
    config = kvoffload_extra_config(disk["root"], metrics_port=port)
    engine = start_engine(tiny_llama, storage_backend="dynamic", extra_config=config)
    yield engine, port
    stop(engine)


class TestASecondEngineOnTheSameDisk:
    def test_it_serves_the_first_engines_prompt(self, second_disk_engine, disk) -> None:
        engine, port = second_disk_engine
        assert disk["outputs"], "TestDiskTier did not run first"
        for prompt, output in disk["outputs"].items():
            got = engine.generate(prompt)  # its first request: nothing on the device or host
            assert got.storage == FROM_STORAGE, got.details
            assert got.output_ids == output


# -- the shared Redis tier: two engines, the server killed mid-run ----------------------------


@pytest.fixture(scope="class")
def redis_engines(tiny_llama: str, tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("sglang-redis")).start()
    engines = []
    try:
        for _ in range(2):
            port = free_port()
            config = {
                **kvoffload_extra_config(".", metrics_port=port, exists_wait_s=1.0),
                "secondary_tiers": [{"type": "redis", "url": server.url}],
            }
            engine = start_engine(
                tiny_llama, storage_backend="dynamic", extra_config=config, layout="page_first_direct"
            )
            engines.append((engine, port))
        yield server, engines
    finally:
        for engine, _ in engines:
            stop(engine)
        server.stop()


class TestTwoEnginesOnOneRedisServer:
    def test_one_engine_serves_what_the_other_computed_and_a_killed_server_changes_no_output(
        self, redis_engines
    ) -> None:
        server, [(one, one_port), (two, two_port)] = redis_engines
        prompt = prompt_of(PROMPT_TOKENS, 41)
        first = cold_then_from_storage(one, prompt, one_port)
        shared = two.generate(prompt)
        assert shared.storage == FROM_STORAGE and shared.output_ids == first.output_ids, shared.details

        server.kill()  # mid-run: both engines go on
        fresh = prompt_of(PROMPT_TOKENS, 42)
        fresh_first = one.generate(fresh)
        one.flush_cache()
        two.flush_cache()
        for engine in (one, two):
            assert engine.generate(prompt).output_ids == first.output_ids  # recomputed
            assert engine.generate(fresh).output_ids == fresh_first.output_ids
        assert counters(one_port)["errors"] == 0 and counters(two_port)["errors"] == 0

        server.start()  # back, empty (no persistence): noticed within the breakers' longest delay (10 s)
        deadline = time.monotonic() + 60
        for seed in itertools.count(43):
            later = prompt_of(PROMPT_TOKENS, seed)
            stored_now = counters(one_port)["stored_pages"]
            first = one.generate(later)
            wait_until(lambda n=stored_now + PAGES: stored(one_port, n), timeout=5)  # (declined while down)
            one.flush_cache()
            again = one.generate(later)
            assert again.output_ids == first.output_ids
            if again.storage == FROM_STORAGE:
                break
            assert time.monotonic() < deadline, "the server's return was never noticed"
        assert counters(one_port)["errors"] == 0


# -- the Mooncake tier, and TP=2 on the disk tier ---------------------------------------------


@pytest.mark.mooncake
def test_a_flushed_prompt_comes_back_from_a_mooncake_store(tiny_llama: str, tmp_path) -> None:
    from mooncake_server import MooncakeServer

    server = MooncakeServer(tmp_path, segment=256 << 20).start()
    try:
        port = free_port()
        config = {**kvoffload_extra_config(".", metrics_port=port), "secondary_tiers": [server.tier_config()]}
        engine = start_engine(tiny_llama, storage_backend="dynamic", extra_config=config)
        try:
            cold_then_from_storage(engine, prompt_of(PROMPT_TOKENS, 51), port)
        finally:
            stop(engine)
    finally:
        server.stop()


def test_tensor_parallel_ranks_store_and_load_their_own_shares(tiny_llama: str, tmp_path) -> None:
    port = two_free_ports()
    config = kvoffload_extra_config(tmp_path, metrics_port=port)
    engine = start_engine(tiny_llama, storage_backend="dynamic", extra_config=config, tp_size=2)
    try:
        prompt = prompt_of(PROMPT_TOKENS, 61)
        first = engine.generate(prompt)
        assert wait_until(lambda: stored(port, PAGES) and stored(port + 1, PAGES))
        engine.flush_cache()
        again = engine.generate(prompt)
        assert again.storage == FROM_STORAGE and again.output_ids == first.output_ids, again.details
        assert counters(port)["loaded_pages"] == PAGES and counters(port + 1)["loaded_pages"] == PAGES
        assert len([p for p in Path(tmp_path).iterdir() if p.is_dir()]) == 2  # a namespace per rank
    finally:
        stop(engine)
