"""KVLayout, block byte views, host pool shapes and spec validation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvoffload.specs import DeviceLoadStoreSpec
from kvoffload.transfer import HostBlockPool, KVLayout, block_byte_view


def test_block_byte_view_reinterprets_without_copy():
    t = torch.arange(6 * 4, dtype=torch.float32).reshape(6, 2, 2)
    view = block_byte_view(t)
    assert view.shape == (6, 16) and view.dtype == torch.uint8
    assert view.data_ptr() == t.data_ptr()
    assert torch.equal(view[3].view(torch.float32), t[3].flatten())


def test_block_byte_view_keeps_padded_block_stride():
    raw = torch.arange(5 * 24, dtype=torch.uint8).reshape(5, 24)
    view = block_byte_view(raw[:, :16])
    assert view.shape == (5, 16) and view.stride() == (24, 1)
    assert torch.equal(view[2], raw[2, :16])


def test_block_byte_view_groups_kernel_blocks():
    raw = torch.arange(8 * 4, dtype=torch.uint8).reshape(8, 4)  # 4 blocks split in 2 kernel blocks
    view = block_byte_view(raw, num_blocks=4)
    assert view.shape == (4, 8) and torch.equal(view[1], raw[2:4].flatten())
    with pytest.raises(ValueError, match="not a multiple of num_blocks=3"):
        block_byte_view(raw, num_blocks=3)


def test_block_byte_view_rejects_non_contiguous_pages():
    t = torch.zeros(3, 4, 5).transpose(0, 1)  # blocks are not the outer dimension
    with pytest.raises(ValueError, match="page must be contiguous"):
        block_byte_view(t)


def test_from_layer_tensors_splits_leading_kv_dimension():
    kv = torch.zeros(2, 7, 3, 4, dtype=torch.float16)
    layout = KVLayout.from_layer_tensors({"l0": kv}, block_dim=1)
    assert layout.names == ("l0[0]", "l0[1]")
    assert [tuple(t.shape) for t in layout.tensors] == [(7, 24), (7, 24)]
    assert layout.groups == ((0, 1),) and layout.group_page_bytes(0) == 48


def test_aliasing_layers_share_one_tensor():
    shared = torch.zeros(4, 8)
    other = torch.zeros(4, 2)
    layout = KVLayout.from_layer_tensors(
        {"a": shared, "b": other, "c": shared}, [["a", "b"], ["c"], ["a", "c"]]
    )
    assert len(layout.tensors) == 2
    assert layout.groups == ((0, 1), (0,), (0,))
    assert layout.group_page_bytes(0) == 40 and layout.group_page_bytes(1) == 32


def test_layout_errors_name_the_problem():
    with pytest.raises(ValueError, match="unknown layer 'nope'"):
        KVLayout.from_layer_tensors({"a": torch.zeros(2, 2)}, [["nope"]])
    with pytest.raises(ValueError, match="group 0 names tensor 3"):
        KVLayout([torch.zeros(2, 2, dtype=torch.uint8)], [[3]])
    with pytest.raises(ValueError, match="uint8 view"):
        KVLayout([torch.zeros(2, 2)])
    with pytest.raises(ValueError, match="block_dim must be 0 or 1"):
        KVLayout.from_layer_tensors({"a": torch.zeros(2, 2)}, block_dim=2)


def test_host_pool_shapes():
    layout = KVLayout.from_layer_tensors({"a": torch.zeros(4, 8), "b": torch.zeros(4, 2)})
    pool = HostBlockPool(layout, 5, blocks_per_offload_block=3)
    assert [tuple(t.shape) for t in pool.tensors] == [(5, 96), (5, 24)]
    assert tuple(pool.sub_blocks(1).shape) == (15, 8)
    assert pool.nbytes == 5 * 3 * 40
    assert pool.pinned == torch.cuda.is_available()
    with pytest.raises(ValueError, match="blocks_per_offload_block must be a positive int, got 0"):
        HostBlockPool(layout, 5, blocks_per_offload_block=0)
    with pytest.raises(ValueError, match="num_host_blocks must be a non-negative int, got -1"):
        HostBlockPool(layout, -1)


def test_device_spec_validation():
    spec = DeviceLoadStoreSpec([5, 6, 7], [2, 0, 1], [4, 0, 9])
    assert spec.medium == "GPU" and spec.num_groups == 3
    assert spec.group_block_ids(0).tolist() == [5, 6] and spec.group_block_ids(1).tolist() == []
    assert spec.block_ids.dtype == np.int64
    with pytest.raises(ValueError, match="group_sizes sum to 2 but 3 block_ids"):
        DeviceLoadStoreSpec([1, 2, 3], [2], [0])
    with pytest.raises(ValueError, match="block_indices has 1 entries but group_sizes has 2"):
        DeviceLoadStoreSpec([1], [1, 0], [0])
    with pytest.raises(ValueError, match="group_sizes must be non-negative, got -1"):
        DeviceLoadStoreSpec([], [1, -1], [0, 0])
    with pytest.raises(ValueError, match="block_indices must be non-negative, got -2"):
        DeviceLoadStoreSpec([1], [1], [-2])


def test_vllm_cpu_hybrid_allocation():
    """The tensors vLLM 0.32 hands register_kv_caches: groups overlay one allocation."""
    pytest.importorskip("vllm")
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
        SlidingWindowSpec,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    nb = 6
    full = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    window = SlidingWindowSpec(
        block_size=32, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, sliding_window=64
    )
    page = full.page_size_bytes
    config = KVCacheConfig(
        num_blocks=nb,
        kv_cache_tensors=[
            KVCacheTensor(
                size=2 * page * nb, layers=["full.0", "full.1"], layer_stride=page * nb, block_stride=page
            ),
            KVCacheTensor(
                size=2 * page * nb, layers=["swa.0", "swa.1"], layer_stride=page * nb, block_stride=page
            ),
        ],
        kv_cache_groups=[
            KVCacheGroupSpec(["full.0", "full.1"], full),
            KVCacheGroupSpec(["swa.0", "swa.1"], window),
        ],
    )
    kv_caches = allocate_kv_cache(config, torch.device("cpu"), KVCacheLayout.LBHNC, [32, 32])
    assert tuple(kv_caches["full.0"].shape) == (nb, 2, 32, 128)  # (blocks, heads, tokens, K|V)
    layout = KVLayout.from_layer_tensors(
        kv_caches, [group.layer_names for group in config.kv_cache_groups], num_blocks=nb
    )
    # Layer i of both groups aliases the same bytes, so there are two tensors, not four.
    assert len(layout.tensors) == 2 and layout.groups == ((0, 1), (0, 1))
    assert all(tuple(t.shape) == (nb, page) for t in layout.tensors)
    kv_caches["swa.1"][3].fill_(1.5)
    assert torch.equal(layout.tensors[1][3], block_byte_view(kv_caches["full.1"])[3])
