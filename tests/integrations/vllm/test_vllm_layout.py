"""The host block's bytes and the worker's layout, derived from vLLM's own ``KVCacheConfig``
objects over memory allocated by vLLM's own ``allocate_kv_cache``: groups that alias one
allocation count once, the byte views are exactly the pages the engine's layer views use,
and the scheduler's figure and the worker's pool agree or start-up fails naming both."""

import pytest
import torch

pytest.importorskip("vllm")
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

from kvoffload.integrations.vllm.layout import (  # noqa: E402
    build_layout,
    check_layout,
    host_block_bytes,
    kv_pages,
)

BLOCKS = 6
FULL = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32)
SLIDING = SlidingWindowSpec(
    block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32, sliding_window=64
)
PAGE = FULL.page_size_bytes  # 2 heads x 32 tokens x (32 + 32) x 4 bytes = 16 KiB


def layer_outermost(layers_per_tensor, page=PAGE):
    """Tensors over one allocation, each placing its layers one after another, all at
    offset 0 (so the i-th layer of every tensor aliases the same bytes), as vLLM does."""
    size = max(len(layers) for layers in layers_per_tensor) * page * BLOCKS
    return [KVCacheTensor(size, list(layers), page * BLOCKS, page) for layers in layers_per_tensor]


def dense_config():
    layers = [f"l{i}" for i in range(3)]
    return KVCacheConfig(BLOCKS, layer_outermost([layers]), [KVCacheGroupSpec(layers, FULL)])


def hybrid_config():
    """Gemma-3-like: sliding-window layers 0 and 2, full layers 1 and 3, the two groups
    overlaid on one allocation."""
    groups = [KVCacheGroupSpec(["l0", "l2"], SLIDING), KVCacheGroupSpec(["l1", "l3"], FULL)]
    return KVCacheConfig(BLOCKS, layer_outermost([["l0", "l2"], ["l1", "l3"]]), groups)


def allocate(config):
    return allocate_kv_cache(config, torch.device("cpu"), KVCacheLayout.LBHNC)


def test_dense_host_block_is_a_page_of_every_layer_times_f():
    config = dense_config()
    assert host_block_bytes(config, [0], 1) == 3 * PAGE
    assert host_block_bytes(config, [0], 4) == 12 * PAGE


def test_groups_that_alias_one_allocation_count_once():
    config = hybrid_config()
    # the sum of the tensors' sizes per block would be 4 pages: the groups overlay
    assert sum(t.size // BLOCKS for t in config.kv_cache_tensors) == 4 * PAGE
    assert host_block_bytes(config, [0, 1], 1) == 2 * PAGE
    pages = kv_pages(config, [0, 1])
    assert [(p.layers, p.groups) for p in pages] == [(("l0", "l1"), (0, 1)), (("l2", "l3"), (0, 1))]


@pytest.mark.parametrize("make", [dense_config, hybrid_config])
def test_layout_views_are_the_pages_the_layers_use(make):
    config = make()
    caches = allocate(config)
    groups = list(range(len(config.kv_cache_groups)))
    layout = build_layout(caches, config, groups, len(groups))
    assert check_layout(layout, host_block_bytes(config, groups, 1), 1) == host_block_bytes(config, groups, 1)
    pages = kv_pages(config, groups)
    for t, page in enumerate(pages):
        for b in range(BLOCKS):
            # write through the engine's view of the page's last layer, read the layout row
            caches[page.layers[-1]][b].fill_(float(10 * t + b + 1))
        expected = torch.stack(
            [caches[page.layers[-1]][b].reshape(-1).view(torch.uint8) for b in range(BLOCKS)]
        )
        assert torch.equal(layout.tensors[t], expected)
    for g in groups:  # every group names the pages of its layers
        assert {layout.names[i] for i in layout.groups[g]} == {
            "+".join(p.layers) for p in pages if g in p.groups
        }


def test_a_group_not_offloaded_has_no_pages_in_the_host_block():
    config = hybrid_config()
    layout = build_layout(allocate(config), config, [1], 2)
    assert layout.groups[0] == ()  # vLLM group 0 kept by the engine, not offloaded
    assert check_layout(layout, host_block_bytes(config, [1], 1), 1) == 2 * PAGE


def test_mamba_state_pages_are_raw_bytes_of_the_allocation():
    """A Mamba layer lays out its page itself; its state page is copied as bytes."""
    mamba = MambaSpec(
        block_size=32, shapes=((3, 16), (2, 8, 8)), dtypes=(torch.float32, torch.float32),
        page_size_padded=PAGE, mamba_cache_mode="align",
    )  # fmt: skip
    groups = [KVCacheGroupSpec(["m0", "m2"], mamba), KVCacheGroupSpec(["a1", "a3"], FULL)]
    config = KVCacheConfig(BLOCKS, layer_outermost([["m0", "m2"], ["a1", "a3"]]), groups)
    caches = allocate(config)
    layout = build_layout(caches, config, [0, 1], 2)
    assert check_layout(layout, host_block_bytes(config, [0, 1], 1), 1) == 2 * PAGE
    base = caches["a1"].untyped_storage()
    raw = torch.empty(0, dtype=torch.uint8).set_(base, 0, (base.nbytes(),), (1,))
    raw[PAGE * BLOCKS + 3 * PAGE : PAGE * BLOCKS + 4 * PAGE] = 7  # block 3 of layer m2 / a3
    assert bool((layout.tensors[1][3] == 7).all()) and not bool((layout.tensors[1][2] == 7).any())


def test_disagreement_between_the_two_sides_names_both_figures():
    config = hybrid_config()
    layout = build_layout(allocate(config), config, [0, 1], 2)
    with pytest.raises(ValueError, match=r"holds 32768 bytes .* sized the tiers for 65536"):
        check_layout(layout, 4 * PAGE, 1)


def test_a_layer_that_is_not_where_its_tensor_places_it_is_named():
    config = hybrid_config()
    caches = allocate(config)
    caches["l2"], caches["l0"] = caches["l0"], caches["l2"]
    with pytest.raises(ValueError, match="layer 'l0' starts at byte"):
        build_layout(caches, config, [0, 1], 2)
