"""SlotIndex against a dict: random inserts and removals, small tables (long probe runs,
wrap-around), keys of several lengths; with the C probe (when built) and the Python one."""

from __future__ import annotations

import random

import pytest

from kvoffload.tiers.fs.index import NATIVE, SlotIndex

NOT_BUILT = "could not import kvoffload.tiers.fs._slotfind (not built: no C compiler at install)"
needs_native = pytest.mark.skipif(not NATIVE, reason=NOT_BUILT)


@pytest.fixture(params=[pytest.param(True, marks=needs_native, id="C"), pytest.param(False, id="Python")])
def native(request) -> bool:
    return request.param


@pytest.mark.parametrize("num_slots", [1, 3, 8, 100])
def test_matches_a_dict(num_slots, native):
    rng = random.Random(num_slots)
    index = SlotIndex(num_slots, 12, native=native)
    truth: dict[bytes, int] = {}
    free = list(range(num_slots))
    universe = [rng.randbytes(rng.randint(1, 12)) for _ in range(3 * num_slots + 5)]
    for _ in range(4000):
        key = rng.choice(universe)
        if key in truth and rng.random() < 0.5:
            slot = truth.pop(key)
            index.remove(slot)
            free.append(slot)
        elif key not in truth and free:
            slot = free.pop(rng.randrange(len(free)))
            index.insert(key, slot)
            truth[key] = slot
        probe = rng.choice(universe)
        assert index.find(probe) == truth.get(probe, -1)
        assert index.size == len(truth)
        asked = rng.sample(universe, 4)
        assert index.split(asked) == (
            [truth[key] for key in asked if key in truth],
            [key for key in asked if key not in truth],
        )
    for key, slot in truth.items():
        assert index.find(key) == slot and index.key_of(slot) == key
    index.clear()
    assert all(index.find(key) == -1 for key in universe)


def test_check_key_names_the_bad_key():
    index = SlotIndex(4, 8)
    with pytest.raises(ValueError, match="1..8 bytes"):
        index.check_key(b"123456789")
    with pytest.raises(ValueError, match="1..8 bytes"):
        index.check_key(b"")
    with pytest.raises(ValueError, match="1..8 bytes"):
        index.check_key("text")
    assert index.check_key(b"ok") == b"ok"


@pytest.mark.parametrize("mixed", [False, True], ids=["same length", "mixed lengths"])
def test_insert_many_equals_inserting_one_by_one(mixed, native):
    rng = random.Random(5)
    num_slots = 3000
    index = SlotIndex(num_slots, 16, native=native)
    keys = [rng.randbytes(rng.randint(1, 16) if mixed else 16) for _ in range(2600)]
    keys = list(dict.fromkeys(keys))
    slots = rng.sample(range(num_slots), len(keys))
    for key, slot in zip(keys[:100], slots[:100]):  # entries already there
        index.insert(key, slot)
    index.insert_many(keys[100:], slots[100:])
    assert index.size == len(keys)
    for key, slot in zip(keys, slots):
        assert index.find(key) == slot and index.key_of(slot) == key
    assert index.find(b"absent") == -1
    for slot in slots[::2]:  # removals keep the probe runs intact
        index.remove(slot)
    for i, (key, slot) in enumerate(zip(keys, slots)):
        assert index.find(key) == (-1 if i % 2 == 0 else slot)


def test_a_prefix_or_an_extension_of_a_stored_key_is_absent(native):
    index = SlotIndex(8, 12, native=native)
    index.insert(b"abcdef", 3)
    assert index.find(b"abcdef") == 3
    assert index.find(b"abcde") == -1 and index.find(b"abcdefg") == -1
    assert index.split((b"abcdefg", b"abcdef")) == ([3], [b"abcdefg"])
    index.remove(3)
    index.insert(b"abc", 3)  # the slot reused by a shorter key: the old bytes beyond it stay
    assert index.find(b"abcdef") == -1 and index.find(b"abc") == 3


def test_the_c_probe_rejects_what_is_not_bytes():
    if not NATIVE:
        pytest.skip(NOT_BUILT)
    index = SlotIndex(4, 8, native=True)
    with pytest.raises(TypeError, match="must be bytes"):
        index.find("text")
    with pytest.raises(TypeError, match="list or tuple"):
        index.split(5)


def test_native_true_without_the_extension_names_it(monkeypatch):
    import kvoffload.tiers.fs.index as module

    monkeypatch.setattr(module, "NATIVE", False)
    with pytest.raises(ValueError, match="_slotfind"):
        SlotIndex(4, 8, native=True)


def test_the_c_and_python_writers_build_the_same_index():
    """A process uses one or the other; both must agree with the layout the other's probe
    reads (and a rebuilt index looks the same whichever wrote it)."""
    if not NATIVE:
        pytest.skip(NOT_BUILT)
    rng = random.Random(11)
    c, py = SlotIndex(64, 10, native=True), SlotIndex(64, 10, native=False)
    used: dict[int, bytes] = {}
    for _ in range(3000):
        free = [s for s in range(64) if s not in used]
        if free and (not used or rng.random() < 0.55):
            batch = rng.sample(free, min(len(free), rng.choice([1, 3, 40])))
            keys = [rng.randbytes(rng.randint(1, 10)) for _ in batch]
            keys = [key for key in dict.fromkeys(keys) if key not in used.values()]
            batch = batch[: len(keys)]
            c.insert_many(keys, batch)
            py.insert_many(keys, batch)
            used.update(zip(batch, keys))
        else:
            gone = rng.sample(sorted(used), min(len(used), rng.choice([1, 4])))
            c.remove_many(gone)
            py.remove_many(gone)
            for slot in gone:
                del used[slot]
        assert c.size == py.size == len(used)
    for name in ("_table_array", "_tag_array", "_len_array"):
        assert (getattr(c, name) == getattr(py, name)).all(), name
    rows = [bytes(c._keys[s * 10 : s * 10 + len(key)]) for s, key in used.items()]
    assert rows == list(used.values()) == [py.key_of(s) for s in used]
    assert c.keys_of(list(used)) == py.keys_of(list(used)) == list(used.values())
    for slot, key in used.items():
        assert c.find(key) == py.find(key) == slot
    slot = next(iter(used))
    c.remove(slot)
    with pytest.raises(KeyError, match=f"slot {slot} is not in the index"):
        c.remove(slot)
