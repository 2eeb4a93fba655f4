"""The engine harness (``engine.py``) on a real SGLang 0.5.23 engine with HiCache on this
CPU: a 600-token prompt is generated, the device and host caches are flushed, and the same
prompt comes back from the storage backend (``cached_tokens_details["storage"]``) with the
same output. First with SGLang's own ``file`` backend, then through ``RecordingStorage``
(``recording_backend.py``, which logs how SGLang calls a v1 backend; TP=2), then with
kvoffload's backend (``kvoffload.integrations.sglang.KVOffloadStorage``), as a user
configures it and wrapped by the recorder.

One engine per class (about 20 s to start, 30 s with TP=2; class-scoped, so each is
stopped, its processes checked by PID, before the next starts).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import psutil
import pytest
from engine import (
    PAGE_SIZE,
    EngineChildFailed,
    RunningEngine,
    build_native_hash,
    engine_environment,
    file_extra_config,
    kvoffload_extra_config,
    prompt_of,
    recording_extra_config,
    start_engine,
    torch_extensions_folder,
    wait_until,
)
from recording_backend import read_calls

pytestmark = pytest.mark.slow

PROMPT_TOKENS = 600
#: full pages of the prompt that reach storage
PAGES = PROMPT_TOKENS // PAGE_SIZE


def _stop(engine: RunningEngine) -> None:
    engine.shutdown()
    assert not engine.alive_children(), f"engine processes left behind: {engine.alive_children()}"


def _stored_pages(calls: list[dict], rank: int = 0) -> int:
    return sum(sum(c["result"]) for c in calls if c["method"] == "batch_set_v1" and c["tp_rank"] == rank)


def _flushed_prompt_from_storage(engine: RunningEngine, prompt: str, written) -> None:
    """Generate ``prompt``, wait for ``written()`` (its pages in storage: SGLang's flush
    drops backups still queued), flush the device and host caches, generate it again:
    served from storage, same output."""
    first = engine.generate(prompt)
    assert first.prompt_tokens == PROMPT_TOKENS
    assert first.storage == 0, first.details
    assert wait_until(written), "the prompt's pages never reached storage"
    engine.flush_cache()
    second = engine.generate(prompt)
    assert second.device == 0 and second.host == 0, second.details
    assert second.storage > 0, f"nothing came from storage: {second.details}"
    assert second.storage == PAGES * PAGE_SIZE, second.details
    assert second.output_ids == first.output_ids
    assert second.text == first.text


def test_sglangs_native_hash_is_built_before_an_engine_and_its_processes_only_load_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SGLang's HiCache hash extension is compiled by the harness, not in a scheduler's
    prefetch thread (whose 10 s join in ``flush_cache`` a compile under load outlasted);
    a fresh interpreter with the engine's environment, as a scheduler is, loads it without
    compiling it again."""
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    with engine_environment():
        assert os.environ["TORCH_EXTENSIONS_DIR"] == str(Path(sys.prefix) / "torch_extensions")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert torch_extensions_folder() == tmp_path
    with engine_environment():
        build_native_hash()
        folder = tmp_path / "hicache_hash_cpp"
        outputs = [folder / "hicache_hash_cpp.so", folder / "hash_binding.o"]
        assert all(path.is_file() for path in outputs), sorted(p.name for p in tmp_path.rglob("*"))
        built = [path.stat().st_mtime_ns for path in outputs]
        load = (
            "from sglang.srt.mem_cache.utils import get_hash_str; "
            "print(get_hash_str(list(range(16)), None, 16)[0])"
        )
        done = subprocess.run([sys.executable, "-c", load], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert len(done.stdout.split()[-1]) == 64  # one page's SHA-256, hex
    assert [path.stat().st_mtime_ns for path in outputs] == built, "the engine's process compiled it again"


def test_a_request_to_an_engine_whose_process_exited_fails_at_once() -> None:
    """After one of its processes exited (a scheduler that raised), the engine answers no
    request: the next test fails at once, naming the process, instead of waiting."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        engine = RunningEngine(engine=None, children=[psutil.Process(child.pid)], start_seconds=0.0)
        assert engine.alive_children() == [child.pid]
    finally:
        child.kill()
        child.wait(timeout=30)
    assert engine.alive_children() == []
    with pytest.raises(EngineChildFailed, match=rf"\[{child.pid}\] have exited"):
        engine.generate("a prompt")
    with pytest.raises(EngineChildFailed, match=rf"\[{child.pid}\] have exited"):
        engine.flush_cache()


@pytest.fixture(scope="class")
def file_engine(tiny_llama: str, tmp_path_factory: pytest.TempPathFactory):
    directory = tmp_path_factory.mktemp("sglang-file")
    engine = start_engine(tiny_llama, storage_backend="file", extra_config=file_extra_config(directory))
    yield engine, directory
    _stop(engine)


class TestSGLangFileBackend:
    def test_serves_a_flushed_prompt_from_storage(self, file_engine) -> None:
        engine, directory = file_engine
        files = lambda: len(list(directory.glob("*.bin")))  # noqa: E731
        _flushed_prompt_from_storage(engine, prompt_of(PROMPT_TOKENS, 1), lambda: files() >= PAGES)

    def test_a_failure_signal_after_requests_fails_the_test_not_the_process(self, file_engine) -> None:
        """After an engine served requests, a SIGQUIT from one of its processes, and SGLang
        killing its caller's process tree, raise ``EngineChildFailed`` here. (SGLang installs
        its own SIGQUIT handler, which SIGKILLs the test process, with its request loop at
        the first request; and its handler for a failing request loop kills its caller.)"""
        import sglang.srt.managers.tokenizer_manager as tokenizer_manager

        engine, _ = file_engine
        engine.generate(prompt_of(64, 2))
        with pytest.raises(EngineChildFailed):
            os.kill(os.getpid(), signal.SIGQUIT)
            time.sleep(5)  # the handler raises at once; this is never reached
        with pytest.raises(EngineChildFailed):
            tokenizer_manager.kill_process_tree(os.getpid(), include_parent=True)
        # and while the test waits on the engine's event loop (as in flush_cache), at once
        waiting = engine.engine.loop.create_task(asyncio.sleep(30))
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGQUIT)).start()
        started = time.monotonic()
        with pytest.raises(EngineChildFailed):
            engine.engine.loop.run_until_complete(waiting)
        assert time.monotonic() - started < 20, "the failure waited for the loop's work to end"
        waiting.cancel()
        assert engine.alive_children(), "the engine's processes were killed"
        assert engine.generate(prompt_of(64, 2)).prompt_tokens == 64


@pytest.fixture(scope="class")
def recording_engine(tiny_llama: str, tmp_path_factory: pytest.TempPathFactory):
    records = tmp_path_factory.mktemp("sglang-recording")
    config = {**recording_extra_config(records), "hicache_storage_pass_prefix_keys": True}
    engine = start_engine(tiny_llama, storage_backend="dynamic", extra_config=config, tp_size=2)
    yield engine, records
    _stop(engine)


class TestHowSGLangCallsAV1Backend:
    """``RecordingStorage`` in memory, TP=2, MHA, ``hicache_storage_pass_prefix_keys``."""

    def test_every_rank_writes_and_reads_whole_pages(self, recording_engine) -> None:
        """Every rank builds its own backend in its scheduler process, registers its host
        pool, asks ``batch_exists``, writes whole pages with ``batch_set_v1`` (int64 host
        slots, page by page) and reads them with ``batch_get_v1``; no whole-page method
        is called."""
        engine, records = recording_engine

        def written() -> bool:
            calls = read_calls(records)
            return all(_stored_pages(calls, rank) >= PAGES for rank in (0, 1))

        prompt = prompt_of(PROMPT_TOKENS, 2)
        _flushed_prompt_from_storage(engine, prompt, written)
        assert wait_until(
            lambda: {c["tp_rank"] for c in read_calls(records) if c["method"] == "batch_get_v1"} == {0, 1}
        )
        calls = read_calls(records)
        (records / "summary.json").write_text(json.dumps(calls, indent=1))
        methods = Counter((c["method"], c["tp_rank"]) for c in calls)
        for rank in (0, 1):
            for method in (
                "__init__",
                "register_mem_pool_host",
                "batch_exists",
                "batch_set_v1",
                "batch_get_v1",
            ):
                assert methods[method, rank] >= 1, (method, rank, methods)
        assert not {m for m, _ in methods} & {
            "get",
            "set",
            "batch_get",
            "batch_set",
            "exists",
            "batch_exists_v2",
        }
        assert len({c["pid"] for c in calls}) == 2  # one backend per rank, each in its scheduler process
        for call in calls:
            if call["method"] in ("batch_set_v1", "batch_get_v1"):
                indices = call["args"]["host_indices"]
                assert indices["dtype"] == "torch.int64" and indices["device"] == "cpu", indices
                assert indices["shape"] == [call["args"]["keys"]["len"] * PAGE_SIZE], call
                assert call["args"]["indices"]["whole_pages"], call
            if call["method"] in ("batch_exists", "batch_set_v1", "batch_get_v1"):
                assert call["args"]["keys"]["key_len"] == 64, call
                assert call["args"]["extra_info"]["type"] == "HiCacheStorageExtraInfo", call

    def test_prefix_keys_reach_writes_not_lookups(self, recording_engine) -> None:
        """With ``hicache_storage_pass_prefix_keys`` (a key SGLang takes out of the extra
        config before the backend sees it), SGLang 0.5.23 passes the keys before a batch
        to ``batch_set_v1`` (``[]`` from the start of a sequence) and ``batch_get_v1``,
        but ``batch_exists`` always gets ``prefix_keys=None``, even for pages that extend
        a cached prefix: a backend cannot rely on them when it answers lookups."""
        engine, records = recording_engine
        prompt, more = prompt_of(PROMPT_TOKENS, 22), prompt_of(320, 23)

        def since(t: float) -> list[dict]:
            return [c for c in read_calls(records) if c["t"] >= t and c["tp_rank"] == 0]

        started = time.time()
        engine.generate(prompt)
        assert wait_until(lambda: _stored_pages(since(started)) >= PAGES)
        extended = time.time()
        engine.generate(prompt + more)  # the prompt's pages are on the device: only `more` is new
        assert wait_until(lambda: _stored_pages(since(extended)) >= 320 // PAGE_SIZE)
        parent = [c for c in since(started) if c["method"] == "batch_set_v1" and c["t"] < extended]
        extension = [c for c in since(extended) if c["method"] == "batch_set_v1"]
        lookups = [c for c in since(started) if c["method"] == "batch_exists"]
        assert parent and extension and len(lookups) >= 2
        assert parent[0]["args"]["extra_info"]["prefix_keys"] == {"type": "list[]", "len": 0}
        parent_keys = [key for c in parent for key in c["args"]["keys"]["all"]]
        assert extension[0]["args"]["extra_info"]["prefix_keys"]["all"] == parent_keys
        assert all(c["args"]["extra_info"]["prefix_keys"] is None for c in lookups)


@pytest.fixture(scope="class")
def kvoffload_engine(tiny_llama: str, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("sglang-kvoffload")
    engine = start_engine(tiny_llama, storage_backend="dynamic", extra_config=kvoffload_extra_config(root))
    yield engine
    _stop(engine)


class TestKVOffloadBackend:
    def test_serves_a_flushed_prompt_from_storage(self, kvoffload_engine: RunningEngine) -> None:
        """kvoffload's backend as SGLang loads it (the extra config as a user writes it),
        with a disk tier. Its writes are not observable from here, so a short settle stands
        in for the wait (its ``batch_set_v1`` returns when the pages are written)."""
        polls: list[int] = []

        def settled() -> bool:
            polls.append(1)
            return len(polls) > 20  # about 1 s

        _flushed_prompt_from_storage(kvoffload_engine, prompt_of(PROMPT_TOKENS, 3), settled)


@pytest.fixture(scope="class")
def recorded_kvoffload_engine(tiny_llama: str, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("sglang-kvoffload-recorded")
    config = recording_extra_config(root / "records", inner=kvoffload_extra_config(root / "fs"))
    engine = start_engine(
        tiny_llama, storage_backend="dynamic", extra_config=config, layout="page_first_direct"
    )
    yield engine, root / "records"
    _stop(engine)


class TestKVOffloadBackendRecorded:
    """kvoffload's backend under ``page_first_direct``, wrapped by the recorder: its writes
    are awaited from the call log, and what it answered SGLang is checked there."""

    def test_serves_a_flushed_prompt_from_storage(self, recorded_kvoffload_engine) -> None:
        engine, records = recorded_kvoffload_engine
        _flushed_prompt_from_storage(
            engine, prompt_of(PROMPT_TOKENS, 4), lambda: _stored_pages(read_calls(records)) >= PAGES
        )
        calls = read_calls(records)
        (Path(records) / "summary.json").write_text(json.dumps(calls, indent=1))
        gets = [c for c in calls if c["method"] == "batch_get_v1"]
        assert gets and all(all(c["result"]) for c in gets), gets


def test_a_backend_that_fails_fails_the_start_not_the_test_process(tiny_llama: str) -> None:
    """A storage backend that does not load kills SGLang's scheduler; SGLang would then
    SIGKILL the whole process tree, pytest included. The harness turns it into
    ``EngineChildFailed`` and leaves no process behind."""
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    config = {"backend_name": "x", "module_path": "no_such_module", "class_name": "X", "interface_v1": 1}
    with pytest.raises(EngineChildFailed):
        start_engine(tiny_llama, storage_backend="dynamic", extra_config=config)
    left = [p.pid for p in psutil.Process().children(recursive=True) if p.pid not in before]
    assert not left, f"processes left behind: {left}"
