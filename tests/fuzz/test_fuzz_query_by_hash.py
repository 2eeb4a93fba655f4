"""Fuzzing the router index's ``/query_by_hash`` body parser (``index.requests.parse``),
whose block hashes go through the C parser ``index._hashfind.parse_hashes`` where it was
built and through msgspec and numpy otherwise.

* Any body, JSON or not, gives a request or ``BadRequest``: nothing else.
* With and without the C parser the answer is the same (the same hashes, or the same
  ``BadRequest``: field and message), for hashes of every form JSON allows and some it does
  not: 64-bit edges either side, negatives, ``-0``, exponents, fractions, leading zeros,
  strings, nesting, whitespace anywhere.
* ``parse_hashes`` on any text: ``None``, or exactly the uint64 values msgspec reads from
  it (never a value msgspec would refuse).
"""

from __future__ import annotations

import contextlib
import json

import msgspec
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fuzzing import TIMEOUT, fuzz
from kvoffload.index import requests
from kvoffload.index.requests import BadRequest, parse

pytestmark = pytest.mark.timeout(TIMEOUT)

needs_c = pytest.mark.skipif(requests._hashfind is None, reason="kvoffload.index._hashfind not built")

EDGES = [0, 1, -1, 2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 2**64 - 1, 2**64, 10**19, 10**20, -(10**19)]
hash_int = st.one_of(st.integers(-(2**64), 2**65), st.sampled_from(EDGES))
number_text = st.one_of(
    hash_int.map(str),
    st.sampled_from(["-0", "0.0", "1e3", "1E3", "1.5", "01", "-01", "00", "1e-3", "-", "+1", "1_0", "0x10",
                     "99999999999999999999999", "18446744073709551615", "18446744073709551616", "NaN",
                     "Infinity", "true", "null", '"5"', "[]", "[1]", "{}"]),
)  # fmt: skip
ws = st.sampled_from(["", " ", "\n", "\t", "\r\n  ", "\u00a0", "\x0b"])


@st.composite
def hashes_text(draw) -> str:
    if draw(st.booleans()):
        return draw(
            st.sampled_from(
                ["null", "[]", "[ ]", "{}", '"x"', "5", "[,]", "[1,]", "[1 2]", "[[1]]", "[", "]"]
            )
        )
    items = draw(st.lists(number_text, max_size=8))
    return draw(ws) + "[" + ",".join(draw(ws) + t + draw(ws) for t in items) + "]" + draw(ws)


@st.composite
def body(draw) -> bytes:
    kind = draw(st.sampled_from(["object", "raw", "json"]))
    if kind == "raw":
        return draw(st.binary(max_size=200))
    if kind == "json":
        return json.dumps(draw(st.recursive(st.none() | st.integers() | st.text(max_size=5),
                                            lambda c: st.lists(c) | st.dictionaries(st.text(max_size=5), c),
                                            max_leaves=10))).encode()  # fmt: skip
    fields = []
    if draw(st.booleans()):
        fields.append('"model_name": ' + draw(st.sampled_from(['"m"', '""', "null", "3", '"x"'])))
    for name in draw(st.lists(st.sampled_from(["block_hashes", "seq_hashes"]), max_size=2)):
        fields.append(f'"{name}": ' + draw(hashes_text()))
    if draw(st.booleans()):
        fields.append('"tenant_id": ' + draw(st.sampled_from(['"t"', "1", "null"])))
    return ("{" + ",".join(fields) + "}").encode()


@contextlib.contextmanager
def without_c():
    native, requests._hashfind = requests._hashfind, None
    try:
        yield
    finally:
        requests._hashfind = native


def answer(data: bytes):
    try:
        request = parse("query_by_hash", data)
    except BadRequest as exc:
        return ("bad", exc.field, str(exc))
    hashes = request.block_hashes
    assert isinstance(hashes, np.ndarray) and hashes.dtype == np.uint64
    return ("ok", request.model_(), request.tenant_id, hashes.tolist())


@fuzz(400)
@given(body())
def test_any_body_is_a_request_or_a_bad_request_the_same_with_and_without_c(data):
    first = answer(data)
    if requests._hashfind is not None:
        with without_c():
            assert answer(data) == first


_LIST = msgspec.json.Decoder(list[int] | None)


@needs_c
@fuzz(800)
@given(st.one_of(hashes_text(), st.text(max_size=40)))
def test_parse_hashes_gives_none_or_exactly_what_msgspec_reads(text):
    raw = text.encode()
    parsed = requests._hashfind.parse_hashes(raw)
    if parsed is None:
        return
    values = _LIST.decode(raw)  # the C parser took it: it is a JSON array of integers
    assert values is not None
    assert np.frombuffer(parsed, dtype=np.uint64).tolist() == [v % 2**64 for v in values]
    assert all(-(2**63) <= v < 2**64 for v in values)
