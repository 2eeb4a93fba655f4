"""The vLLM-side layout helpers, on tensors shaped as vLLM registers them."""

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")
from kvoffload.integrations.vllm.layout import build_layout, host_block_bytes  # noqa: E402


def config(num_blocks, layers, tensor_bytes):
    return SimpleNamespace(
        num_blocks=num_blocks,
        kv_cache_groups=[SimpleNamespace(layer_names=layers)],
        kv_cache_tensors=[SimpleNamespace(size=tensor_bytes)],
    )


def test_block_first_layers_become_one_tensor_each():
    caches = {f"l{i}": torch.zeros(10, 4, 16, 8) for i in range(3)}
    layout = build_layout(caches, config(10, list(caches), 3 * 10 * 4 * 16 * 8 * 4))
    assert len(layout.tensors) == 3 and layout.groups == ((0, 1, 2),)
    assert [layout.page_bytes(t) for t in range(3)] == [4 * 16 * 8 * 4] * 3


def test_kv_leading_dimension_is_split_into_k_and_v_tensors():
    caches = {f"l{i}": torch.zeros(2, 10, 16, 4, 8) for i in range(2)}
    layout = build_layout(caches, config(10, list(caches), 2 * 2 * 10 * 16 * 4 * 8 * 4))
    assert len(layout.tensors) == 4
    assert all(layout.num_blocks(t) == 10 for t in range(4))


def test_host_block_bytes_is_a_page_of_every_tensor_times_f():
    cfg = config(512, ["a"], 64 << 20)
    assert host_block_bytes(cfg, 1) == (64 << 20) // 512
    assert host_block_bytes(cfg, 4) == 4 * ((64 << 20) // 512)
