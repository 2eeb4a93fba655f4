"""The index's decoding of KV event batches: token ids are left encoded until learned.

Contract:

* ``decode_batch(data)`` is ``kvoffload.events.codec.decode`` for the index: the same
  batch, except that in the map encoding each ``BlockStored`` is a ``LazyBlockStored``
  (a ``BlockStored`` subclass) whose ``token_ids`` is the ``msgspec.Raw`` msgpack of the
  list. Decoding 16 token ids per block costs more than the rest of the event, and the
  index needs them only for blocks it has not learned yet (``kvoffload.index.tokens``).
  The array encoding, and anything the map decoder refuses, go through ``codec.decode``
  (plain events, or its ``EventDecodeError``).
* ``token_list(token_ids)`` gives the token ids as a list, decoding a ``Raw``; ``None``
  when they are not a list of integers. A payload whose token ids are not such a list is
  therefore not refused as a whole (the full decoder would refuse it): its events apply,
  and that event teaches no token chain.
* ``has_tokens(token_ids)``: whether the list is non-empty, without decoding it.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from kvoffload.events.codec import decode
from kvoffload.events.types import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

_EMPTY_ARRAY = b"\x90"  # msgpack's empty fixarray


class LazyBlockStored(BlockStored, tag="BlockStored"):
    """A ``BlockStored`` whose ``token_ids`` are still msgpack (``msgspec.Raw``)."""

    token_ids: msgspec.Raw  # type: ignore[assignment]


class _LazyBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[LazyBlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


_LAZY = msgspec.msgpack.Decoder(_LazyBatch)
_TOKENS = msgspec.msgpack.Decoder(list[int])


def decode_batch(data: bytes | bytearray | memoryview) -> KVEventBatch:
    """The batch in ``data`` with lazily decoded token ids (see the module contract)."""
    try:
        batch = _LAZY.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return decode(data)
    return KVEventBatch(batch.ts, batch.events, batch.data_parallel_rank)  # type: ignore[arg-type]


def token_list(token_ids: Sequence[int] | msgspec.Raw) -> list[int] | Sequence[int] | None:
    if type(token_ids) is not msgspec.Raw:
        return token_ids
    try:
        return _TOKENS.decode(token_ids)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def has_tokens(token_ids: Sequence[int] | msgspec.Raw) -> bool:
    if type(token_ids) is msgspec.Raw:
        return len(token_ids) > 1 or bytes(token_ids) != _EMPTY_ARRAY
    return bool(token_ids)
