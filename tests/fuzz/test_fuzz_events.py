"""Fuzzing the KV event wire decoder (``events.codec.decode``), which reads what any
publisher on the network sends (vLLM, SGLang, kvoffload, or garbage).

* Any bytes, any msgpack value, and valid batches of both encodings with a byte changed,
  dropped or added anywhere, or cut short: a ``KVEventBatch`` or ``EventDecodeError``,
  nothing else.
* What decodes is a batch the codec itself writes the same way again: decoding its own
  encoding (hashes kept as they are) gives the same bytes back.
"""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fuzzing import TIMEOUT, fuzz
from kvoffload.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from kvoffload.events.codec import EventDecodeError, decode, encode

pytestmark = pytest.mark.timeout(TIMEOUT)

u64 = st.integers(0, 2**64 - 1)
text = st.none() | st.text(max_size=6)
stored = st.builds(
    BlockStored,
    block_hashes=st.lists(u64, max_size=4),
    parent_block_hash=st.none() | u64,
    token_ids=st.lists(st.integers(0, 2**31 - 1), max_size=8),
    block_size=st.integers(1, 64),
    lora_id=st.none() | st.integers(0, 9),
    medium=text,
    lora_name=text,
    group_idx=st.none() | st.integers(0, 3),
    locality=text,
)
removed = st.builds(BlockRemoved, block_hashes=st.lists(u64, max_size=4), medium=text)
batches = st.builds(
    KVEventBatch,
    ts=st.floats(allow_nan=False),
    events=st.lists(st.one_of(stored, removed, st.just(AllBlocksCleared())), max_size=4),
    data_parallel_rank=st.none() | st.integers(0, 7),
)
msgpack_value = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=8) | st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "type"]),
    lambda c: st.lists(c, max_size=5) | st.dictionaries(st.text(max_size=6), c, max_size=4),
    max_leaves=25,
)  # fmt: skip


def check(data: bytes) -> None:
    try:
        batch = decode(data)
    except EventDecodeError:
        return
    assert isinstance(batch, KVEventBatch)
    again = encode(batch, "map", "raw")
    assert encode(decode(again), "map", "raw") == again


@st.composite
def damaged(draw) -> bytes:
    data = encode(draw(batches), draw(st.sampled_from(["map", "array"])))
    edit = draw(st.sampled_from(["flip", "drop", "add", "cut"]))
    at = draw(st.integers(0, len(data) - 1))
    if edit == "flip":
        return data[:at] + bytes([data[at] ^ draw(st.integers(1, 255))]) + data[at + 1 :]
    if edit == "drop":
        return data[:at] + data[at + 1 :]
    if edit == "add":
        return data[:at] + draw(st.binary(min_size=1, max_size=4)) + data[at:]
    return data[:at]


@fuzz(500)
@given(st.one_of(st.binary(max_size=200), msgpack_value.map(msgspec.msgpack.encode), damaged()))
def test_decode_takes_any_bytes(data):
    check(data)


@fuzz(300)
@given(batches, st.sampled_from(["map", "array"]))
def test_batches_of_both_encodings_come_back_as_written(batch, fmt):
    assert decode(encode(batch, fmt)) == batch
