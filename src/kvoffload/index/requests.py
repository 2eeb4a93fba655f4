"""The HTTP API's request bodies: decoding and validation, errors naming the field.

Contract: ``parse(kind, body)`` returns the request struct of ``kind`` (``register``,
``unregister``, ``query``, ``query_by_hash``) or raises ``BadRequest(field, message)``
whose message names the field and, where there is one, the bad value. Unknown fields are
ignored. Mooncake's names are accepted as aliases: ``model`` and ``modelname`` for
``model_name``, ``seq_hashes`` for ``block_hashes``.

Block hashes are kept as raw JSON while the body is decoded and then parsed by
``kvoffload.index._hashfind.parse_hashes`` straight into uint64 (no Python int per hash)
when that optional extension was built; anything it does not take (and everything
without it) goes through msgspec and ``hash_array``, which name the bad value.
"""

from __future__ import annotations

import re
from array import array
from typing import Annotated

import msgspec
import numpy as np

try:
    from kvoffload.index import _hashfind
except ImportError:  # built without a C compiler
    _hashfind = None

_I64_MIN = -(1 << 63)
_U64_LIMIT = 1 << 64
_FIELD = re.compile(r"`\$\.([A-Za-z_]+)|field `([A-Za-z_]+)`")


class BadRequest(ValueError):
    def __init__(self, field: str | None, message: str) -> None:
        super().__init__(message)
        self.field = field


class _Named(msgspec.Struct):
    model_name: str | None = None
    model: str | None = None
    modelname: str | None = None

    def model_(self) -> str:
        name = self.model_name or self.model or self.modelname
        if not name:
            raise BadRequest("model_name", "model_name is required and must be a non-empty string")
        return name


class RegisterRequest(_Named):
    instance_id: int | str | None = None
    endpoint: str | None = None
    block_size: int | None = None
    tenant_id: str = "default"
    dp_rank: int = 0
    replay_endpoint: str | None = None
    topic: str = ""


class UnregisterRequest(_Named):
    instance_id: int | str | None = None
    tenant_id: str | None = None
    dp_rank: int | None = None


class QueryRequest(_Named):
    # Non-negativity is checked while decoding: a separate pass over 32k ids cost 0.35 ms.
    token_ids: list[Annotated[int, msgspec.Meta(ge=0)]] | None = None
    tenant_id: str = "default"
    lora_name: str | None = None
    cache_salt: str | None = None


_ABSENT = msgspec.Raw(b"")


class QueryByHashRequest(_Named):
    # raw JSON (``_ABSENT`` when missing) until ``parse`` turns it into uint64
    block_hashes: msgspec.Raw = _ABSENT
    seq_hashes: msgspec.Raw = _ABSENT
    tenant_id: str = "default"
    lora_name: str | None = None


_TYPES: dict[str, type[_Named]] = {
    "register": RegisterRequest,
    "unregister": UnregisterRequest,
    "query": QueryRequest,
    "query_by_hash": QueryByHashRequest,
}
_DECODERS = {kind: msgspec.json.Decoder(cls) for kind, cls in _TYPES.items()}


class _AnyTokensQuery(msgspec.Struct):
    token_ids: list[int] | None = None


_ANY_TOKENS = msgspec.json.Decoder(_AnyTokensQuery)


def parse(kind: str, body: bytes) -> _Named:
    if not body:
        raise BadRequest(None, "the request body must be a JSON object, got an empty body")
    try:
        request = _DECODERS[kind].decode(body)
    except msgspec.ValidationError as exc:
        if kind == "query":
            _name_a_negative_token(body)
        match = _FIELD.search(str(exc))
        field = next((g for g in match.groups() if g), None) if match else None
        raise BadRequest(field, f"invalid {field or 'request'}: {exc}") from None
    except msgspec.DecodeError as exc:
        raise BadRequest(None, f"the request body is not valid JSON: {exc}") from None
    request.model_()  # every request names a model
    if isinstance(request, RegisterRequest):
        _require(request, "instance_id", "endpoint", "block_size")
    elif isinstance(request, UnregisterRequest):
        _require(request, "instance_id")
    elif isinstance(request, QueryRequest):
        _require(request, "token_ids")
    elif isinstance(request, QueryByHashRequest):
        hashes = None
        for field in ("block_hashes", "seq_hashes"):  # the first one given and not null
            raw = getattr(request, field)
            hashes = _hashes(raw, field) if len(raw) else None
            if hashes is not None:
                break
        if hashes is None:
            raise BadRequest("block_hashes", "block_hashes is required")
        request.block_hashes = hashes  # type: ignore[assignment]
    return request


_HASH_LIST = msgspec.json.Decoder(list[int] | None)


def _hashes(raw: msgspec.Raw, field: str) -> np.ndarray | None:
    """The uint64 hashes of a raw JSON value (``None`` for ``null``)."""
    if _hashfind is not None:
        parsed = _hashfind.parse_hashes(raw)
        if parsed is not None:
            return np.frombuffer(parsed, dtype=np.uint64)
    try:
        hashes = _HASH_LIST.decode(raw)
    except msgspec.ValidationError as exc:
        where = str(exc).replace("`$", f"`$.{field}")  # the path as in the whole body
        raise BadRequest(field, f"invalid {field}: {where}") from None
    return None if hashes is None else hash_array(hashes)


def _name_a_negative_token(body: bytes) -> None:
    """Raise the error naming the smallest token id if the ids are ints but one is negative
    (the strict decoder's message does not give the value)."""
    try:
        tokens = _ANY_TOKENS.decode(body).token_ids
    except (msgspec.ValidationError, msgspec.DecodeError):
        return
    if tokens and min(tokens) < 0:
        raise BadRequest("token_ids", f"token_ids must be non-negative, got {min(tokens)}") from None


def hash_array(hashes: list[int]) -> np.ndarray:
    """``hashes`` as uint64: u64 values as they are, i64 negatives as two's complement;
    ``BadRequest`` naming the first value that is neither."""
    try:
        return np.frombuffer(array("Q", hashes), dtype=np.uint64)
    except OverflowError:
        pass
    try:
        return np.frombuffer(array("q", hashes), dtype=np.int64).view(np.uint64)
    except OverflowError:
        pass
    for h in hashes:
        if not _I64_MIN <= h < _U64_LIMIT:
            raise BadRequest("block_hashes", f"block_hashes must be 64-bit integers, got {h}")
    return np.array([h & (_U64_LIMIT - 1) for h in hashes], dtype=np.uint64)


def _require(request: msgspec.Struct, *names: str) -> None:
    for name in names:
        if getattr(request, name) is None:
            raise BadRequest(name, f"{name} is required")
