"""Real SGLang host pools and storage configs on the CPU, for the backend's interface tests.

``mha_pool(layout)`` / ``mla_pool(layout)`` build SGLang 0.5.23's own
``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost`` over small CPU "device" buffers
(unpinned, so no ``cudaHostRegister``), filled with random bytes; ``storage_config``
SGLang's ``HiCacheStorageConfig`` as its cache controller makes it; ``backend(...)``
the kvoffload backend built the way SGLang's ``dynamic`` factory builds it, its pool
registered. ``host_indices(pages, page_size)`` the token slots of whole pages, as SGLang
passes them.
"""

from __future__ import annotations

import hashlib

import torch
from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo, MLABufferInfo
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

LAYERS, HEADS, HEAD_DIM, PAGE, TOKENS = 3, 2, 16, 4, 128
MLA_DIM = 48
DTYPE = torch.bfloat16
MHA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct")
BACKEND = {
    "backend_name": "kvoffload",
    "module_path": "kvoffload.integrations.sglang",
    "class_name": "KVOffloadStorage",
}


def _ptrs(tensors) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.uint64)


def _fill(pool, seed: int):
    generator = torch.Generator().manual_seed(seed)
    raw = pool.kv_buffer.view(-1).view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=generator))
    return pool


def mha_pool(layout: str, seed: int = 0, heads: int = HEADS) -> MHATokenToKVPoolHost:
    k = tuple(torch.zeros(TOKENS, heads, HEAD_DIM, dtype=DTYPE) for _ in range(LAYERS))
    v = tuple(torch.zeros(TOKENS, heads, HEAD_DIM, dtype=DTYPE) for _ in range(LAYERS))
    info = MHABufferInfo(
        buffers=KVBuffers(k=k, v=v, k_data_ptrs=_ptrs(k), v_data_ptrs=_ptrs(v), layout=KVBufferLayout.NHD),
        page_size=PAGE, head_num=heads, head_dim=HEAD_DIM, v_head_dim=HEAD_DIM, dtype=DTYPE,
        device=torch.device("cpu"),
    )  # fmt: skip
    pool = MHATokenToKVPoolHost(
        info, 2.0, 0, PAGE, layout, pin_memory=False, device="cpu",
        device_capacity_tokens=TOKENS, start_layer=0, end_layer=LAYERS,
    )  # fmt: skip
    return _fill(pool, seed)


def mla_pool(layout: str, seed: int = 0) -> MLATokenToKVPoolHost:
    buffers = tuple(torch.zeros(TOKENS, 1, MLA_DIM, dtype=DTYPE) for _ in range(LAYERS))
    info = MLABufferInfo(
        buffers=buffers, data_ptrs=_ptrs(buffers), layer_indices=tuple(range(LAYERS)),
        device_layer_num=LAYERS, page_size=PAGE, kv_lora_rank=32, qk_rope_head_dim=16,
        kv_cache_dim=MLA_DIM, dtype=DTYPE, device=torch.device("cpu"),
    )  # fmt: skip
    pool = MLATokenToKVPoolHost(
        info, 2.0, 0, PAGE, layout, pin_memory=False, device="cpu",
        device_capacity_tokens=TOKENS, start_layer=0, end_layer=LAYERS, target_layer_num=LAYERS,
    )  # fmt: skip
    return _fill(pool, seed)


def storage_config(extra: dict, mla: bool = False, tp_rank: int = 0, tp_size: int = 1, model="tiny"):
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=mla, enable_storage_metrics=False, is_page_first_layout=False, model_name=model,
        extra_config={**BACKEND, **extra},
    )  # fmt: skip


def backend(pool, extra: dict, **config):
    """The backend as SGLang's ``dynamic`` factory makes it, then its pool registered."""
    cfg = storage_config(extra, mla=type(pool).__name__.startswith("MLA"), **config)
    storage = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    storage.register_mem_pool_host(pool)
    return storage


def page_keys(count: int, salt: str = "") -> list[str]:
    """A chain of SGLang-like page keys (64 hex digits each)."""
    keys, prior = [], salt.encode()
    for i in range(count):
        prior = hashlib.sha256(prior + i.to_bytes(4, "little")).digest()
        keys.append(prior.hex())
    return keys


def host_indices(pages, page_size: int = PAGE) -> torch.Tensor:
    return torch.cat([torch.arange(p * page_size, (p + 1) * page_size, dtype=torch.int64) for p in pages])


def page_bytes(pool, page: int) -> torch.Tensor:
    """Page ``page``'s bytes as SGLang's whole-page interface hands them out."""
    return pool.get_data_page(page * pool.page_size).contiguous().view(-1).view(torch.uint8).clone()
