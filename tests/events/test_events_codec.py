"""Wire codec: round trips in both encodings, exact payload shapes, hash forms, errors."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventDecodeError,
    EventEncoder,
    KVEventBatch,
    decode,
    encode,
    wire_hash,
)
from kvoffload.keys import external_hash, hash_request

pytestmark = pytest.mark.timeout(60)

U64_MAX = 2**64 - 1


def sample_batch() -> KVEventBatch:
    return KVEventBatch(
        ts=1717171717.25,
        events=[
            BlockStored([2**63, U64_MAX, 7], 2**63 + 1, list(range(48)), 16, None, "CPU", None, group_idx=2),
            BlockRemoved([U64_MAX], "CPU"),
            AllBlocksCleared(),
        ],
        data_parallel_rank=3,
    )


@pytest.mark.parametrize("fmt", ["map", "array"])
def test_round_trip_both_encodings(fmt: str) -> None:
    batch = sample_batch()
    assert decode(encode(batch, fmt)) == batch


def test_map_encoding_layout_leaves_out_unset_optional_fields() -> None:
    raw = msgspec.msgpack.decode(encode(sample_batch(), "map"))
    assert raw == [
        1717171717.25,
        [
            {
                "type": "BlockStored",
                "block_hashes": [2**63, U64_MAX, 7],
                "parent_block_hash": 2**63 + 1,
                "token_ids": list(range(48)),
                "block_size": 16,
                "lora_id": None,
                "medium": "CPU",
                "lora_name": None,
                "group_idx": 2,
            },
            {"type": "BlockRemoved", "block_hashes": [U64_MAX], "medium": "CPU"},
            {"type": "AllBlocksCleared"},
        ],
        3,
    ]


def test_array_encoding_layout_has_every_slot_in_vllm_order() -> None:
    raw = msgspec.msgpack.decode(encode(sample_batch(), "array"))
    stored, removed, cleared = raw[1]
    assert stored == [
        "BlockStored", [2**63, U64_MAX, 7], 2**63 + 1, list(range(48)), 16, None, "CPU", None,
        None, 2, None, None, None, None, None,
    ]  # fmt: skip
    assert removed == ["BlockRemoved", [U64_MAX], "CPU", None, None, None]
    assert cleared == ["AllBlocksCleared"]
    assert raw[0] == 1717171717.25 and raw[2] == 3


def test_batch_is_always_three_slots_even_without_rank() -> None:
    raw = msgspec.msgpack.decode(encode(KVEventBatch(1.0, [], None)))
    assert raw == [1.0, [], None]


def test_hashes_at_or_above_2_63_are_unsigned_on_the_wire() -> None:
    payload = encode(KVEventBatch(0.0, [BlockRemoved([2**63, U64_MAX], None)], 0))
    # 0xcf = msgpack uint64; a signed int64 (0xd3) would be read back negative.
    assert payload.count(b"\xcf") == 2
    assert decode(payload).events[0].block_hashes == [2**63, U64_MAX]


def test_raw_hash_bytes_become_external_hash_by_default() -> None:
    hashes = hash_request(list(range(64)), 16)
    event = BlockStored(hashes[1:], hashes[0], list(range(16, 64)), 16, None, "CPU", None)
    decoded = decode(encode(KVEventBatch(0.0, [event], 0))).events[0]
    assert decoded.block_hashes == [external_hash(h) for h in hashes[1:]]
    assert decoded.parent_block_hash == external_hash(hashes[0])


def test_raw_hash_format_keeps_bytes() -> None:
    hashes = hash_request(list(range(32)), 16)
    batch = KVEventBatch(0.0, [BlockRemoved(hashes, "CPU", group_idx=1)], 0)
    for fmt in ("map", "array"):
        assert decode(encode(batch, fmt, hash_format="raw")) == batch


def test_wire_hash_forms() -> None:
    digest = bytes(range(32))
    assert wire_hash(digest) == int.from_bytes(digest[-8:], "big")
    assert wire_hash(digest, "raw") == digest
    with pytest.raises(ValueError, match="'hex'"):
        wire_hash(digest, "hex")  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [-1, 2**64])
def test_out_of_range_hash_is_rejected_naming_it(bad: int) -> None:
    with pytest.raises(ValueError, match=str(bad)):
        encode(KVEventBatch(0.0, [BlockRemoved([1, bad], "CPU")], 0))


def test_bad_encoder_arguments_name_the_value() -> None:
    with pytest.raises(ValueError, match="'json'"):
        EventEncoder(fmt="json")
    with pytest.raises(ValueError, match="'hex'"):
        EventEncoder(hash_format="hex")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="KVEventBatch"):
        encode([BlockRemoved([1], "CPU")])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xc1garbage",
        msgspec.msgpack.encode({"ts": 1.0}),
        msgspec.msgpack.encode([1.0, [{"type": "BlockExploded", "block_hashes": [1]}], 0]),
        msgspec.msgpack.encode([1.0, [["BlockRemoved", "not-a-list", "CPU"]], 0]),
        msgspec.msgpack.encode(
            [1.0, [{"type": "BlockRemoved", "medium": "CPU"}], 0]
        ),  # required field missing
    ],
)
def test_decode_rejects_anything_else_with_a_clear_error(payload: bytes) -> None:
    with pytest.raises(EventDecodeError, match="not a KV event batch"):
        decode(payload)


def test_decode_accepts_older_two_slot_batches() -> None:
    assert decode(msgspec.msgpack.encode([2.0, [["AllBlocksCleared"]]])) == KVEventBatch(
        2.0, [AllBlocksCleared()], None
    )


u64 = st.integers(0, U64_MAX)
optional_text = st.none() | st.text(max_size=8)
stored = st.builds(
    BlockStored,
    block_hashes=st.lists(u64, max_size=8),
    parent_block_hash=st.none() | u64,
    token_ids=st.lists(st.integers(0, 2**31 - 1), max_size=32),
    block_size=st.integers(1, 1024),
    lora_id=st.none() | st.integers(0, 1000),
    medium=optional_text,
    lora_name=optional_text,
    extra_keys=st.none()
    | st.lists(st.none() | st.tuples(st.text(max_size=4), st.integers(0, 99)), max_size=3),
    group_idx=st.none() | st.integers(0, 7),
    kv_cache_spec_kind=optional_text,
    kv_cache_spec_sliding_window=st.none() | st.integers(1, 4096),
    locality=optional_text,
    ownership=optional_text,
)
removed = st.builds(
    BlockRemoved,
    block_hashes=st.lists(u64, max_size=8),
    medium=optional_text,
    group_idx=st.none() | st.integers(0, 7),
    locality=optional_text,
    ownership=optional_text,
)
batches = st.builds(
    KVEventBatch,
    ts=st.floats(0, 2e9),
    events=st.lists(stored | removed | st.just(AllBlocksCleared()), max_size=5),
    data_parallel_rank=st.none() | st.integers(0, 63),
)


@settings(max_examples=150, deadline=None)
@given(batch=batches, fmt=st.sampled_from(["map", "array"]))
def test_any_batch_round_trips(batch: KVEventBatch, fmt: str) -> None:
    assert decode(encode(batch, fmt)) == batch


# -- hash checking: one pass over the whole batch, per-event path only when it fails ---------


def stored_batch(hashes_per_event: list[list], parents: list | None = None) -> KVEventBatch:
    parents = parents or [None] * len(hashes_per_event)
    events = [
        BlockStored(hashes, parent, list(range(16 * len(hashes))), 16, None, "CPU", None)
        for hashes, parent in zip(hashes_per_event, parents)
    ]
    return KVEventBatch(5.0, [*events, BlockRemoved([3], "CPU"), AllBlocksCleared()], 0)


def test_valid_int_batch_is_encoded_unchanged_with_or_without_the_check() -> None:
    batch = stored_batch([[i * 16 + j for j in range(16)] for i in range(64)], [U64_MAX] * 64)
    checked = EventEncoder().encode(batch)
    assert EventEncoder(check_hashes=False).encode(batch) == checked
    assert EventEncoder(hash_format="raw").encode(batch) == checked
    assert decode(checked) == batch


def test_batch_mixing_ints_and_bytes_converts_only_the_bytes() -> None:
    digests = hash_request(list(range(64)), 16)
    batch = stored_batch([[1, digests[0], 2], [digests[1], digests[2]], [7]], [digests[3], 0, 2**63])
    events = decode(encode(batch)).events
    assert events[0].block_hashes == [1, external_hash(digests[0]), 2]
    assert events[1].block_hashes == [external_hash(digests[1]), external_hash(digests[2])]
    assert events[2].block_hashes == [7]
    assert [e.parent_block_hash for e in events[:3]] == [external_hash(digests[3]), 0, 2**63]
    assert events[3:] == batch.events[3:]
    assert batch.events[0].block_hashes[1] == digests[0]  # the caller's events are untouched


def test_parent_hash_as_bytes_with_int_block_hashes_is_converted() -> None:
    digest = hash_request(list(range(16)), 16)[0]
    batch = stored_batch([[1, 2, 3]], [digest])
    assert decode(encode(batch)).events[0].parent_block_hash == external_hash(digest)
    assert decode(encode(batch, "array")).events[0].parent_block_hash == external_hash(digest)


@pytest.mark.parametrize("fmt", ["map", "array"])
@pytest.mark.parametrize("bad", [-1, -(2**63), -(2**70), 2**64, 2**70])
@pytest.mark.parametrize("where", ["hash", "parent"])
def test_out_of_range_int_deep_in_a_large_batch_is_named(fmt: str, bad: int, where: str) -> None:
    hashes = [[i * 16 + j for j in range(16)] for i in range(64)]
    parents: list = [1] * 64
    if where == "hash":
        hashes[40][9] = bad
    else:
        parents[40] = bad
    with pytest.raises(ValueError, match=rf"block hash {bad}\b.*unsigned 64-bit range"):
        EventEncoder(fmt).encode(stored_batch(hashes, parents))


def test_non_hash_values_are_still_refused_naming_them() -> None:
    with pytest.raises(TypeError, match="'abc'"):
        encode(stored_batch([[1, "abc"]]))
    with pytest.raises(TypeError, match="'abc'"):
        encode(stored_batch([[1]], ["abc"]))


def test_check_hashes_false_trusts_the_producer() -> None:
    trusting = EventEncoder(check_hashes=False)
    assert trusting.check_hashes is False
    digest = hash_request(list(range(16)), 16)[0]
    # Bytes go out as they are (the caller promised ints): the same payload as "raw".
    batch = stored_batch([[1, digest]])
    assert trusting.encode(batch) == encode(batch, hash_format="raw")
    # msgspec itself still refuses 2**64 and above, and the error names the value.
    with pytest.raises(ValueError, match=str(2**64)):
        trusting.encode(stored_batch([[1, 2**64]]))
    with pytest.raises(ValueError, match="check_hashes"):
        EventEncoder(check_hashes=1)  # type: ignore[arg-type]


hash_values = u64 | st.binary(min_size=8, max_size=32)


@settings(max_examples=150, deadline=None)
@given(
    hashes=st.lists(st.lists(hash_values, max_size=6), min_size=1, max_size=6),
    parent=st.none() | hash_values,
    fmt=st.sampled_from(["map", "array"]),
)
def test_mixed_hash_forms_encode_as_if_each_was_converted_first(
    hashes: list[list], parent: int | bytes | None, fmt: str
) -> None:
    def u64_of(value: int | bytes) -> int:
        return value if isinstance(value, int) else external_hash(value)

    batch = stored_batch(hashes, [parent] * len(hashes))
    expected = stored_batch(
        [[u64_of(h) for h in event] for event in hashes],
        [None if parent is None else u64_of(parent)] * len(hashes),
    )
    assert encode(batch, fmt) == encode(expected, fmt, hash_format="raw")
