"""A tier event whose keys are each a run of one block (a decode step's blocks of many
requests) is converted in one pass (``EventConverter._one_block_events``) into exactly
the ``BlockStored`` events, in the same order, that finding and building its runs one by
one gives (``one_block_runs = False``): with extra keys of every kind, tokens held as a
tuple, first blocks, and mixed with what that pass leaves to the general one (chains,
unrecorded keys, several groups, a group it does not know, placeholder mode; other media
and blocks without extra keys, which it takes)."""

import msgspec
import pytest

from kvoffload.keys import block_extra_keys, make_offload_key
from kvoffload.manager import OffloadingEvent
from kvoffload.scheduler import KVGroup
from kvoffload.scheduler.events import EventConverter

GROUPS = (KVGroup(4), KVGroup(8, kind="sliding_window", sliding_window=64))


def _hash(i: int, size: int = 32) -> bytes:
    return (i.to_bytes(4, "big") * 8)[-size:]  # low 4 distinct per i


def _converters(mode="self_describing"):
    fast = EventConverter(GROUPS, 1, mode)
    general = EventConverter(GROUPS, 1, mode)
    general.one_block_runs = False
    return fast, general


def _remember(converters, key, parent, tokens, start, extra=None):
    for converter in converters:
        converter.remember(key, parent, tokens, start, start + 4, extra)


def _requests(converters, count=6, group=0, chain=1, size=32, cut_parent=None):
    """``count`` requests' next blocks (``chain`` of each, consecutive), recorded: keys in
    request order. Request ``i`` has extra keys of a kind by ``i % 4``: none, an adapter,
    an adapter and a multimodal item, a salt (on its block 0, which has no parent); request
    ``cut_parent``'s parent hash is cut to 12 bytes."""
    keys = []
    for i in range(count):
        tokens = tuple(range(100 * i, 100 * i + 20)) if i % 2 else list(range(100 * i, 100 * i + 20))
        for b in range(chain):
            j = 2 + b if i % 4 != 3 else b  # block index (the salted one's from block 0)
            extra = block_extra_keys(
                4 * j,
                4 * j + 4,
                lora_name="ad" if i % 4 in (1, 2) else None,
                lora_path="/ad" if i % 4 in (1, 2) else None,
                mm_features=[("img", 4 * j + 1, 2)] if i % 4 == 2 else (),
                cache_salt="salt" if i % 4 == 3 else None,
            )
            key = make_offload_key(_hash(1000 * i + j, size), group)
            parent = _hash(1000 * i + j - 1, 12 if i == cut_parent else size) if j else None
            _remember(converters, key, parent, tokens, 4 * j, extra)
            keys.append(key)
    return keys


def _convert(converters, events):
    return [[msgspec.structs.astuple(e) for e in c.convert(events)] for c in converters]


def test_a_decode_steps_blocks_are_one_event_each_as_the_general_pass_says():
    converters = _converters()
    keys = _requests(converters)
    fast, general = _convert(converters, [OffloadingEvent(keys, "CPU", False)])
    assert fast == general
    assert len(fast) == len(keys)  # a run of one block each
    assert [e[0] for e in fast] == [[int.from_bytes(k[-12:-4], "big")] for k in keys]
    assert {type(e[2]) for e in fast} == {list}  # tokens said as a list, also from a tuple
    assert [e[6] for e in fast] == [None, "ad", "ad", None, None, "ad"]  # lora_name
    assert fast[1][7] == [("ad",)] and fast[2][7] == [("ad", ("img", 1))] and fast[3][7] == [("salt",)]
    assert fast[3][1] is None  # block 0: no parent
    assert fast[0][7] is None


@pytest.mark.parametrize(
    "case",
    [
        "chains",
        "unrecorded",
        "two groups",
        "unknown group",
        "placeholder",
        "disk",
        "all plain",
        "one key",
        "hashes of two sizes",
        "hash sizes that add up",
        "short hashes",
        "parents of two sizes",
    ],
)
def test_every_other_event_says_the_same_in_both(case):
    converters = _converters("placeholder" if case == "placeholder" else "self_describing")
    medium = "DISK" if case == "disk" else "CPU"
    if case == "chains":  # runs of two blocks among runs of one
        keys = _requests(converters, count=3, chain=2) + _requests(converters, count=3)
    elif case == "unrecorded":
        keys = _requests(converters) + [make_offload_key(_hash(9000 + i), 0) for i in range(3)]
    elif case == "two groups":
        keys = _requests(converters, count=3) + _requests(converters, count=3, group=1)
    elif case == "unknown group":
        keys = _requests(converters, group=5)
    elif case == "all plain":  # no block with extra keys
        keys = [k for i, k in enumerate(_requests(converters, count=8)) if i % 4 == 0]
    elif case == "one key":
        keys = _requests(converters, count=1)
    elif case == "hashes of two sizes":
        keys = _requests(converters, count=3) + _requests(converters, count=3, size=16)
    elif case == "hash sizes that add up":  # 16 + 15 + 17 bytes: three keys' worth of 16
        keys = [_requests(converters, count=1, size=n)[0] for n in (16, 15, 17)]
    elif case == "short hashes":  # shorter than the 8 bytes a wire hash takes
        keys = _requests(converters, size=5)
    elif case == "parents of two sizes":  # (the keys all of one size)
        keys = _requests(converters, count=3, cut_parent=1)  # (none at its block 0)
    else:
        keys = _requests(converters)
    fast, general = _convert(converters, [OffloadingEvent(keys, medium, False)])
    assert fast == general
    assert fast  # (something was said)
