"""A tiny, randomly initialised Llama model and tokenizer, built fully offline.

Tests, the demo and the benchmarks need a real model that vLLM can serve without
network access. `build_tiny_llama(path)` writes a `LlamaForCausalLM` (safetensors) and a
byte-level tokenizer into `path` and returns it.

Contract:
- Offline: nothing is downloaded; the tokenizer is constructed in code.
- Deterministic: the same arguments give the same weights (seeded initialisation).
- Idempotent: an existing build made with the same arguments is reused as is; a build
  made with other arguments is replaced. A folder that is not a tiny-model build is
  never touched (a clear error instead).
- Atomic: the build is written into a temporary sibling folder that is renamed into
  place only when complete, so a half-written build is never visible or reused.

The tokenizer maps every byte to one token (ids 3..258 are bytes 0..255, after `<pad>`,
`<s>`, `</s>`), so any text tokenizes, decodes back exactly, and a prompt of N ASCII
characters is N tokens. Ids above 258 are filler tokens `<|extra_i|>` that only exist so
that every id the model can emit decodes. No BOS is added automatically.

Weights use a larger initialiser range than a trained model's so that the logits have
clear margins: greedy decoding then picks the same token even when the engine computes
attention in a different order (a prefix-cache hit vs. a full prefill).

CLI: `python -m kvoffload.demo.tiny_model PATH [--num-layers N ...]`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import uuid
from pathlib import Path
from typing import Any

from kvoffload.validation import positive_int

__all__ = ["build_tiny_llama", "tiny_llama_spec", "MARKER_FILE"]

MARKER_FILE = "kvoffload-tiny-llama.json"
_FORMAT_VERSION = 1
_SPECIALS = ("<pad>", "<s>", "</s>")
_PAD_ID, _BOS_ID, _EOS_ID = 0, 1, 2
_NUM_BYTE_TOKENS = 256
_MIN_VOCAB = len(_SPECIALS) + _NUM_BYTE_TOKENS
_DTYPES = ("float32", "bfloat16", "float16")
_SUPPORTED_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256)
_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def tiny_llama_spec(
    *,
    num_layers: int = 4,
    hidden_size: int = 256,
    num_heads: int = 4,
    num_kv_heads: int = 4,
    intermediate_size: int = 1024,
    vocab_size: int = 512,
    max_position_embeddings: int = 8192,
    seed: int = 0,
    dtype: str = "bfloat16",
    initializer_range: float = 0.1,
    sliding_window: int | None = None,
) -> dict[str, Any]:
    """Validate the build arguments and return them as the build's identity.

    With ``sliding_window`` the model is a hybrid Gemma-3 text model instead: layers
    alternate sliding-window and full attention, so vLLM gives it two KV-cache groups."""
    for name, value in (
        ("num_layers", num_layers),
        ("hidden_size", hidden_size),
        ("num_heads", num_heads),
        ("num_kv_heads", num_kv_heads),
        ("intermediate_size", intermediate_size),
        ("max_position_embeddings", max_position_embeddings),
    ):
        positive_int(name, value)
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size={hidden_size} is not divisible by num_heads={num_heads}")
    head_size = hidden_size // num_heads
    if head_size not in _SUPPORTED_HEAD_SIZES:
        # vLLM's CPU attention backend only has kernels for these head sizes.
        raise ValueError(
            f"head size hidden_size/num_heads = {head_size} is not one vLLM's CPU "
            f"attention supports ({', '.join(map(str, _SUPPORTED_HEAD_SIZES))})"
        )
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not divisible by num_kv_heads={num_kv_heads}")
    if not isinstance(vocab_size, int) or vocab_size < _MIN_VOCAB:
        raise ValueError(
            f"vocab_size must be an integer >= {_MIN_VOCAB} (3 specials + 256 bytes), got {vocab_size!r}"
        )
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {_DTYPES}, got {dtype!r}")
    if not isinstance(seed, int):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    if not initializer_range > 0:
        raise ValueError(f"initializer_range must be > 0, got {initializer_range!r}")
    if sliding_window is not None:
        positive_int("sliding_window", sliding_window)
    return {
        "format": _FORMAT_VERSION,
        "num_layers": num_layers,
        "hidden_size": hidden_size,
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "intermediate_size": intermediate_size,
        "vocab_size": vocab_size,
        "max_position_embeddings": max_position_embeddings,
        "seed": seed,
        "dtype": dtype,
        "initializer_range": float(initializer_range),
        "sliding_window": sliding_window,
    }


def build_tiny_llama(path: str | os.PathLike[str], **kwargs: Any) -> Path:
    """Build (or reuse) a tiny random Llama model + tokenizer in `path`.

    Keyword arguments are those of `tiny_llama_spec`. Returns `path` as a `Path`,
    ready for `vllm.LLM(model=path, tokenizer=path)`.
    """
    return _build(path, tiny_llama_spec(**kwargs), _model_config)


def _build(path: str | os.PathLike[str], spec: dict[str, Any], model_config: Any) -> Path:
    """Build (or reuse) the build identified by `spec` in `path`, atomically.

    `model_config(spec)` gives the (model class, config) pair; `spec` needs ``seed``,
    ``dtype`` and ``vocab_size``."""
    path = Path(path).expanduser().absolute()
    existing = _read_marker(path)
    if existing == spec:
        return path
    # An incomplete or different build of ours (marker file present) is replaced;
    # anything else already there is not ours to delete.
    if path.exists() and not (path / MARKER_FILE).is_file():
        if path.is_dir() and not any(path.iterdir()):
            path.rmdir()
        else:
            raise FileExistsError(
                f"{path} exists and is not a kvoffload tiny-model build "
                f"(no valid {MARKER_FILE}); refusing to overwrite it"
            )

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        _write_build(tmp, spec, model_config(spec))
        _install(tmp, path, spec)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def _read_marker(path: Path) -> dict[str, Any] | None:
    """The spec of a complete build at `path`, or None."""
    try:
        spec = json.loads((path / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return None
    needed = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
    if not all((path / name).is_file() for name in needed):
        return None
    return spec if isinstance(spec, dict) else None


def _install(tmp: Path, path: Path, spec: dict[str, Any]) -> None:
    """Move the finished build into place, replacing an older tiny-model build."""
    try:
        os.rename(tmp, path)
        return
    except OSError:
        if _read_marker(path) == spec:
            return  # another process finished the same build first
        if not path.exists():
            raise
    # An older build with other arguments: swap it out, then delete it.
    old = path.parent / f".{path.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    os.rename(path, old)
    try:
        os.rename(tmp, path)
    finally:
        shutil.rmtree(old, ignore_errors=True)


def _write_build(out: Path, spec: dict[str, Any], model: tuple[type, Any]) -> None:
    import torch
    from transformers import GenerationConfig

    out.mkdir(parents=True)
    model_cls, config = model
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(spec["seed"])
        model = model_cls(config)
    finally:
        torch.random.set_rng_state(generator_state)
    model = model.to(getattr(torch, spec["dtype"]))
    model.generation_config = GenerationConfig(
        bos_token_id=_BOS_ID, eos_token_id=_EOS_ID, pad_token_id=_PAD_ID
    )
    model.save_pretrained(out, safe_serialization=True)
    _build_tokenizer(spec["vocab_size"]).save_pretrained(out)
    for item in out.iterdir():
        item.chmod(0o644)  # the weights are written private; a shared cache needs them readable
    # Written last: its presence marks a complete build.
    (out / MARKER_FILE).write_text(json.dumps(spec, indent=2, sort_keys=True) + "\n")


def _model_config(spec: dict[str, Any]) -> tuple[type, Any]:
    """The model class and config: a Llama, or with ``sliding_window`` a Gemma-3 text
    model whose layers alternate sliding-window and full attention."""
    common = dict(
        vocab_size=spec["vocab_size"],
        hidden_size=spec["hidden_size"],
        intermediate_size=spec["intermediate_size"],
        num_hidden_layers=spec["num_layers"],
        num_attention_heads=spec["num_heads"],
        num_key_value_heads=spec["num_kv_heads"],
        max_position_embeddings=spec["max_position_embeddings"],
        tie_word_embeddings=False,
        pad_token_id=_PAD_ID,
        bos_token_id=_BOS_ID,
        eos_token_id=_EOS_ID,
        dtype=spec["dtype"],
    )
    if spec["sliding_window"] is None:
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(**common, initializer_range=spec["initializer_range"], rms_norm_eps=1e-5)
        return LlamaForCausalLM, config
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    head_dim = spec["hidden_size"] // spec["num_heads"]
    config = Gemma3TextConfig(
        **common,
        head_dim=head_dim,
        query_pre_attn_scalar=head_dim,
        sliding_window=spec["sliding_window"],
        layer_types=[
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(spec["num_layers"])
        ],
        # Gemma scales embeddings by sqrt(hidden): a wider init keeps greedy outputs varied.
        initializer_range=spec["initializer_range"] * 3,
    )
    return Gemma3ForCausalLM, config


def _byte_to_unicode() -> dict[int, str]:
    """The byte-level alphabet: every byte as one printable character (GPT-2 style)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    mapping = {b: chr(b) for b in printable}
    shift = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + shift)
            shift += 1
    return mapping


