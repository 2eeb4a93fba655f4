"""The identity of an offloaded block's bytes: what the lower tiers key their namespace on.

Built from explicit fields, never from ``repr``: a vLLM release that adds a field to a
spec class (0.34 adds ``is_draft``, ``kv_head_major_slots``, ...) leaves the identity of
an unchanged configuration as it was, so a disk or Redis cache written before an upgrade
is served after it. A field counts only when it says something about the bytes; fields
left at their neutral value (``None``, ``False``, 0, an unquantised cache, ``head_size_v
== head_size``) are left out, so a release that adds one with a neutral default changes
nothing either.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Sequence
from typing import Any

from vllm.v1.kv_cache_interface import KVCacheConfig

from kvoffload.integrations.vllm.layout import kv_pages, layer_spec

# What changes the bytes of a block of a spec, for every spec class vLLM ships.
SPEC_FIELDS = (
    "block_size",
    "num_kv_heads",
    "head_size",
    "head_size_v",
    "dtype",
    "kv_quant_mode",
    "cache_dtype_str",
    "sliding_window",
    "attention_chunk_size",
    "num_head_slots",
    "state_content_bytes",
    "tokens_per_state",
    "page_size_padded",
    "shapes",
    "dtypes",
    "mamba_type",
    "kv_head_major_slots",
)


def _plain(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    return str(value)  # torch dtypes, fractions


def _neutral(name: str, value: Any, spec: Any) -> bool:
    if value is None or value is False:
        return True
    if name == "kv_quant_mode":
        return _plain(value) == "NONE"
    if name == "head_size_v":
        return value == getattr(spec, "head_size", None)
    if name == "tokens_per_state":
        return value == 1
    return False


def spec_identity(spec: Any) -> dict[str, Any]:
    """A spec's class name and the fields of ``SPEC_FIELDS`` it has with a non-neutral
    value, plus its page bytes."""
    identity: dict[str, Any] = {"kind": type(spec).__name__}
    for name in SPEC_FIELDS:
        value = getattr(spec, name, None)
        if not _neutral(name, value, spec):
            identity[name] = _plain(value)
    identity["page_bytes"] = spec.page_size_bytes
    return identity


def kv_identity(
    vllm_config: Any, kv_cache_config: KVCacheConfig, groups: Sequence[int], blocks_per_offload_block: int
) -> dict:
    """Everything that changes the bytes of an offloaded block: model, cache dtype, each
    offloaded group's spec (per layer), the pages of a block in the order the host pool
    lays them out (sizes and the layers in each), the offloaded block size, the block-hash
    algorithm and seed, and the tensor-parallel size."""
    group_specs = []
    for g in groups:
        group = kv_cache_config.kv_cache_groups[g]
        group_specs.append(
            {
                "group": g,
                "layers": [
                    {"name": layer, **spec_identity(layer_spec(kv_cache_config, g, layer))}
                    for layer in group.layer_names
                ],
            }
        )
    pages = [[page.page_bytes, list(page.layers)] for page in kv_pages(kv_cache_config, groups)]
    return {
        "model": str(vllm_config.model_config.model),
        "cache_dtype": str(vllm_config.cache_config.cache_dtype),
        "groups": group_specs,
        "pages": pages,
        "blocks_per_offload_block": blocks_per_offload_block,
        "layout": "LBHNC",  # inside each page: what get_required_kvcache_layout asks vLLM for
        "hash": [str(vllm_config.cache_config.prefix_caching_hash_algo), os.environ.get("PYTHONHASHSEED")],
        "tensor_parallel_size": vllm_config.parallel_config.tensor_parallel_size,
    }
