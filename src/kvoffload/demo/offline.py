"""In-process vLLM engines with and without kvoffload, for the demo, benchmarks and tests.

``make_llm`` builds a ``vllm.LLM`` on the CPU build with prefix caching, ``sha256_cbor``
block hashes, float32 compute (bf16 is emulated and slow on CPUs without AMX, and float32
makes greedy outputs independent of how a prefill is chunked), a KV cache of
``kv_cache_bytes`` and, when ``kvoffload`` is given, the
``KVOffloadConnector`` with that extra config. ``close_llm`` shuts it down so another
engine can start in the same process. Set ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` before
importing vLLM to keep the engine in this process (faster start, reachable connector).
"""

from __future__ import annotations

import gc
import json
import random
from pathlib import Path
from typing import Any

CONNECTOR_MODULE = "kvoffload.integrations.vllm"
_WORDS = ("alpha", "beta", "gamma", "delta", "kappa", "omega", "sigma", "zeta", "theta", "lambda")


def word_text(rng: random.Random | int, n: int) -> str:
    """``n`` characters of random words: ``n`` tokens for the tiny model's byte tokenizer.
    ``rng`` is a ``random.Random`` (to draw several texts from one stream) or a seed."""
    rng = random.Random(rng) if isinstance(rng, int) else rng
    return "".join(rng.choice(_WORDS) + " " for _ in range(n // 3 + 1))[:n]


def kv_transfer_config(extra: dict[str, Any]) -> dict[str, Any]:
    """The ``kv_transfer_config`` that enables kvoffload with ``extra`` as its settings.

    A load that fails makes vLLM recompute the request's tokens (vLLM's default policy
    would fail the request instead)."""
    return {
        "kv_connector": "KVOffloadConnector",
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
        "kv_load_failure_policy": "recompute",
    }


def kv_block_bytes(model_path: str, block_size: int = 32, dtype_bytes: int = 4) -> int:
    """Bytes of one KV-cache block of a Llama-style model (all layers, K and V)."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    heads = config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return config["num_hidden_layers"] * heads * head_dim * 2 * block_size * dtype_bytes


def make_llm(
    model_path: str,
    *,
    kvoffload: dict[str, Any] | None = None,
    kv_cache_bytes: int = 64 << 20,
    block_size: int = 32,
    max_model_len: int = 4096,
    events_endpoint: str | None = None,
    seed: int = 0,
    dtype: str = "float32",
    **engine_args: Any,
) -> Any:
    """``engine_args`` (e.g. ``max_num_batched_tokens``) go to ``vllm.LLM`` unchanged."""
    from vllm import LLM

    kwargs: dict[str, Any] = dict(engine_args)
    if kvoffload is not None:
        kwargs["kv_transfer_config"] = kv_transfer_config(kvoffload)
    if events_endpoint is not None:
        kwargs["kv_events_config"] = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": events_endpoint,
            "topic": "kv",
        }
    return LLM(
        model=model_path,
        tokenizer=model_path,
        block_size=block_size,
        max_model_len=max_model_len,
        enforce_eager=True,
        enable_prefix_caching=True,
        prefix_caching_hash_algo="sha256_cbor",
        kv_cache_memory_bytes=kv_cache_bytes,
        disable_log_stats=False,  # per-request metrics (time to first token)
        seed=seed,
        dtype=dtype,
        **kwargs,
    )


def close_llm(llm: Any) -> None:
    """Shut the engine down and release what would stop another from starting."""
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    core = getattr(llm.llm_engine, "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()


def worker_connector() -> Any:
    """The worker-role ``KVOffloadConnector`` of the in-process engine (it holds the host
    block pool)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group()


def greedy(llm: Any, prompt: Any, max_tokens: int = 8) -> tuple[list[int], int]:
    """Greedy output token ids of one prompt (a string or a vLLM prompt dict, e.g. with a
    ``cache_salt``) and how many of its tokens were served from a cache."""
    from vllm import SamplingParams

    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)[0]
    return list(out.outputs[0].token_ids), out.num_cached_tokens


def settle(llm: Any) -> None:
    """Wait until kvoffload's transfers in flight finished, then run one engine step so that
    vLLM hears of it: jobs complete, and the device blocks held for finished requests are
    freed (``reset_prefix_cache`` then succeeds). Deterministic: no timing involved."""
    worker_connector()._worker.wait_idle()
    llm.llm_engine.step()


def host_transfer_engine() -> Any:
    """The host-memory ``TransferEngine`` behind the in-process engine's worker connector
    (its ``host_pool`` holds the offloaded bytes)."""
    from kvoffload.specs import MEDIUM_CPU, MEDIUM_DEVICE

    return worker_connector()._worker.worker.worker_for((MEDIUM_DEVICE, MEDIUM_CPU))


def scheduler_connector(llm: Any) -> Any:
    """The scheduler-role ``KVOffloadConnector`` of an in-process engine (or ``None``)."""
    core = llm.llm_engine.engine_core.engine_core
    return core.scheduler.get_kv_connector()