def _build_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(_SPECIALS)}
    for _, ch in sorted(_byte_to_unicode().items()):
        vocab[ch] = len(vocab)
    for i in range(vocab_size - len(vocab)):
        vocab[f"<|extra_{i}|>"] = len(vocab)
    assert len(vocab) == vocab_size

    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=_SPECIALS[0],
        bos_token=_SPECIALS[1],
        eos_token=_SPECIALS[2],
        model_max_length=1 << 30,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = _CHAT_TEMPLATE
    return tokenizer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvoffload.demo.tiny_model",
        description="Build a tiny random Llama model and tokenizer offline.",
    )
    parser.add_argument("path", help="output folder (reused if already built)")
    defaults = tiny_llama_spec()
    for name in (
        "num_layers",
        "hidden_size",
        "num_heads",
        "num_kv_heads",
        "intermediate_size",
        "vocab_size",
        "max_position_embeddings",
        "seed",
    ):
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=defaults[name])
    parser.add_argument("--dtype", choices=_DTYPES, default=defaults["dtype"])
    parser.add_argument("--initializer-range", type=float, default=defaults["initializer_range"])
    parser.add_argument(
        "--sliding-window", type=int, default=None, help="build a hybrid sliding-window/full-attention model"
    )
    args = vars(parser.parse_args(argv))
    path = args.pop("path")
    try:
        out = build_tiny_llama(path, **args)
    except (ValueError, FileExistsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
