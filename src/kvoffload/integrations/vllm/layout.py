"""vLLM's KV-cache memory as kvoffload sees it, derived once from the ``KVCacheConfig``.

vLLM 0.32 places every layer's cache in one backing allocation: ``KVCacheTensor``
``t`` puts layer ``t.layers[l]``'s page of block ``b`` at byte ``t.offset + l *
t.layer_stride + b * t.block_stride``, and KV-cache groups overlay each other (a block id
belongs to one group at a time), so two groups' layers may address the same bytes.

``kv_pages`` lists the distinct pages of a block: one ``KVPage`` per distinct
``(start, block stride, page bytes)``, with the layers (and so the groups) that use it.
Memory several groups alias is one page, counted once. Both halves of the connector use it:
the scheduler side for ``host_block_bytes`` (what ``cpu_bytes_to_use`` is divided by and
what lower tiers are sized with), the worker side for ``build_layout`` (byte views of those
pages over the registered backing memory), so the two agree by construction;
``check_layout`` still compares the worker's pool with the scheduler's figure and fails
start-up naming both when they differ.

Pages are raw bytes: attention pages (any spec that gives per-layer views) and the state
pages of layers that lay out the raw allocation themselves (Mamba/GDN) are copied alike.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from vllm.v1.kv_cache_interface import KVCacheConfig, UniformTypeKVCacheSpecs

from kvoffload.transfer import KVLayout


@dataclass(frozen=True)
class KVPage:
    """One distinct page of a block in vLLM's backing allocation."""

    start: int  # byte offset of block 0's page
    block_stride: int  # bytes between consecutive blocks' pages
    page_bytes: int
    layers: tuple[str, ...]  # the layers whose page this is (several when groups alias it)
    groups: tuple[int, ...]  # the KV-cache groups of those layers


def layer_spec(kv_cache_config: KVCacheConfig, group: int, layer: str):
    spec = kv_cache_config.kv_cache_groups[group].kv_cache_spec
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return spec.kv_cache_specs[layer]
    return spec


def kv_pages(kv_cache_config: KVCacheConfig, groups: Sequence[int]) -> list[KVPage]:
    """The distinct pages of the layers of ``groups`` (vLLM group ids), by start offset."""
    group_of = {layer: g for g in groups for layer in kv_cache_config.kv_cache_groups[g].layer_names}
    found: dict[tuple[int, int, int], tuple[list[str], list[int]]] = {}
    for tensor in kv_cache_config.kv_cache_tensors:
        for index, layer in enumerate(tensor.layers):
            g = group_of.get(layer)
            if g is None:
                continue
            page_bytes = layer_spec(kv_cache_config, g, layer).page_size_bytes
            start = tensor.offset + index * tensor.layer_stride
            if page_bytes > tensor.block_stride or start + page_bytes > tensor.size:
                raise ValueError(
                    f"layer {layer!r}: a page of {page_bytes} bytes at {start} does not fit its "
                    f"KV-cache tensor (block stride {tensor.block_stride}, size {tensor.size})"
                )
            layers, page_groups = found.setdefault((start, tensor.block_stride, page_bytes), ([], []))
            layers.append(layer)
            if g not in page_groups:
                page_groups.append(g)
    missing = sorted(set(group_of) - {layer for layers, _ in found.values() for layer in layers})
    if missing:
        raise ValueError(f"no KV-cache tensor places layers {missing}")
    return [
        KVPage(start, stride, page_bytes, tuple(layers), tuple(page_groups))
        for (start, stride, page_bytes), (layers, page_groups) in sorted(found.items())
    ]


def host_block_bytes(
    kv_cache_config: KVCacheConfig, groups: Sequence[int], blocks_per_offload_block: int
) -> int:
    """Host bytes of one offloaded block: every distinct page once, ``F`` times."""
    return sum(page.page_bytes for page in kv_pages(kv_cache_config, groups)) * blocks_per_offload_block


def build_layout(
    kv_caches: Mapping[str, torch.Tensor],
    kv_cache_config: KVCacheConfig,
    groups: Sequence[int],
    num_groups: int,
) -> KVLayout:
    """Byte views of the pages of ``groups`` (the offloaded vLLM group ids) over the memory
    vLLM registered; the layout has ``num_groups`` groups, vLLM's, those not offloaded
    with no tensor.

    Every registered tensor must view the one backing allocation, and every layer with
    per-layer views must start where the config places it (else ``ValueError`` naming the
    layer): the pages are then exactly the bytes the engine reads and writes."""
    if not kv_caches:
        raise ValueError("vLLM registered no KV-cache tensors")
    first = next(iter(kv_caches.values()))
    storage = first.untyped_storage()
    base = storage.data_ptr()
    for name, tensor in kv_caches.items():
        if tensor.untyped_storage().data_ptr() != base:
            raise ValueError(f"layer {name!r} does not view the KV cache's one backing allocation")
    pages = kv_pages(kv_cache_config, groups)
    for page in pages:
        for layer in page.layers:
            tensor = kv_caches.get(layer)
            if tensor is None:
                raise ValueError(f"vLLM registered no KV-cache tensor for layer {layer!r}")
            offset = tensor.data_ptr() - base
            if tensor.numel() * tensor.element_size() < storage.nbytes() and offset != page.start:
                raise ValueError(
                    f"layer {layer!r} starts at byte {offset} of the KV cache, its KV-cache tensor "
                    f"places it at {page.start}"
                )
    num_blocks = kv_cache_config.num_blocks
    views = []
    for page in pages:
        if page.start + (num_blocks - 1) * page.block_stride + page.page_bytes > storage.nbytes():
            raise ValueError(f"layer {page.layers[0]!r}: {num_blocks} blocks overrun the KV cache")
        view = torch.empty(0, dtype=torch.uint8, device=first.device)
        view.set_(storage, page.start, (num_blocks, page.page_bytes), (page.block_stride, 1))
        views.append(view)
    members = [[i for i, page in enumerate(pages) if g in page.groups] for g in range(num_groups)]
    return KVLayout(views, members, ["+".join(page.layers) for page in pages])


def check_layout(layout: KVLayout, expected_block_bytes: int, blocks_per_offload_block: int) -> int:
    """The host bytes of one offloaded block of ``layout``; ``ValueError`` naming both
    figures when they differ from what the scheduler side sized the tiers with."""
    actual = sum(layout.page_bytes(t) for t in range(len(layout.tensors))) * blocks_per_offload_block
    if actual != expected_block_bytes:
        raise ValueError(
            f"the worker's KV layout holds {actual} bytes per offloaded block, the scheduler "
            f"side sized the tiers for {expected_block_bytes}"
        )
    return actual
