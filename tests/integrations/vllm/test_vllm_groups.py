"""Every KV-cache spec class of the installed vLLM is handled, filtered or refused by name at
start-up. The classes are enumerated from vLLM's module, so a class a new release adds
fails here until it is classified."""

import dataclasses
import inspect
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")
from vllm.v1 import kv_cache_interface as kvi  # noqa: E402

from kvoffload.integrations.vllm.groups import kv_groups  # noqa: E402

REFUSED = "refused"
# spec class -> what the connector does with a group of it: the event kind it offloads it
# as, "not_offloaded" (filtered as vLLM filters it), or refused at start-up
EXPECTED = {
    "FullAttentionSpec": "full_attention",
    "MLAAttentionSpec": "mla_attention",
    "HiddenStateCacheSpec": "mla_attention",
    "SinkFullAttentionSpec": "sink_full_attention",
    "RSWASpec": "full_attention",
    "SlidingWindowSpec": "sliding_window",
    "SlidingWindowMLASpec": "sliding_window",
    "ChunkedLocalAttentionSpec": "chunked_local_attention",
    "MambaSpec": "mamba",
    "UniformTypeKVCacheSpecs": "full_attention",
    "CircularBufferSpec": "not_offloaded",
    "HiSparseHotSpec": "not_offloaded",
    "HiSparseResidentSpec": "not_offloaded",
    "EncoderOnlyAttentionSpec": REFUSED,
    "CrossAttentionSpec": REFUSED,
    "AttentionSpec": REFUSED,
    "KVCacheSpec": REFUSED,
}
VALUES = dict(
    block_size=32, num_kv_heads=1, head_size=64, dtype=torch.float32, attention_chunk_size=64,
    sliding_window=64, rswa_window=64, page_size=4096, blocks_per_request=4, shapes=((2, 4),),
    dtypes=(torch.float32,),
)  # fmt: skip
NO_SPEC_DRAFTS = SimpleNamespace(speculative_config=None)


def spec_classes():
    return [
        cls
        for _, cls in inspect.getmembers(kvi, inspect.isclass)
        if issubclass(cls, kvi.KVCacheSpec) and cls.__module__ == kvi.__name__
    ]


def instance(cls):
    if cls is kvi.UniformTypeKVCacheSpecs:
        full = kvi.FullAttentionSpec(
            **{k: VALUES[k] for k in ("block_size", "num_kv_heads", "head_size", "dtype")}
        )
        return cls(block_size=32, kv_cache_specs={"a": full, "b": full})
    required = {
        f.name: VALUES[f.name]
        for f in dataclasses.fields(cls)
        if f.init and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    }
    if cls is kvi.MambaSpec:
        required["mamba_cache_mode"] = "align"  # what prefix caching selects
    return cls(**required)


def config(spec, **group):
    return SimpleNamespace(kv_cache_groups=[kvi.KVCacheGroupSpec(["a"], spec, **group)])


def test_every_spec_class_vllm_ships_is_classified():
    assert sorted(cls.__name__ for cls in spec_classes()) == sorted(EXPECTED)


@pytest.mark.parametrize("cls", spec_classes(), ids=lambda cls: cls.__name__)
def test_spec_class_is_handled_filtered_or_refused_by_name(cls):
    expected = EXPECTED[cls.__name__]
    if expected == REFUSED:
        with pytest.raises(ValueError, match=f"group 0: {cls.__name__} is not a KV-cache spec it supports"):
            kv_groups(NO_SPEC_DRAFTS, config(instance(cls)))
        return
    (group,) = kv_groups(NO_SPEC_DRAFTS, config(instance(cls)))
    assert group.kind == expected
    assert group.offloaded == (expected != "not_offloaded")
    assert group.block_size == 32


def test_groups_vllm_does_not_transfer_are_filtered():
    full = instance(kvi.FullAttentionSpec)
    (group,) = kv_groups(NO_SPEC_DRAFTS, config(full, enable_kv_transfer=False))
    assert not group.offloaded
    fields = ("block_size", "num_kv_heads", "head_size", "dtype", "sliding_window")
    bounded = kvi.SlidingWindowMLASpec(**{k: VALUES[k] for k in fields}, bounded_replay=True)
    assert not bounded.prefix_cacheable
    assert not kv_groups(NO_SPEC_DRAFTS, config(bounded))[0].offloaded


def test_mamba_without_aligned_states_is_refused_naming_the_mode():
    spec = kvi.MambaSpec(block_size=32, shapes=((2, 4),), dtypes=(torch.float32,), mamba_cache_mode="none")
    with pytest.raises(ValueError, match=r"group 0 is MambaSpec with mamba_cache_mode='none'"):
        kv_groups(NO_SPEC_DRAFTS, config(spec))


def test_draft_groups_keep_their_last_block_back_when_vllm_drops_it():
    full = instance(kvi.FullAttentionSpec)
    drafts = SimpleNamespace(speculative_config=SimpleNamespace(use_eagle_block_drop=lambda: True))
    two = SimpleNamespace(
        kv_cache_groups=[
            kvi.KVCacheGroupSpec(["a"], full),
            kvi.KVCacheGroupSpec(["d"], full, is_eagle_group=True),
        ]
    )
    assert [g.volatile_tail for g in kv_groups(drafts, two)] == [False, True]
    no_drop = SimpleNamespace(speculative_config=SimpleNamespace(use_eagle_block_drop=lambda: False))
    assert [g.volatile_tail for g in kv_groups(no_drop, two)] == [False, False]
