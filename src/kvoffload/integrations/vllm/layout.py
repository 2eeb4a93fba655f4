"""vLLM's KV-cache memory as kvoffload sees it: host bytes per offloaded block (scheduler
side, from the ``KVCacheConfig``), the identity of those bytes (what secondary tiers key
their namespace on), and the ``KVLayout`` of the tensors vLLM registers (worker side).
Both sides derive the host pool size and the identity from the same configs, so they agree.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
from vllm.v1.kv_cache_interface import KVCacheConfig

from kvoffload.transfer import KVLayout


def host_block_bytes(kv_cache_config: KVCacheConfig, blocks_per_offload_block: int) -> int:
    """Host bytes one offloaded block takes: a page of every KV tensor, ``F`` times."""
    per_block = sum(t.size // kv_cache_config.num_blocks for t in kv_cache_config.kv_cache_tensors)
    return per_block * blocks_per_offload_block


def kv_identity(vllm_config: Any, kv_cache_config: KVCacheConfig, blocks_per_offload_block: int) -> dict:
    """Everything that changes the bytes of an offloaded block: model, cache dtype, every
    group's KV-cache spec (block size, heads, head size, dtype, window), the page bytes of
    each tensor (this worker's shard), the offloaded block size, the memory layout, the
    block-hash algorithm and seed, and the tensor-parallel size."""
    num_blocks = kv_cache_config.num_blocks
    return {
        "model": str(vllm_config.model_config.model),
        "cache_dtype": str(vllm_config.cache_config.cache_dtype),
        "groups": [repr(group.kv_cache_spec) for group in kv_cache_config.kv_cache_groups],
        "page_bytes": [t.size // num_blocks for t in kv_cache_config.kv_cache_tensors],
        "blocks_per_offload_block": blocks_per_offload_block,
        "layout": "LBHNC",
        "hash": [str(vllm_config.cache_config.prefix_caching_hash_algo), os.environ.get("PYTHONHASHSEED")],
        "tensor_parallel_size": vllm_config.parallel_config.tensor_parallel_size,
    }


def build_layout(kv_caches: Mapping[str, torch.Tensor], kv_cache_config: KVCacheConfig) -> KVLayout:
    """The layout of the registered per-layer KV tensors, grouped as vLLM groups layers.

    The block dimension is the first one (the layout vLLM uses when the connector asks for
    ``LBHNC``), or the second behind a K/V dimension of 2 (``(2, num_blocks, ...)``)."""
    groups = [
        [name for name in group.layer_names if name in kv_caches] for group in kv_cache_config.kv_cache_groups
    ]
    num_blocks = kv_cache_config.num_blocks
    first = next(iter(kv_caches.values()))
    block_dim = (
        1
        if first.dim() > 1 and first.shape[0] == 2 and first.shape[1] % num_blocks == 0 and num_blocks != 2
        else 0
    )
    return KVLayout.from_layer_tensors(kv_caches, groups, block_dim=block_dim, num_blocks=num_blocks)
