"""The session controls through vLLM's OpenAI-compatible server, as users run it (engine
in its own process): a completion names its session with the ``X-Session-ID`` header and
asks for retention in ``kv_transfer_params``; its response says what was read; the
control endpoint beside the engine (in the engine's process, the engine idle) inspects
and releases that session, and never another tenant's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm")

from test_vllm_server import wait_ready  # noqa: E402

from free_ports import free_port  # noqa: E402
from json_http import call  # noqa: E402
from kvoffload.demo.offline import kv_block_bytes, kv_transfer_config, word_text  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(300)]


def test_a_session_through_the_openai_server_and_the_control_endpoint(tiny_llama, tmp_path):
    port, control = free_port(), free_port()
    block_bytes = kv_block_bytes(tiny_llama)
    config = kv_transfer_config({"cpu_bytes_to_use": 64 * block_bytes, "control_port": control})
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
               "--model", tiny_llama, "--tokenizer", tiny_llama, "--served-model-name", "tiny",
               "--host", "127.0.0.1", "--port", str(port),
               "--dtype", "float32", "--block-size", "32", "--max-model-len", "1024",
               "--kv-cache-memory-bytes", str(100 * block_bytes), "--enforce-eager",
               "--enable-prefix-caching", "--prefix-caching-hash-algo", "sha256_cbor", "--seed", "0",
               "--kv-transfer-config", json.dumps(config)]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_ready(proc, port, log_path)
        body = {
            "model": "tiny", "prompt": word_text(21, 500), "max_tokens": 8, "temperature": 0,
            "cache_salt": "tenant-a", "kv_transfer_params": {"kvoffload": {"retain_s": 600}},
        }  # fmt: skip
        status, out = call(port, "POST", "/v1/completions", body, {"X-Session-ID": "chat-s"})
        assert status == 200, out
        assert out["kv_transfer_params"] == {
            "kvoffload": {"session_id": "chat-s", "retain_s": 600.0, "applied": ["kv_transfer_params"]}
        }
        status, answer = call(control, "GET", "/sessions/chat-s?tenant=tenant-a")
        assert status == 200 and answer["blocks"] == 15 and answer["tiers"]["CPU"]["blocks"] == 15
        assert call(control, "GET", "/sessions/chat-s?tenant=")[0] == 404  # no salt: another tenant
        assert call(control, "POST", "/sessions/chat-s/release", {"tenant": "tenant-b"})[0] == 404
        status, answer = call(control, "POST", "/sessions/chat-s/release", {"tenant": "tenant-a"})
        assert status == 200 and answer["released"] == 15
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
