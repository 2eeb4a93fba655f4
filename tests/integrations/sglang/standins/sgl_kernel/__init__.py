"""Stand-in for ``sgl_kernel`` in kvoffload's SGLang test environment (``.venv/sglang``).

Why: ``sgl_kernel`` is SGLang's compiled kernel package. Its registry wheel (as
``sglang-kernel``) ships sm90/sm100 CUDA builds only and fails to import on a CPU machine
(``No module named 'common_ops'``), and installing it pulls the CUDA 13 stack; its CPU
build is not on the registry. SGLang 0.5.23's CPU engine (``SGLANG_USE_CPU_ENGINE=1``,
which the tests run) imports a few of its ``*_cpu`` ops at module import time, whatever
the model, and calls one of them on every prefill.

What: the names SGLang's CPU path imports from ``sgl_kernel`` (found by importing the
engine, scheduler, model runner, host pools and the Llama and DeepSeek-V2 models):

- ``assign_req_to_token_pool_cpu``, which the scheduler calls for every batch it extends
  (``sglang.srt.mem_cache.allocation``), in torch;
- the rest, imported by speculative decoding and KV-move modules that these tests never
  run, as placeholders that raise ``NotImplementedError`` naming the op when called.

Nothing else: there is no module ``__getattr__``, so ``from sgl_kernel import X`` for
any other name still raises ``ImportError``, and SGLang's ``try``/``except ImportError``
fallbacks choose their non-CUDA paths as they would without the package. The host-device
KV copies of ``sgl_kernel.kvcacheio`` are stood in for inside SGLang's host-pool modules
instead (``tests/integrations/sglang/engine_standins.py``).
"""

from __future__ import annotations

import torch

__version__ = "0.0.0+kvoffload.standin"


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """For request ``i`` of the batch, writes the next ``end_offset[i] - start_offset[i]``
    entries of ``out_cache_loc`` (requests' slots back to back, in batch order) into row
    ``req_pool_indices[i]`` of ``req_to_token``, columns ``start_offset[i]:end_offset[i]``
    (the token-to-KV-slot map of each request; SGLang's triton kernel
    ``assign_req_to_token_pool`` does the same on accelerators)."""
    del pool_len
    offset = 0
    for row, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        count = end - start
        if count > 0:
            req_to_token[row, start:end] = out_cache_loc[offset : offset + count].to(req_to_token.dtype)
        offset += count


def _unavailable(name: str):
    def op(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} is not available in kvoffload's SGLang test environment "
            "(tests/integrations/sglang/standins/sgl_kernel is a stand-in)"
        )

    op.__name__ = op.__qualname__ = name
    return op


# imported at module level by SGLang's CPU path, never called by the tests' engines
copy_all_layer_kv_cache_cpu = _unavailable("copy_all_layer_kv_cache_cpu")
build_tree_kernel_efficient_cpu = _unavailable("build_tree_kernel_efficient_cpu")
verify_tree_greedy_cpu = _unavailable("verify_tree_greedy_cpu")
assign_draft_cache_locs_contiguous_cpu = _unavailable("assign_draft_cache_locs_contiguous_cpu")
assign_extend_cache_locs_cpu = _unavailable("assign_extend_cache_locs_cpu")
fill_accept_out_cache_loc_cpu = _unavailable("fill_accept_out_cache_loc_cpu")
fill_bonus_tokens_cpu = _unavailable("fill_bonus_tokens_cpu")
