"""Fuzzing the checks of a shared tier's stored values, which another replica, another
version, a store that lost or mixed up objects, or a hostile writer may have left in any
state: the Redis value format (``tiers.redis.format``: ``check_head``, ``decode``) and
the Mooncake object check (``tiers.mooncake.objects``: both layouts).

* ``check_head`` and ``decode`` take any bytes and any claimed length: a CRC or a
  payload, or ``CorruptValue``; nothing else. A value with any byte changed, or of another
  length, is refused.
* Mooncake's ``check`` over a batch whose objects were damaged anywhere (header, key,
  payload) and whose answered sizes are drawn (right, short, long, failed) names exactly
  the objects ``decode`` refuses, and never raises.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fuzzing import TIMEOUT, fuzz
from kvoffload.tiers.mooncake.objects import SLOT_BYTES, OneBuffer, SplitBuffers
from kvoffload.tiers.redis.format import HEADER_BYTES, CorruptValue, check_head, decode, encode
from kvoffload.transfer import HostBlockPool, KVLayout

pytestmark = pytest.mark.timeout(TIMEOUT)

DIGEST = bytes(range(16))
key = st.binary(min_size=1, max_size=64)


@fuzz(1000)
@given(st.binary(max_size=200), key, st.integers(-10, 300), st.integers(-10, 500))
def test_check_head_and_decode_take_any_bytes(value, key, payload, claimed):
    for call in (
        lambda: check_head(value, key, DIGEST, payload, claimed),
        lambda: decode(value, key, DIGEST, payload),
    ):
        with contextlib.suppress(CorruptValue):
            call()


@fuzz(800)
@given(key, st.binary(max_size=100), st.data())
def test_a_value_with_any_byte_changed_or_another_length_is_refused(key, payload, data):
    value = encode(key, [payload], DIGEST)
    assert bytes(decode(value, key, DIGEST, len(payload))) == payload
    edit = data.draw(st.sampled_from(["flip", "cut", "extend"]))
    if edit == "flip":
        at = data.draw(st.integers(0, len(value) - 1))
        damaged = bytearray(value)
        damaged[at] ^= data.draw(st.integers(1, 255))
    elif edit == "cut":
        damaged = value[: data.draw(st.integers(0, len(value) - 1))]
    else:
        damaged = value + data.draw(st.binary(min_size=1, max_size=8))
    with pytest.raises(CorruptValue):
        decode(bytes(damaged), key, DIGEST, len(payload))


BLOCK = 96  # payload bytes of a block
HOST = 6


def pool(prefix: int) -> HostBlockPool:
    layout = KVLayout.from_layer_tensors({"layer": torch.zeros((4, BLOCK), dtype=torch.uint8)})
    return HostBlockPool(layout, HOST, row_prefix_bytes=prefix)


ONE = OneBuffer(pool(SLOT_BYTES), DIGEST, lambda ptr, n: None)
SPLIT = SplitBuffers(pool(0), DIGEST, lambda ptr, n: None, threads=1, batch=HOST)


def object_bytes(layout, j: int, host_id: int, key: bytes) -> bytes:
    """Object ``j`` of the batch as it lies now: header and key, then payload."""
    if layout is ONE:
        start = host_id * ONE.stride + ONE.prefix - HEADER_BYTES - len(key)
        return bytes(ONE._view[start : start + HEADER_BYTES + len(key) + BLOCK])
    head = SPLIT._staging[0, j, : HEADER_BYTES + len(key)].tobytes()
    return head + b"".join(bytes(v) for v in SPLIT._host.block(host_id))


def damage(layout, j: int, host_id: int, key: bytes, at: int, xor: int) -> None:
    """Change byte ``at`` of object ``j`` where it lies."""
    n = HEADER_BYTES + len(key)
    if layout is ONE:
        start = host_id * ONE.stride + ONE.prefix - n
        ONE._view[start + at] ^= xor
    elif at < n:
        SPLIT._staging[0, j, at] ^= xor
    else:
        rows, at = SPLIT._host.block(host_id), at - n
        for row in rows:
            if at < row.nbytes:
                row[at] ^= xor
                return
            at -= row.nbytes


@st.composite
def batch(draw):
    host_ids = draw(st.lists(st.integers(0, HOST - 1), min_size=1, max_size=HOST, unique=True))
    keys = [draw(key) for _ in host_ids]
    payloads = [draw(st.binary(min_size=BLOCK, max_size=BLOCK)) for _ in host_ids]
    where = st.tuples(st.integers(0, len(host_ids) - 1), st.integers(0, 10**6), st.integers(1, 255))
    damages = draw(st.lists(where, max_size=3))
    answered = [draw(st.sampled_from(["size", "short", "long", "failed"])) for _ in host_ids]
    return host_ids, keys, payloads, damages, answered


@fuzz(300)
@pytest.mark.parametrize("layout", ["one buffer", "split buffers"])
@given(drawn=batch())
def test_mooncake_check_names_exactly_the_objects_decode_refuses(layout, drawn):
    layout = ONE if layout == "one buffer" else SPLIT
    host_ids, keys, payloads, damages, answered = drawn
    for b, payload in zip(host_ids, payloads):
        (row,) = (
            layout._host.block(b) if layout is SPLIT else [ONE._view[b * ONE.stride + ONE.prefix :][:BLOCK]]
        )
        row[:] = payload
    layout.put(0, host_ids, keys)  # headers written, as a store writes them
    for j, at, xor in damages:
        damage(layout, j, host_ids[j], keys[j], at % (HEADER_BYTES + len(keys[j]) + BLOCK), xor)
    sizes = [HEADER_BYTES + len(k) + BLOCK for k in keys]
    got = [{"size": n, "short": n - 1, "long": n + 1, "failed": -800}[a] for n, a in zip(sizes, answered)]
    bad = {j for j, exc in layout.check(0, host_ids, keys, got) if isinstance(exc, CorruptValue)}
    expected = set()
    for j, (b, k) in enumerate(zip(host_ids, keys)):
        if got[j] < 0:
            continue
        if got[j] != sizes[j]:
            expected.add(j)
            continue
        try:
            decode(object_bytes(layout, j, b, k), k, DIGEST, BLOCK)
        except CorruptValue:
            expected.add(j)
    assert bad == expected
