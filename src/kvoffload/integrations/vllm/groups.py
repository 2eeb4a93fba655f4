"""vLLM's KV-cache groups as the offloading scheduler sees them: every spec class vLLM
0.32 ships is handled, filtered or refused here, by name, at start-up.

* Filtered (``KVGroup(offloaded=False)``), as vLLM's own offloading connector filters
  them: groups vLLM does not transfer (``enable_kv_transfer=False``) and specs that do not
  take part in prefix caching (``prefix_cacheable`` False: ``CircularBufferSpec``, the
  HiSparse specs, ``SlidingWindowMLASpec`` with bounded replay).
* Handled block by block (every block that is not the null block is stored and loaded):
  ``FullAttentionSpec`` and its subclasses (``MLAAttentionSpec``,
  ``HiddenStateCacheSpec``, ``SinkFullAttentionSpec``, ``RSWASpec``), ``SlidingWindowSpec``
  and ``SlidingWindowMLASpec``, ``ChunkedLocalAttentionSpec``, and
  ``UniformTypeKVCacheSpecs`` of any of these. Positions outside a window are null blocks
  in the engine's block table, so they are skipped.
* Handled as states: ``MambaSpec`` in ``mamba_cache_mode="align"`` (what prefix caching
  selects): one state per offloaded block boundary (``kind="mamba"``).
* Refused (``ValueError`` naming the group and the spec): ``MambaSpec`` in any other mode
  (its states are not kept at block boundaries, so none can be offloaded correctly),
  ``EncoderOnlyAttentionSpec`` and ``CrossAttentionSpec`` (encoder KV is not a prefix of
  the request's tokens), and any spec class not named here.

EAGLE/MTP draft groups (``is_eagle_group``, with vLLM's block drop on) keep their last
whole block out of the tiers while the request decodes (``volatile_tail``), as vLLM does.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.v1 import kv_cache_interface as kvi

from kvoffload.scheduler import KVGroup

logger = logging.getLogger(__name__)

# Checked most specific first: a subclass is named before its parent.
_BLOCKWISE: tuple[tuple[str, str], ...] = (
    ("SlidingWindowMLASpec", "sliding_window"),
    ("SlidingWindowSpec", "sliding_window"),
    ("ChunkedLocalAttentionSpec", "chunked_local_attention"),
    ("HiddenStateCacheSpec", "mla_attention"),
    ("MLAAttentionSpec", "mla_attention"),
    ("SinkFullAttentionSpec", "sink_full_attention"),
    ("RSWASpec", "full_attention"),
    ("FullAttentionSpec", "full_attention"),
)
_REFUSED = ("EncoderOnlyAttentionSpec", "CrossAttentionSpec")


def _base_spec(spec: Any) -> Any:
    if isinstance(spec, kvi.UniformTypeKVCacheSpecs):
        return next(iter(spec.kv_cache_specs.values()))
    return spec


def _uses_eagle_block_drop(vllm_config: Any) -> bool:
    spec_config = getattr(vllm_config, "speculative_config", None)
    if spec_config is None:
        return False
    drop = getattr(spec_config, "use_eagle_block_drop", None)
    return bool(drop()) if callable(drop) else False


def kv_groups(vllm_config: Any, kv_cache_config: Any) -> list[KVGroup]:
    """One ``KVGroup`` per vLLM group, in vLLM's order (its group ids key the blocks)."""
    eagle_drop = _uses_eagle_block_drop(vllm_config)
    groups = []
    for g, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = _base_spec(group.kv_cache_spec)
        name = type(spec).__name__
        transferred = getattr(group, "enable_kv_transfer", True) and group.kv_cache_spec.prefix_cacheable
        if not transferred:
            groups.append(KVGroup(spec.block_size, "not_offloaded", offloaded=False))
            continue
        if isinstance(spec, kvi.MambaSpec):
            mode = getattr(spec, "mamba_cache_mode", "none")
            if mode != "align":
                raise ValueError(
                    f"KVOffloadConnector: group {g} is MambaSpec with mamba_cache_mode={mode!r}: its "
                    "states are not kept at block boundaries, so none can be offloaded (enable prefix "
                    "caching, which selects 'align')"
                )
            groups.append(KVGroup(spec.block_size, "mamba"))
            continue
        kind = _blockwise_kind(spec)
        if kind is None:
            raise ValueError(
                f"KVOffloadConnector does not offload group {g}: {name} is not a KV-cache spec it "
                "supports (see kvoffload.integrations.vllm.groups)"
            )
        window = getattr(spec, "sliding_window", None) if kind == "sliding_window" else None
        volatile = eagle_drop and getattr(group, "is_eagle_group", False)
        groups.append(KVGroup(spec.block_size, kind, window, volatile_tail=volatile))
    return groups


def _blockwise_kind(spec: Any) -> str | None:
    """The event kind of a block-by-block spec; a subclass vLLM adds after 0.32 is handled
    as its nearest parent named in ``_BLOCKWISE`` (with a warning)."""
    name = type(spec).__name__
    if name in _REFUSED:
        return None
    for cls_name, kind in _BLOCKWISE:
        if name == cls_name:
            return kind
    for cls_name, kind in _BLOCKWISE:
        cls = getattr(kvi, cls_name, None)
        if cls is not None and isinstance(spec, cls):
            logger.warning("kvoffload: KV-cache spec %s is handled as its parent %s", name, cls_name)
            return kind
    return None
