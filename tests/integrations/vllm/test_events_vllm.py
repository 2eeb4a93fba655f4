"""Wire compatibility with vLLM's own msgspec classes (vllm/distributed/kv_events.py)."""

from __future__ import annotations

import msgspec
import pytest
from msgspec.structs import asdict

from kvoffload.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, decode, encode

vllm_events = pytest.importorskip("vllm.distributed.kv_events")

pytestmark = pytest.mark.timeout(120)  # importing vLLM alone takes seconds on a loaded machine

U64_MAX = 2**64 - 1


def ours() -> KVEventBatch:
    return KVEventBatch(
        ts=12.5,
        events=[
            BlockStored(
                [2**63, U64_MAX], 5, list(range(32)), 16, 3, "CPU", "adapter",
                extra_keys=[("adapter",), None], group_idx=1, kv_cache_spec_kind="full_attention",
                kv_cache_spec_sliding_window=None, locality="LOCAL", ownership="kvoffload",
            ),
            BlockStored([9], None, [], 16, None, "CPU", None),
            BlockRemoved([U64_MAX, 1], "CPU", group_idx=1, locality="LOCAL"),
            AllBlocksCleared(),
        ],
        data_parallel_rank=2,
    )  # fmt: skip


def test_vllm_decodes_our_map_payloads() -> None:
    theirs = msgspec.msgpack.Decoder(vllm_events.KVEventBatch).decode(encode(ours(), "map"))
    assert [type(e).__name__ for e in theirs.events] == [
        "BlockStored",
        "BlockStored",
        "BlockRemoved",
        "AllBlocksCleared",
    ]
    assert msgspec.to_builtins(theirs) == msgspec.to_builtins(ours())


def test_vllm_decodes_our_raw_byte_hashes() -> None:
    digest = bytes(range(32))
    batch = KVEventBatch(1.0, [BlockRemoved([digest], "CPU")], 0)
    theirs = msgspec.msgpack.Decoder(vllm_events.KVEventBatch).decode(encode(batch, hash_format="raw"))
    assert theirs.events[0].block_hashes == [digest]


def test_we_decode_vllm_payloads() -> None:
    v = vllm_events
    batch = v.KVEventBatch(
        ts=3.25,
        events=[
            v.BlockStored(
                block_hashes=[2**63 + 7, 11], parent_block_hash=U64_MAX, token_ids=[1, 2, 3, 4],
                block_size=2, lora_id=None, medium="GPU", lora_name=None, group_idx=0,
                kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=128, session_id="s-1",
            ),
            v.BlockRemoved(block_hashes=[U64_MAX], medium="GPU", ownership="x"),
            v.AllBlocksCleared(),
        ],
        data_parallel_rank=None,
    )  # fmt: skip
    decoded = decode(msgspec.msgpack.encode(batch))
    assert msgspec.to_builtins(decoded) == msgspec.to_builtins(batch)
    assert decoded.events[0].session_id == "s-1"


# vLLM's own event classes switched to positional arrays: the 0.23-era wire shape.
class _PositionalStored(vllm_events.BlockStored, array_like=True, omit_defaults=False, tag="BlockStored"):
    pass


class _PositionalRemoved(vllm_events.BlockRemoved, array_like=True, omit_defaults=False, tag="BlockRemoved"):
    pass


class _PositionalCleared(
    vllm_events.AllBlocksCleared, array_like=True, omit_defaults=False, tag="AllBlocksCleared"
):
    pass


class _PositionalBatch(vllm_events.EventBatch):
    events: list[_PositionalStored | _PositionalRemoved | _PositionalCleared]


def test_field_order_matches_vllm() -> None:
    """vLLM's classes start with our fields in our order; a later release's further
    fields (0.34: ``BlockStored.lookahead_token_ids``) have defaults."""
    for mine, theirs in (
        (BlockStored, vllm_events.BlockStored),
        (BlockRemoved, vllm_events.BlockRemoved),
        (AllBlocksCleared, vllm_events.AllBlocksCleared),
        (KVEventBatch, vllm_events.KVEventBatch),
    ):
        fields = theirs.__struct_fields__
        assert fields[: len(mine.__struct_fields__)] == mine.__struct_fields__
        assert len(fields) - len(mine.__struct_fields__) <= len(theirs.__struct_defaults__)


def test_array_encoding_round_trips_with_vllm_classes_made_positional() -> None:
    theirs = msgspec.msgpack.Decoder(_PositionalBatch).decode(encode(ours(), "array"))
    assert [type(e).__struct_config__.tag for e in theirs.events] == [type(e).__name__ for e in ours().events]
    pairs = zip(theirs.events, ours().events)
    common = [{k: v for k, v in asdict(e).items() if k in type(m).__struct_fields__} for e, m in pairs]
    assert common == [asdict(e) for e in ours().events]
    assert decode(msgspec.msgpack.encode(theirs)) == ours()
