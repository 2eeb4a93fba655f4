"""Where the tokens of one load came from: tokens per source medium.

A load covers ``[start, end)`` tokens; each loaded key covers a token range of its own
(per KV-cache group, so ranges of different groups overlap). A token covered by keys of
several media counts for the medium farthest from the device (``MEDIA_ORDER``: host,
then disk, then the shared tiers, Redis and Mooncake, then object storage; an unknown medium after those); a
token no key covers counts under ``""`` (unknown). The counts add up to ``end - start``. Engines report cached
tokens by source with it (vLLM 0.32's ``prompt_tokens_cached_by_source``).
"""

from __future__ import annotations

from collections.abc import Iterable
from operator import itemgetter, lt

from kvoffload.specs import MEDIUM_CPU, MEDIUM_DISK, MEDIUM_MOONCAKE, MEDIUM_OBJECT, MEDIUM_REMOTE

MEDIA_ORDER = (MEDIUM_CPU, MEDIUM_DISK, MEDIUM_REMOTE, MEDIUM_MOONCAKE, MEDIUM_OBJECT)
UNKNOWN = ""


def _rank(medium: str) -> int:
    return MEDIA_ORDER.index(medium) if medium in MEDIA_ORDER else len(MEDIA_ORDER)


def tokens_by_source(ranges: Iterable[tuple[int, int, str]], start: int, end: int) -> dict[str, int]:
    """``ranges``: ``(first token, end token, medium)`` of each loaded key. Only non-zero
    counts are returned. A sweep over the range ends: O(n log n) in the keys; when every
    key has the same medium (a load from one tier, the common case) only the covered
    length is counted."""
    ranges = list(ranges)
    media = {medium for _, _, medium in ranges}
    if len(media) == 1:
        return _one_medium(ranges, media.pop(), start, end)
    edges: list[tuple[int, int, int]] = []  # (token, +1/-1, rank)
    for lo, hi, medium in ranges:
        lo, hi = max(lo, start), min(hi, end)
        if lo < hi:
            rank = _rank(medium)
            edges += ((lo, 1, rank), (hi, -1, rank))
    edges.append((end, 0, 0))
    edges.sort()
    active = [0] * (len(MEDIA_ORDER) + 1)
    names = [*MEDIA_ORDER, UNKNOWN]  # an unknown medium is reported as unknown
    counts: dict[str, int] = {}
    position = start
    for token, delta, rank in edges:
        if token > position:
            top = max((r for r, n in enumerate(active) if n), default=None)
            source = UNKNOWN if top is None else names[top]
            counts[source] = counts.get(source, 0) + token - position
            position = token
        active[rank] += delta
    return counts


def _one_medium(ranges: list[tuple[int, int, str]], medium: str, start: int, end: int) -> dict[str, int]:
    source = medium if medium in MEDIA_ORDER else UNKNOWN
    los, his = list(map(itemgetter(0), ranges)), list(map(itemgetter(1), ranges))
    if los[1:] == his[:-1] and all(map(lt, los, his)):
        # one run of adjacent keys in order (a load's keys of one group): C loops only
        covered = max(0, min(his[-1], end) - max(los[0], start))
    else:
        covered, reach = 0, start
        for lo, hi, _ in sorted(ranges):
            lo, hi = max(lo, reach), min(hi, end)
            if lo < hi:
                covered += hi - lo
                reach = hi
    counts = {source: covered} if covered else {}
    if end - start > covered:
        counts[UNKNOWN] = counts.get(UNKNOWN, 0) + end - start - covered
    return counts
