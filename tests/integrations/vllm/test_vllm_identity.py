"""The lower tiers' namespace comes from explicit spec fields: a vLLM release that adds a
field to a spec class (0.34 adds ``is_draft`` and ``kv_head_major_slots``, with neutral
defaults) leaves it unchanged, while every field that changes a block's bytes changes it."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

from kvoffload.integrations.vllm.identity import kv_identity, spec_identity  # noqa: E402
from kvoffload.tiers.identity import canonical_identity  # noqa: E402

VLLM_CONFIG = SimpleNamespace(
    model_config=SimpleNamespace(model="tiny"),
    cache_config=SimpleNamespace(cache_dtype="auto", prefix_caching_hash_algo="sha256_cbor"),
    parallel_config=SimpleNamespace(tensor_parallel_size=1),
)


def with_extra_fields(cls):
    """The same class as a later vLLM ships it: same name, two more fields."""
    return dataclasses.make_dataclass(
        cls.__name__,
        [
            ("is_draft", bool, dataclasses.field(default=False, kw_only=True)),
            ("kv_head_major_slots", bool, dataclasses.field(default=False, kw_only=True)),
        ],
        bases=(cls,),
        frozen=True,
    )


def full(cls=FullAttentionSpec, **kw):
    return cls(**{"block_size": 32, "num_kv_heads": 2, "head_size": 64, "dtype": torch.float32, **kw})


def config(spec):
    page = spec.page_size_bytes
    return KVCacheConfig(8, [KVCacheTensor(8 * 2 * page, ["a", "b"], 8 * page, page)],
                         [KVCacheGroupSpec(["a", "b"], spec)])  # fmt: skip


def test_a_spec_class_with_an_added_field_keeps_the_identity():
    old, new = full(), full(with_extra_fields(FullAttentionSpec))
    assert type(new).__name__ == type(old).__name__ and repr(new) != repr(old)
    assert spec_identity(new) == spec_identity(old)
    # what the disk and Redis tiers key their namespace on: the same text
    assert canonical_identity(kv_identity(VLLM_CONFIG, config(new), [0], 1)) == canonical_identity(
        kv_identity(VLLM_CONFIG, config(old), [0], 1)
    )


def test_an_added_field_set_away_from_its_neutral_value_changes_it():
    new = full(with_extra_fields(FullAttentionSpec), kv_head_major_slots=True)
    assert spec_identity(new) != spec_identity(full())


@pytest.mark.parametrize(
    "changed",
    [
        full(block_size=64),
        full(num_kv_heads=4),
        full(head_size=32),
        full(dtype=torch.bfloat16),
        full(head_size_v=32),
        full(page_size_padded=64 * 1024),
        full(SlidingWindowSpec, sliding_window=128),
        MLAAttentionSpec(block_size=32, num_kv_heads=1, head_size=576, dtype=torch.float32),
        MambaSpec(block_size=32, shapes=((4, 8),), dtypes=(torch.float32,)),
    ],
    ids=lambda s: type(s).__name__,
)
def test_every_field_that_changes_the_bytes_changes_it(changed):
    assert spec_identity(changed) != spec_identity(full())


def test_mamba_state_shapes_and_dtypes_are_part_of_it():
    a = MambaSpec(block_size=32, shapes=((4, 8), (2, 8)), dtypes=(torch.float32, torch.float32))
    b = MambaSpec(block_size=32, shapes=((4, 8), (2, 8)), dtypes=(torch.float32, torch.bfloat16))
    c = MambaSpec(block_size=32, shapes=((4, 8), (8, 2)), dtypes=(torch.float32, torch.float32))
    assert len({str(spec_identity(s)) for s in (a, b, c)}) == 3
