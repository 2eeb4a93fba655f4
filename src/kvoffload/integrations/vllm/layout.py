"""vLLM's KV-cache memory as kvoffload sees it: host bytes per offloaded block (scheduler
side, from the ``KVCacheConfig``) and the ``KVLayout`` of the tensors vLLM registers
(worker side). Both sides derive the host pool size from the same config, so they agree.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from vllm.v1.kv_cache_interface import KVCacheConfig

from kvoffload.transfer import KVLayout


def host_block_bytes(kv_cache_config: KVCacheConfig, blocks_per_offload_block: int) -> int:
    """Host bytes one offloaded block takes: a page of every KV tensor, ``F`` times."""
    per_block = sum(t.size // kv_cache_config.num_blocks for t in kv_cache_config.kv_cache_tensors)
    return per_block * blocks_per_offload_block


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
