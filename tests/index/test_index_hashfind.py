"""The index's optional C path (``kvoffload.index._hashfind``) against the numpy and msgspec
code it stands in for: same hashes parsed, same slots found, same errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvoffload.index import requests
from kvoffload.index.table import WAYS, BlockTable, _hashfind

NOT_BUILT = "could not import kvoffload.index._hashfind (not built: no C compiler at install)"
pytestmark = pytest.mark.skipif(_hashfind is None, reason=NOT_BUILT)

U64_MAX = (1 << 64) - 1
I64_MIN = -(1 << 63)


class NumpyProbeTable(BlockTable):
    _find = BlockTable._find_numpy


def test_the_c_probe_finds_the_slots_the_numpy_probe_finds() -> None:
    rng = np.random.default_rng(7)
    table = BlockTable(buckets=1024)
    keys = rng.integers(1, 1 << 63, size=3000, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    table.store(keys, 3)
    absent = rng.integers(1, 1 << 63, size=3000, dtype=np.uint64) * np.uint64(2)  # even: never stored
    probe = np.concatenate([keys, absent, np.zeros(1, np.uint64), keys[::-7]])
    native, numpy_ = table._find(probe), table._find_numpy(probe)
    present = native[: len(keys)]
    assert (present >= 0).all() and (native[len(keys) : 2 * len(keys)] == -1).all()
    flat = table.keys.reshape(-1)
    assert (flat[present] == keys).all()
    first = ((keys * np.uint64(0x9E3779B97F4A7C15)) >> table._shift).astype(np.intp)
    assert (present // WAYS != first).any(), "no key overflowed into its second bucket: that path is untested"
    known = probe != 0  # the key 0 finds "some empty slot", not a particular one
    assert (native[known] == numpy_[known]).all()
    (zero_slot,) = native[~known]
    assert zero_slot == -1 or flat[zero_slot] == 0


def test_tables_probed_in_c_and_in_numpy_agree_through_stores_removes_and_growth() -> None:
    rng = np.random.default_rng(11)
    a, b = BlockTable(buckets=2), NumpyProbeTable(buckets=2)
    universe = rng.integers(0, 1 << 64, size=400, dtype=np.uint64, endpoint=False)
    universe[0] = 0
    for _ in range(300):
        hashes = rng.choice(universe, size=int(rng.integers(1, 40)))
        bit = int(rng.integers(0, 70))
        if rng.random() < 0.6:
            assert a.store(hashes, bit) == b.store(hashes, bit)
        else:
            assert a.remove(hashes, bit) == b.remove(hashes, bit)
    for got, want in zip(a.lookup(universe), b.lookup(universe)):
        assert (got == want).all()
    assert len(a) == len(b) > 0


@pytest.mark.parametrize(
    "values",
    [
        [],
        [0],
        [U64_MAX, I64_MIN, -1, 1 << 63, 12345, 10**19, 10**19 - 1, 9, 10, 99],
        np.random.default_rng(3).integers(0, 1 << 64, size=2048, dtype=np.uint64, endpoint=False).tolist(),
        np.random.default_rng(4).integers(0, 1 << 64, size=5000, dtype=np.uint64, endpoint=False).tolist(),
    ],
)
@pytest.mark.parametrize("indent", [None, 2])
def test_parsed_hashes_are_the_u64_values_hash_array_gives(values, indent) -> None:
    raw = json.dumps(values, indent=indent).encode()
    parsed = _hashfind.parse_hashes(raw)
    assert parsed is not None
    assert np.frombuffer(parsed, dtype=np.uint64).tolist() == requests.hash_array(values).tolist()


@pytest.mark.parametrize(
    "raw",
    [b"null", b"[1.5]", b"[1e3]", b"[01]", b'["1"]', b"[1,]", b"[,1]", b"[1 2]", b"[", b"{}", b"1",
     str([1 << 64]).encode(), str([I64_MIN - 1]).encode(), b"[-]", b"[1] 2", b"[99999999999999999999]",
     b"[100000000000000000000]", b"[-00]"],
)  # fmt: skip
def test_anything_but_an_array_of_64_bit_integers_is_left_to_the_slow_path(raw) -> None:
    assert _hashfind.parse_hashes(raw) is None


def _outcome(body: dict):
    try:
        request = requests.parse("query_by_hash", json.dumps(body).encode())
    except requests.BadRequest as exc:
        return ("error", exc.field, str(exc))
    return ("ok", request.block_hashes.tolist())


@pytest.mark.parametrize(
    "body",
    [
        {"model_name": "m", "block_hashes": [1, U64_MAX, -5]},
        {"model_name": "m", "seq_hashes": [I64_MIN, 7]},
        {"model_name": "m", "block_hashes": None, "seq_hashes": [3]},
        {"model_name": "m", "block_hashes": []},
        {"model_name": "m"},
        {"model_name": "m", "block_hashes": None},
        {"model_name": "m", "block_hashes": [1 << 64]},
        {"model_name": "m", "block_hashes": [I64_MIN - 1]},
        {"model_name": "m", "block_hashes": [1.5]},
        {"model_name": "m", "block_hashes": [1, "x"]},
        {"model_name": "m", "seq_hashes": "x"},
    ],
)
def test_requests_parse_the_same_with_and_without_the_extension(body, monkeypatch) -> None:
    with_c = _outcome(body)
    monkeypatch.setattr(requests, "_hashfind", None)
    assert _outcome(body) == with_c
    if with_c[0] == "error":
        assert with_c[1] in ("block_hashes", "seq_hashes")


def test_the_bad_value_and_its_place_are_named() -> None:
    assert _outcome({"model_name": "m", "block_hashes": [1, "x"]}) == (
        "error",
        "block_hashes",
        "invalid block_hashes: Expected `int`, got `str` - at `$.block_hashes[1]`",
    )
    assert _outcome({"model_name": "m", "block_hashes": [1 << 64]})[2] == (
        f"block_hashes must be 64-bit integers, got {1 << 64}"
    )


def test_find_checks_its_buffers() -> None:
    table = BlockTable(buckets=8)
    keys = np.array([5, 6], dtype=np.uint64)
    with pytest.raises(ValueError, match="out must hold 2 intp"):
        _hashfind.find(table.keys, keys, int(table._shift), np.empty(3, dtype=np.intp))
    for shift in (int(table._shift) - 1, int(table._shift) + 1):  # buckets past the table, or too few
        with pytest.raises(ValueError, match="do not match shift"):
            _hashfind.find(table.keys, keys, shift, np.empty(2, dtype=np.intp))
    with pytest.raises(ValueError, match="shift must be in 1..63"):
        _hashfind.find(table.keys, keys, 0, np.empty(2, dtype=np.intp))
