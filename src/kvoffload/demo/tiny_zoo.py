"""Tiny random models of several families, built offline, for end-to-end tests.

`build_tiny_model(path, family, seed=0)` writes one model of `family` and the byte-level
tokenizer of `kvoffload.demo.tiny_model` into `path` and returns it, with the contract of
`build_tiny_llama`: offline, deterministic (seeded), idempotent (the same family and seed
is reused, another build of ours replaced, a foreign folder refused) and atomic.
`engine_args(family)` gives the extra `kvoffload.demo.offline.make_llm` arguments the
family needs on vLLM's CPU build. Each family gives vLLM another KV-cache layout; all
have vocab 512 and KV-cache block size 32 there:

- ``llama``: full attention only (`build_tiny_llama` defaults).
- ``sliding_window``: Gemma-3 text model (`build_tiny_llama` with sliding_window 64),
  a sliding-window and a full-attention group.
- ``mla``: DeepSeek-V2, multi-head latent attention (kv_lora_rank 512 + qk_rope_head_dim
  64 = 576), dense MLPs; one MLAAttentionSpec group. Runs in bfloat16: vLLM's AMX MLA
  where the CPU has AMX; elsewhere its reference CPU_MLA backend, for which vLLM turns the
  prefix cache off and uses block size 16 (kvoffload's loads still work there).
- ``gdn``: Qwen3-Next, three gated-delta-net layers (one MambaSpec group each) and one
  full-attention layer, MoE MLPs (4 experts, 2 per token). Runs in bfloat16.
- ``mamba2`` (`BUILD_ONLY`): Granite-4.0-H (GraniteMoeHybrid), three Mamba2 layers and one
  full-attention layer. vLLM 0.32's CPU build fails its first prefill with prefix caching
  on (the CPU chunk scan returns no per-chunk states for the align-mode checkpoint).

`FAMILIES` are the families that run under `make_llm`. Initialiser ranges are chosen so
that greedy outputs of different prompts are varied, not one repeated token. In bfloat16
a prefix-cache hit and a full prefill of the same prompt may still pick different tokens
for ``mla`` (its cached-context path rounds differently); two hits of the same length
agree.

CLI: `python -m kvoffload.demo.tiny_zoo PATH FAMILY [--seed N]`.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from pathlib import Path
from typing import Any

from kvoffload.demo.tiny_model import _BOS_ID, _EOS_ID, _PAD_ID, _build, build_tiny_llama

__all__ = ["BUILD_ONLY", "FAMILIES", "build_tiny_model", "engine_args", "tiny_model_spec"]

FAMILIES = ("llama", "sliding_window", "mla", "gdn")
BUILD_ONLY = ("mamba2",)
# `make_llm` arguments a family needs on vLLM's CPU build: its GDN kernel and AMX MLA
# (the only CPU MLA that keeps prefix caching on) compute in bfloat16 only, and its
# rotary-embedding op mis-rotates MLA's 3-D multi-head q_pe (depending on the batch), so
# MLA takes the op's native PyTorch version.
_ENGINE_ARGS: dict[str, dict[str, Any]] = {
    "mla": {"dtype": "bfloat16", "compilation_config": {"custom_ops": ["-rotary_embedding"]}},
    "gdn": {"dtype": "bfloat16"},
}
_FORMAT_VERSION = 1
_VOCAB = 512
_HIDDEN = 256

# Per family: the transformers config and model class names and the config arguments
# beyond those `_model_config` sets for all.
_FAMILY_CONFIGS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "mla": (
        "DeepseekV2Config",
        "DeepseekV2ForCausalLM",
        dict(
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            intermediate_size=512,
            q_lora_rank=None,
            kv_lora_rank=512,
            qk_rope_head_dim=64,
            qk_nope_head_dim=64,
            v_head_dim=64,
            head_dim=64,
            first_k_dense_replace=2,  # every layer dense: the expert settings are unused
            n_routed_experts=4,
            n_shared_experts=1,
            num_experts_per_tok=2,
            moe_intermediate_size=128,
            initializer_range=0.1,
        ),
    ),
    "gdn": (
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        dict(
            num_hidden_layers=4,
            layer_types=["linear_attention"] * 3 + ["full_attention"],
            num_attention_heads=8,
            num_key_value_heads=8,
            head_dim=128,
            intermediate_size=512,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            # One small GDN state per layer, padded to the attention page of 32 tokens
            # (8 KV heads x 128): vLLM's attention block size stays 32.
            linear_num_key_heads=1,
            linear_num_value_heads=1,
            linear_conv_kernel_dim=4,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=256,
            shared_expert_intermediate_size=256,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            initializer_range=0.1,
        ),
    ),
    "mamba2": (
        "GraniteMoeHybridConfig",
        "GraniteMoeHybridForCausalLM",
        dict(
            num_hidden_layers=4,
            layer_types=["linear_attention"] * 3 + ["full_attention"],
            num_attention_heads=4,
            num_key_value_heads=4,
            intermediate_size=512,
            shared_intermediate_size=512,
            num_local_experts=0,  # dense MLPs only
            position_embedding_type="rope",
            mamba_n_heads=8,
            mamba_d_head=64,
            mamba_n_groups=1,
            mamba_d_state=16,  # a Mamba2 state that fits an attention page of 32 tokens
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_chunk_size=256,
            initializer_range=0.1,
        ),
    ),
}


def tiny_model_spec(family: str, seed: int = 0) -> dict[str, Any]:
    """The build's identity (stored in the marker file) for a family other than the
    Llama/Gemma ones that `tiny_model.tiny_llama_spec` describes."""
    if family not in _FAMILY_CONFIGS:
        raise ValueError(f"family must be one of {tuple(_FAMILY_CONFIGS)}, got {family!r}")
    if not isinstance(seed, int):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    config_cls, model_cls, config = _FAMILY_CONFIGS[family]
    return {
        "format": _FORMAT_VERSION,
        "family": family,
        "config_class": config_cls,
        "model_class": model_cls,
        "config": dict(config),
        "vocab_size": _VOCAB,
        "seed": seed,
        "dtype": engine_args(family).get("dtype", "float32"),
    }


def engine_args(family: str) -> dict[str, Any]:
    """Extra `kvoffload.demo.offline.make_llm` keyword arguments `family` needs."""
    if family not in FAMILIES + BUILD_ONLY:
        raise ValueError(f"family must be one of {FAMILIES + BUILD_ONLY}, got {family!r}")
    return copy.deepcopy(_ENGINE_ARGS.get(family, {}))


def build_tiny_model(path: str | os.PathLike[str], family: str, seed: int = 0) -> Path:
    """Build (or reuse) a tiny random model of `family` + tokenizer in `path`; returns
    `path` as a `Path`, ready for `vllm.LLM(model=path, tokenizer=path)`."""
    if family not in FAMILIES + BUILD_ONLY:
        raise ValueError(f"family must be one of {FAMILIES + BUILD_ONLY}, got {family!r}")
    if family == "llama":
        return build_tiny_llama(path, seed=seed)
    if family == "sliding_window":
        # The default range (0.1) lets greedy decoding of some prompts cycle on 2-3 tokens.
        return build_tiny_llama(path, seed=seed, sliding_window=64, initializer_range=0.2)
    return _build(path, tiny_model_spec(family, seed), _model_config)


def _model_config(spec: dict[str, Any]) -> tuple[type, Any]:
    import transformers

    config_cls = getattr(transformers, spec["config_class"])
    model_cls = getattr(transformers, spec["model_class"])
    config = config_cls(
        **spec["config"],
        vocab_size=spec["vocab_size"],
        hidden_size=_HIDDEN,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        pad_token_id=_PAD_ID,
        bos_token_id=_BOS_ID,
        eos_token_id=_EOS_ID,
        dtype=spec["dtype"],
    )
    return model_cls, config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvoffload.demo.tiny_zoo",
        description="Build a tiny random model of one family and its tokenizer offline.",
    )
    parser.add_argument("path", help="output folder (reused if already built)")
    parser.add_argument("family", choices=FAMILIES + BUILD_ONLY)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        out = build_tiny_model(args.path, args.family, seed=args.seed)
    except (ValueError, FileExistsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
