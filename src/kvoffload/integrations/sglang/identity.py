"""The identity of SGLang's pages: what the tiers' namespaces are derived from.

Everything that changes the bytes of a page goes in, from explicit fields: the engine
(``"sglang"``, so an SGLang engine and a vLLM engine never read each other's blocks even
for one model: their layouts and keys differ), the model, the pool kind (MHA or MLA), its
layout and the shape of one page (page size, layers, heads, head size, dtype), and which
part of the model's KV a rank holds: its tensor-parallel rank and size for MHA (each rank
holds its heads), the pipeline stage (its layers), the context-parallel and decode
context-parallel shard. MLA's KV is the same on every tensor-parallel rank: one namespace
for all of them (SGLang lets only the first rank of each DCP group write it, and every rank
read it). ``namespace_extra`` is what the user adds (e.g. a quantisation SGLang does not
report). Data-parallel replicas hold the same bytes for the same tokens and share pages.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvoffload.integrations.sglang.pages import PageViews

IDENTITY_VERSION = 1


def _field(config: Any, name: str, default: Any = None) -> Any:
    return getattr(config, name, default)


def page_identity(config: Any, views: PageViews, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The identity of one rank's pages, from SGLang's ``HiCacheStorageConfig`` (``config``)
    and the views of its host pool."""
    if _field(config, "should_split_heads", False):
        raise ValueError(
            "HiCacheStorageConfig.should_split_heads is set (ranks of different head counts share pages): "
            "not supported by kvoffload's SGLang backend"
        )
    identity: dict[str, Any] = {
        "engine": "sglang",
        "version": IDENTITY_VERSION,
        "model": _field(config, "model_name") or "",
        "pool": views.kind,
        "layout": views.layout,
        "page_size": views.page_size,
        "dtype": views.dtype,
        "page_shape": [n for i, n in enumerate(views.shape) if i != views.axis],
        "page_bytes": views.block_bytes,
        "pp": [int(_field(config, "pp_rank", 0)), int(_field(config, "pp_size", 1))],
    }
    if views.kind == "mha":
        identity["tp"] = [int(_field(config, "tp_rank", 0)), int(_field(config, "tp_size", 1))]
    cp_size = int(_field(config, "attn_cp_size", 1) or 1)
    if cp_size > 1:
        identity["attn_cp"] = [int(_field(config, "attn_cp_rank", 0)), cp_size]
    dcp_size = int(_field(config, "dcp_size", 1) or 1)
    if dcp_size > 1:
        identity["dcp"] = [int(_field(config, "dcp_rank", 0)), dcp_size]
    if extra:
        identity["extra"] = dict(extra)
    return identity


def ranks_sharing_budget(config: Any, views: PageViews) -> int:
    """How many processes' pages share a tier's ``bytes_to_use``: the tensor-parallel ranks
    for MHA (each holds its own heads' share of every page), one for MLA (one writer)."""
    return int(_field(config, "tp_size", 1) or 1) if views.kind == "mha" else 1


def is_writer(config: Any) -> bool:
    """Whether this rank writes pages (SGLang's ``is_storage_writer``; every rank before
    that property existed)."""
    writer = getattr(config, "is_storage_writer", True)
    return bool(writer)
