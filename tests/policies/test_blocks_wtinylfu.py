"""W-TinyLFU's C paths (``kvoffload.policies._blocks``: the sketch, touch and eviction)
answer every call as their Python versions: the same counts, estimates, victims and
segments over random sequences, aging and failed evictions included."""

from __future__ import annotations

import random

import pytest

import kvoffload.policies.wtinylfu as wtinylfu_module
from kvoffload.policies import blocks, sketch
from kvoffload.policies.wtinylfu import WTinyLFUPolicy

native = pytest.mark.skipif(not blocks.NATIVE, reason="kvoffload.policies._blocks not built")
PY_SKETCH = sketch.PYTHON_VERSIONS["FrequencySketch"]


def random_key(rng: random.Random) -> object:
    """Trace-like keys mostly; bytes of any length, bytearrays and ints of any sign too."""
    kind = rng.randrange(6)
    if kind < 3:
        return rng.randrange(50).to_bytes(8, "big") + b"\x00\x00\x00\x00"
    if kind == 3:
        return rng.randbytes(rng.randrange(41))
    if kind == 4:
        return bytearray(rng.randbytes(rng.randrange(17)))
    return rng.randrange(-(10**30), 10**30)


def sketch_run(make, seed: int) -> list:
    rng = random.Random(seed)
    s = make(rng.choice((3, 5, 40, 300)), rng.choice((1, 2, 10)), rng.choice((1, 2)))
    seen: list = [s.width, s.sample_size]
    for _ in range(1500):
        op = rng.randrange(40)
        key = random_key(rng)
        if op == 0:
            s.age()
        elif op == 1:
            s.clear()
        elif op < 10:
            seen.append(s.estimate(key))
        else:
            s.increment(key)
        seen.append(s.counts())
    return seen


@native
@pytest.mark.parametrize("seed", range(12))
def test_native_sketch_counts_as_the_python_one(seed):
    on_c = sketch_run(sketch.FrequencySketch, seed)
    assert on_c == sketch_run(PY_SKETCH, seed)
    highest = [max(v) for v in on_c if isinstance(v, bytes)]
    assert 1 < max(highest) <= 15  # it counted up, within 4 bits
    assert any(later < earlier for earlier, later in zip(highest, highest[1:]))  # and aged or cleared


@native
def test_native_sketch_refuses_what_the_python_one_refuses():
    for make in (sketch.FrequencySketch, PY_SKETCH):
        s = make(8)
        with pytest.raises(TypeError, match="FrequencySketch keys must be bytes or int, got str"):
            s.increment("a")
        with pytest.raises(TypeError, match="got float"):
            s.estimate(1.5)
        with pytest.raises(ValueError, match="capacity must be a non-negative int, got -1"):
            make(-1)
        with pytest.raises(ValueError, match="sample_factor must be a positive int, got 0"):
            make(8, 0)
    from kvoffload.policies import _blocks

    with pytest.raises(TypeError, match="sketch must be a native Sketch"):
        _blocks.wtinylfu_touch(blocks.Order(), blocks.Order(), blocks.Order(), PY_SKETCH(8), [b"k"], 1)


def drive(seed: int) -> list:
    """The policy alone under random calls (busy and protected keys included, so evictions
    fail and are undone): every answer, the segments and the sketch's counts."""
    rng = random.Random(seed)
    p = WTinyLFUPolicy(
        rng.choice((6, 12, 20)),
        window_fraction=rng.choice((0.01, 0.2, 0.4)),
        protected_fraction=rng.choice((0.0, 0.5, 0.8)),
        sample_factor=rng.choice((1, 3, 10)),
    )
    statuses: dict = {}
    seen: list = []
    for _ in range(500):
        op = rng.randrange(5)
        keys = [i.to_bytes(8, "big") for i in rng.sample(range(40), rng.randint(1, 7))]
        if op == 0:
            new = [key for key in keys if key not in statuses]
            made = [blocks.BlockStatus(j, rng.choice((-1, 0, 0, 0, 1))) for j in range(len(new))]
            p.insert_many(new, made)
            statuses.update(zip(new, made))
        elif op == 1:
            p.touch(keys)
        elif op == 2:
            victims = p.evict(rng.randint(1, 5), set(keys[:2]))
            seen.append(("evict", victims))
            for key in victims or ():
                del statuses[key]
        elif op == 3:
            key = rng.choice(keys)
            if key in statuses and statuses[key].ref == -1:
                p.remove(key)
                del statuses[key]
        else:
            for status in rng.sample(list(statuses.values()), min(3, len(statuses))):
                status.ref = rng.choice((-1, 0, 0, 2))
        segments = (p._window, p._probation, p._protected)
        seen.append([segment.keys() for segment in segments])
        seen.append(sorted((key, s.ref) for key, s in statuses.items()))
        seen.append(p.sketch.counts())
    return seen


@native
@pytest.mark.parametrize("seed", range(16))
def test_native_wtinylfu_chooses_as_the_python_one(seed, monkeypatch):
    on_c = drive(seed)
    monkeypatch.setattr(wtinylfu_module, "Order", blocks.PYTHON_VERSIONS["Order"])
    for name, function in wtinylfu_module.PYTHON_VERSIONS.items():
        monkeypatch.setattr(wtinylfu_module, name, function)
    assert isinstance(WTinyLFUPolicy(4).sketch, PY_SKETCH)  # the Python versions ran
    assert on_c == drive(seed)
    evictions = [entry[1] for entry in on_c if isinstance(entry, tuple)]
    assert None in evictions and len([v for v in evictions if v]) > 20  # some failed, many did not
