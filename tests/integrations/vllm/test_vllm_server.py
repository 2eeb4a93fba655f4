"""Server mode, as users run it: vLLM's OpenAI-compatible server (``python -m
vllm.entrypoints.openai.api_server``, engine in its own process) with kvoffload on
loopback. Completions that overflow the engine's own KV cache are served again from
kvoffload; vLLM's ``/metrics`` says so (``prompt_tokens_cached_by_source_total{source=
"host"}``, kvoffload's ``vllm:kvoffload_*`` and ``vllm:kv_offload_*`` metrics), and the
outputs equal those the engine computed itself the first time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request

import pytest

pytest.importorskip("vllm")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from free_ports import free_port  # noqa: E402
from kvoffload.demo.offline import kv_block_bytes, kv_transfer_config, word_text  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(300)]

PROMPT = 2000  # tokens (one character each): 62 full blocks of 32
BLOCKS = 62
DEVICE_BLOCKS = 100  # the engine's own cache: one prompt and a half


def post(port: int, path: str, body: dict) -> dict:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def scrape(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
        text = response.read().decode()
    values: dict = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(
                sorted((k, v) for k, v in sample.labels.items() if k not in ("model_name", "engine"))
            )
            values[(sample.name, labels)] = values.get((sample.name, labels), 0.0) + sample.value
    return values


def value(values: dict, name: str, **labels) -> float:
    return values.get((name, tuple(sorted(labels.items()))), 0.0)


def wait_ready(proc: subprocess.Popen, port: int, log_path) -> None:
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the server exited ({proc.returncode}):\n{log_path.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"the server did not start:\n{log_path.read_text()[-4000:]}")


@pytest.fixture(scope="module")
def model(tiny_llama: str) -> str:
    return tiny_llama


def test_openai_server_serves_overflowing_prompts_from_kvoffload(model, tmp_path):
    port = free_port()
    block_bytes = kv_block_bytes(model)
    config = kv_transfer_config({"cpu_bytes_to_use": 400 * block_bytes})
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
               "--model", model, "--tokenizer", model, "--served-model-name", "tiny",
               "--host", "127.0.0.1", "--port", str(port),
               "--dtype", "float32", "--block-size", "32", "--max-model-len", "2100",
               "--kv-cache-memory-bytes", str(DEVICE_BLOCKS * block_bytes), "--enforce-eager",
               "--enable-prefix-caching", "--prefix-caching-hash-algo", "sha256_cbor",
               "--enable-prompt-tokens-details", "--seed", "0",
               "--kv-transfer-config", json.dumps(config)]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")  # the engine runs in its own process
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_ready(proc, port, log_path)

        def complete(text: str) -> tuple[str, int]:
            body = {"model": "tiny", "prompt": text, "max_tokens": 8, "temperature": 0}
            out = post(port, "/v1/completions", body)
            details = out["usage"].get("prompt_tokens_details") or {}
            return out["choices"][0]["text"], details.get("cached_tokens") or 0

        prompts = [word_text(seed, PROMPT) for seed in (11, 12, 13)]
        first = [complete(text) for text in prompts]  # each evicts the one before from the device
        assert [cached for _, cached in first] == [0, 0, 0]
        again = [complete(text) for text in prompts]
        assert [text for text, _ in again] == [text for text, _ in first]  # as recomputed
        served = sum(cached for _, cached in again)
        assert served >= 2 * BLOCKS * 32  # most of it from kvoffload

        deadline = time.monotonic() + 30
        while True:  # a step's stats reach the front end with that step's output
            got = scrape(port)
            host = value(got, "vllm:prompt_tokens_cached_by_source_total", source="host")
            device = value(got, "vllm:prompt_tokens_cached_by_source_total", source="device")
            ours = value(got, "vllm:kvoffload_hit_tokens_total", tier="0:primary")
            if (host and host + device == served and ours == host) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert host > 0 and host + device == served
        assert value(got, "vllm:prompt_tokens_cached_by_source_total", source="external_unspecified") == 0
        assert ours == host == value(got, "vllm:kvoffload_scheduler_tokens_loaded_total")
        loaded = value(got, "vllm:kvoffload_transfer_blocks_total", tier="0:primary", direction="load")
        assert loaded * 32 == host
        assert value(got, "vllm:kv_offload_load_bytes_total") == loaded * block_bytes
        assert value(got, "vllm:kv_offload_store_bytes_total") == 3 * BLOCKS * block_bytes
        assert (
            value(
                got,
                "vllm:kvoffload_transfer_jobs_total",
                tier="0:primary",
                direction="load",
                outcome="failed",
            )
            == 0
        )
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
