"""Wire codec for KV event batches, compatible with vLLM's msgspec/msgpack payloads.

Contract:

* ``encode(batch, fmt="map", hash_format="u64") -> bytes``. The batch is always the
  msgpack array ``[ts, events, data_parallel_rank]``. ``fmt="map"`` (vLLM 0.24 and
  later) writes each event as a map with ``"type"`` and its field names, leaving out
  optional fields that are ``None``; ``fmt="array"`` (vLLM 0.23 and earlier, older
  llm-d/AIBrix/Kthena decoders) writes ``[type, field1, field2, ...]`` with every slot.
* ``hash_format="u64"`` writes every block hash as an unsigned 64-bit integer: raw hash
  bytes are converted with ``external_hash``, integers must already lie in
  ``[0, 2**64)`` (``ValueError`` naming the value otherwise). ``hash_format="raw"``
  writes hashes exactly as the events hold them.
* The check is one C-level pass (``min``) over every hash of the batch, no Python code
  per event; it still takes longer than msgspec takes to encode the batch. Only a batch
  that fails it (bytes, a negative int, anything that is not an int) goes through the
  per-event path that converts the bytes or names the culprit.
  ``EventEncoder(..., check_hashes=False)`` skips that pass for producers whose hashes are
  already ``external_hash`` ints (the scheduler's ``EventConverter``): the batch goes to
  msgspec as it is, an int of ``2**64`` or more is still a ``ValueError`` naming it, but
  raw bytes or a negative int would go on the wire unconverted and unchecked.
* ``decode(data) -> KVEventBatch`` accepts both encodings and both hash forms, returns
  the public types of ``kvoffload.events.types`` and raises ``EventDecodeError`` (a
  ``ValueError``) for anything else.
"""

from __future__ import annotations

import operator
from functools import partial
from itertools import chain, repeat
from typing import Any

import msgspec
from msgspec.structs import astuple, replace

from kvoffload.events.types import (
    HASH_FORMATS,
    AllBlocksCleared,
    BlockHashValue,
    BlockRemoved,
    BlockStored,
    HashFormat,
    KVEventBatch,
    wire_hash,
)

FORMATS: tuple[str, ...] = ("map", "array")
_U64_LIMIT = 1 << 64


class EventDecodeError(ValueError):
    """The payload is not a KV event batch in either encoding."""


# Positional twins of the public events, used only to read the array encoding. They keep
# the public class names as tags, so the wire shows "BlockStored", not the twin's name.
class _BlockStoredArray(BlockStored, array_like=True, omit_defaults=False, tag="BlockStored"):
    pass


class _BlockRemovedArray(BlockRemoved, array_like=True, omit_defaults=False, tag="BlockRemoved"):
    pass


class _AllBlocksClearedArray(AllBlocksCleared, array_like=True, omit_defaults=False, tag="AllBlocksCleared"):
    pass


class _ArrayEventBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_BlockStoredArray | _BlockRemovedArray | _AllBlocksClearedArray]
    data_parallel_rank: int | None = None


_PUBLIC_OF_ARRAY = {
    _BlockStoredArray: BlockStored,
    _BlockRemovedArray: BlockRemoved,
    _AllBlocksClearedArray: AllBlocksCleared,
}


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def _u64_hashes(hashes: list[BlockHashValue]) -> list[BlockHashValue]:
    """``hashes`` with raw bytes converted; the same list when it is already all ints."""
    if not hashes:
        return hashes
    try:
        # One pass in C: min() of all ints is an int, of all bytes is bytes, and a mix of
        # the two raises TypeError. Values of 2**64 and above are refused by the encoder.
        lowest = min(hashes)
    except TypeError:
        return [_one_u64(h) for h in hashes]
    if type(lowest) is int:
        if lowest < 0:
            raise ValueError(f"block hash {lowest!r} is outside the unsigned 64-bit range")
        return hashes
    if type(lowest) is bytes:
        return [int.from_bytes(h[-8:], "big") for h in hashes]  # == external_hash(h)
    return [_one_u64(h) for h in hashes]


def _one_u64(value: Any) -> int:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return wire_hash(bytes(value), "u64")  # type: ignore[return-value]
    if isinstance(value, int) and not isinstance(value, bool):
        if not 0 <= value < _U64_LIMIT:
            raise ValueError(f"block hash {value!r} is outside the unsigned 64-bit range")
        return value
    raise TypeError(f"block hash must be int or bytes, got {value!r}")


_IS_NOT_NONE = partial(operator.is_not, None)


