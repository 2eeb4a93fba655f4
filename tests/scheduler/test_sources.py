"""``tokens_by_source`` against a count token by token."""

from hypothesis import given
from hypothesis import strategies as st

from kvoffload.scheduler.sources import MEDIA_ORDER, UNKNOWN, tokens_by_source

spans = st.lists(st.tuples(st.integers(0, 40), st.integers(1, 12), st.sampled_from(MEDIA_ORDER)), max_size=8)


def by_token(ranges, start, end):
    counts = {}
    for token in range(start, end):
        media = [MEDIA_ORDER.index(m) for lo, hi, m in ranges if lo <= token < hi]
        source = MEDIA_ORDER[max(media)] if media else UNKNOWN
        counts[source] = counts.get(source, 0) + 1
    return counts


@given(spans, st.integers(0, 30), st.integers(0, 30), st.booleans())
def test_counts_match_a_token_by_token_count(raw, start, length, adjacent):
    if adjacent:  # a load's keys: one medium, adjacent, in order (the fast path)
        ranges, lo = [], raw[0][0] if raw else 0
        for _, size, _ in raw:
            ranges.append((lo, lo + size, "CPU"))
            lo += size
    else:
        ranges = [(lo, lo + size, medium) for lo, size, medium in raw]
    assert tokens_by_source(ranges, start, start + length) == by_token(ranges, start, start + length)
