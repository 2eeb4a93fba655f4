"""Request traces in the Mooncake JSON Lines format.

One request per line: ``{"timestamp": ms, "input_length": n, "output_length": m,
"hash_ids": [...]}``. ``hash_ids`` are prefix-chained block ids of ``block_size`` tokens
(512 in the Mooncake traces); equal ids mean a reusable prefix block. The last block of a
request is usually partial.

Optional session structure, as aiperf's multi-turn ``mooncake_trace`` files carry it:
``"session_id"`` (a string or an int) names the request's session, and a later turn may
give ``"delay"`` (ms after its session's previous turn in the file) instead of a
``timestamp``; ``read_trace`` then orders the requests by their resolved timestamps.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from kvoffload.validation import positive_int

MOONCAKE_BLOCK_SIZE = 512


@dataclass(frozen=True)
class TraceRequest:
    """One request: arrival (ms), token counts and prefix-block ids."""

    timestamp: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    session_id: str | None = None


@dataclass(frozen=True)
class Trace:
    """A list of requests whose ``hash_ids`` count blocks of ``block_size`` tokens."""

    requests: list[TraceRequest]
    block_size: int
    name: str = ""

    def unique_blocks(self) -> int:
        return len({h for r in self.requests for h in r.hash_ids})

    def block_references(self) -> int:
        return sum(len(r.hash_ids) for r in self.requests)


class TraceFormatError(ValueError):
    """A trace line that is not a valid request; the message names the line number."""


def parse_request(line: str, lineno: int) -> TraceRequest:
    """Parse one JSON line; raises ``TraceFormatError`` naming ``lineno``. A ``delay`` is
    not resolved here (``iter_requests`` does it): the timestamp is then 0."""
    return _parse(line, lineno)[0]


def _parse(line: str, lineno: int) -> tuple[TraceRequest, int | None]:
    """The request and its ``delay`` (``None`` when it has a timestamp or no delay)."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceFormatError(f"line {lineno}: not JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise TraceFormatError(f"line {lineno}: expected an object, got {type(obj).__name__}")
    fields = {}
    for name in ("timestamp", "input_length", "output_length", "delay"):
        value = obj.get(name, 0 if name != "input_length" else None)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise TraceFormatError(f"line {lineno}: {name} must be a non-negative number, got {value!r}")
        fields[name] = int(value)
    hash_ids = obj.get("hash_ids")
    if not isinstance(hash_ids, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in hash_ids
    ):
        raise TraceFormatError(
            f"line {lineno}: hash_ids must be a list of non-negative ints, got {hash_ids!r:.80}"
        )
    session = obj.get("session_id")
    if session is not None:
        if isinstance(session, bool) or not isinstance(session, (str, int)) or session == "":
            raise TraceFormatError(
                f"line {lineno}: session_id must be a non-empty string or an int, got {session!r}"
            )
        session = str(session)
    delay = fields["delay"] if "delay" in obj and "timestamp" not in obj else None
    if delay is not None and session is None:
        raise TraceFormatError(
            f"line {lineno}: a delay needs a session_id (it counts from the previous turn)"
        )
    request = TraceRequest(
        fields["timestamp"], fields["input_length"], fields["output_length"], tuple(hash_ids), session
    )
    return request, delay


def iter_requests(lines: Iterable[str]) -> Iterator[TraceRequest]:
    """Parse lines (blank ones skipped), numbering them from 1, in file order; a ``delay``
    is resolved against the session's previous turn (``TraceFormatError`` if none)."""
    last: dict[str, int] = {}
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        request, delay = _parse(line, lineno)
        if delay is not None:
            if request.session_id not in last:
                raise TraceFormatError(
                    f"line {lineno}: delay without an earlier turn of session {request.session_id!r}"
                )
            request = replace(request, timestamp=last[request.session_id] + delay)
        if request.session_id is not None:
            last[request.session_id] = request.timestamp
        yield request


def read_trace(path: str | Path, block_size: int = MOONCAKE_BLOCK_SIZE) -> Trace:
    """Read a Mooncake-format JSONL trace whose blocks hold ``block_size`` tokens."""
    positive_int("block_size", block_size)
    path = Path(path)
    with path.open(encoding="utf-8") as fh:
        requests = list(iter_requests(fh))
    if any(r.session_id is not None for r in requests):
        requests.sort(key=lambda r: r.timestamp)  # stable: file order among equal times
    return Trace(requests, block_size, path.stem)