def _all_unsigned_ints(events: list[Any]) -> bool:
    """Whether every block hash and parent hash of ``events`` is an int of at least 0.

    One pass in C over the whole batch, no Python code per event or per hash: ``min()``
    of ints is an int, of a mix of ints and bytes (or str, None, ...) a ``TypeError``. An
    int of ``2**64`` or more passes; msgspec refuses it when it encodes (``OverflowError``).
    """
    parents = filter(_IS_NOT_NONE, map(getattr, events, repeat("parent_block_hash"), repeat(None)))
    hashes = chain.from_iterable(map(getattr, events, repeat("block_hashes"), repeat(())))
    try:
        lowest = min(chain(parents, hashes), default=0)
    except TypeError:
        return False
    return type(lowest) is int and lowest >= 0


def _with_u64_hashes(event: Any) -> Any:
    hashes = getattr(event, "block_hashes", None)
    if hashes is None:
        return event
    new_hashes = _u64_hashes(hashes)
    if isinstance(event, BlockStored):
        parent = event.parent_block_hash
        new_parent = None if parent is None else _one_u64(parent)  # the same int if valid
        if new_hashes is hashes and new_parent is parent:
            return event
        return replace(event, block_hashes=new_hashes, parent_block_hash=new_parent)
    return event if new_hashes is hashes else replace(event, block_hashes=new_hashes)


def _oversized_hash(batch: KVEventBatch) -> int | None:
    """The first hash of ``batch`` at or above 2**64, to name it in the error."""
    for event in batch.events:
        for value in [*getattr(event, "block_hashes", ()), getattr(event, "parent_block_hash", None)]:
            if type(value) is int and value >= _U64_LIMIT:
                return value
    return None


class EventEncoder:
    """Reusable encoder for one wire format and hash form (cheaper than ``encode``).

    ``check_hashes=False`` (only meaningful with ``hash_format="u64"``): the caller
    guarantees every hash is already an int in ``[0, 2**64)``; see the module contract.
    """

    def __init__(
        self, fmt: str = "map", hash_format: HashFormat = "u64", *, check_hashes: bool = True
    ) -> None:
        _check_choice("fmt", fmt, FORMATS)
        _check_choice("hash_format", hash_format, HASH_FORMATS)
        if not isinstance(check_hashes, bool):
            raise ValueError(f"check_hashes must be True or False, got {check_hashes!r}")
        self.fmt = fmt
        self.hash_format = hash_format
        self.check_hashes = check_hashes
        self._check = hash_format == "u64" and check_hashes
        self._encoder = msgspec.msgpack.Encoder()

    def encode(self, batch: KVEventBatch) -> bytes:
        if not isinstance(batch, KVEventBatch):
            raise TypeError(f"expected a KVEventBatch, got {type(batch).__name__}: {batch!r}")
        events = batch.events
        if self._check and not _all_unsigned_ints(events):
            converted = [_with_u64_hashes(e) for e in events]
            if any(map(operator.is_not, converted, events)):
                events = converted
        try:
            if self.fmt == "map":
                if events is not batch.events:
                    batch = KVEventBatch(batch.ts, events, batch.data_parallel_rank)
                return self._encoder.encode(batch)
            positional = [(type(e).__name__, *astuple(e)) for e in events]
            return self._encoder.encode((batch.ts, positional, batch.data_parallel_rank))
        except OverflowError:
            culprit = _oversized_hash(batch)
            what = "an integer in the batch" if culprit is None else f"block hash {culprit!r}"
            raise ValueError(f"{what} is outside the unsigned 64-bit range") from None


_MAP_DECODER = msgspec.msgpack.Decoder(KVEventBatch)
_ARRAY_DECODER = msgspec.msgpack.Decoder(_ArrayEventBatch)
_ENCODERS: dict[tuple[str, str], EventEncoder] = {}


def encode(batch: KVEventBatch, fmt: str = "map", hash_format: HashFormat = "u64") -> bytes:
    """The msgpack payload of ``batch`` (see the module contract)."""
    encoder = _ENCODERS.get((fmt, hash_format))
    if encoder is None:
        encoder = _ENCODERS.setdefault((fmt, hash_format), EventEncoder(fmt, hash_format))
    return encoder.encode(batch)


def decode(data: bytes | bytearray | memoryview) -> KVEventBatch:
    """The batch in ``data``, in either encoding; ``EventDecodeError`` if it is neither."""
    try:
        return _MAP_DECODER.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as map_error:
        try:
            positional = _ARRAY_DECODER.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as array_error:
            preview = bytes(data[:16]).hex()
            raise EventDecodeError(
                f"payload of {len(data)} bytes (starting {preview}) is not a KV event batch: "
                f"map encoding: {map_error}; array encoding: {array_error}"
            ) from None
    events = [_PUBLIC_OF_ARRAY[type(e)](*astuple(e)) for e in positional.events]
    return KVEventBatch(positional.ts, events, positional.data_parallel_rank)
