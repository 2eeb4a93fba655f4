"""BlockTable: holder bits per hash, refcounts, drops and growth, against a plain model."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvoffload.index.table import BlockTable

U64 = np.uint64


def arr(*hashes: int) -> np.ndarray:
    return np.array(hashes, dtype=U64)


def masks_of(table: BlockTable, *hashes: int) -> list[int]:
    words = table.lookup(arr(*hashes))
    return [sum(int(w[i]) << (64 * k) for k, w in enumerate(words)) for i in range(len(hashes))]


def test_store_sets_one_bit_per_holder_and_counts_new_holds() -> None:
    table = BlockTable()
    assert table.store(arr(10, 11, 12), 0) == 3
    assert table.store(arr(11, 12, 13), 5) == 3
    assert masks_of(table, 10, 11, 12, 13, 99) == [1, 1 | 32, 1 | 32, 32, 0]
    assert len(table) == 4


def test_repeated_announcements_are_reference_counted() -> None:
    table = BlockTable()
    assert table.store(arr(7, 7, 8), 2) == 2  # 7 twice in one event: two announcements
    assert table.store(arr(8), 2) == 0
    assert table.remove(arr(7, 8), 2) == (0, 0)  # one announcement of each is left
    assert masks_of(table, 7, 8) == [4, 4]
    assert table.remove(arr(7, 8), 2) == (2, 0)
    assert masks_of(table, 7, 8) == [0, 0] and len(table) == 0


def test_removing_what_is_not_held_is_counted_unknown_and_changes_nothing() -> None:
    table = BlockTable()
    table.store(arr(1, 2), 0)
    unknown: list[int] = []
    assert table.remove(arr(2, 3, 3), 0, unknown) == (1, 2)
    assert unknown == [3, 3]
    assert table.remove(arr(1), 4) == (0, 1)  # held, but by another holder
    assert masks_of(table, 1, 2) == [1, 0]


def test_drop_forgets_every_hold_of_the_named_bits_only() -> None:
    table = BlockTable()
    table.store(arr(1, 2, 3), 4)
    table.store(arr(2, 3), 5)
    table.store(arr(3, 3), 0)  # refcount 2 for another engine
    table.strides[5] = 4
    ended = table.drop(0b1111 << 4)  # engine slot 1: bits 4..7
    assert ended == {4: 3, 5: 2}
    assert masks_of(table, 1, 2, 3) == [0, 0, 1]
    assert table.strides == {} and len(table) == 1
    assert table.remove(arr(3), 0) == (0, 0)  # slot 0's refcount survived the drop
    assert table.remove(arr(3), 0) == (1, 0)


def test_holder_bits_beyond_64_use_another_word() -> None:
    table = BlockTable()
    table.store(arr(1, 2), 3)
    table.store(arr(2), 64 + 9)
    assert masks_of(table, 1, 2) == [8, 8 | (1 << 73)]
    assert table.holds(73) == [2]
    assert table.drop(1 << 73) == {73: 1}
    assert masks_of(table, 2) == [8]


def test_growth_keeps_every_entry_and_lookups_of_the_absent_find_nothing() -> None:
    rng = np.random.default_rng(1)
    keys = np.unique(rng.integers(0, 2**64 - 1, 20_000, dtype=U64, endpoint=True))
    table = BlockTable(buckets=2)
    for start in range(0, len(keys), 777):
        table.store(keys[start : start + 777], 1)
    assert len(table) == len(keys) and table.capacity >= len(keys)
    assert (table.lookup(keys)[0] == 2).all()
    absent = keys + U64(1)
    absent = absent[~np.isin(absent, keys)]
    assert (table.lookup(absent)[0] == 0).all()
    assert table.remove(keys[::2], 1) == (len(keys[::2]), 0)
    assert len(table) == len(keys) - len(keys[::2])
    assert (table.lookup(keys[1::2])[0] == 2).all() and (table.lookup(keys[::2])[0] == 0).all()


def test_hash_zero_and_the_largest_hash_are_ordinary_keys() -> None:
    table = BlockTable()
    table.store(arr(0, 2**64 - 1), 1)
    assert masks_of(table, 0, 2**64 - 1) == [2, 2]
    assert table.remove(arr(0), 1) == (1, 0)
    assert masks_of(table, 0, 2**64 - 1) == [0, 2]


POOL = [0, 1, 2, 3, 2**63, 2**64 - 1, 12345678901234567]
BITS = [0, 1, 4, 7, 66]


class TableMachine(RuleBasedStateMachine):
    """Random stores, removes and drops agree with a dict of (hash, bit) -> count."""

    def __init__(self) -> None:
        super().__init__()
        self.table = BlockTable(buckets=2)
        self.counts: dict[tuple[int, int], int] = {}

    @rule(hashes=st.lists(st.sampled_from(POOL), max_size=6), bit=st.sampled_from(BITS))
    def store(self, hashes: list[int], bit: int) -> None:
        expected_new = len({h for h in hashes if (h, bit) not in self.counts})
        for h in hashes:
            self.counts[h, bit] = self.counts.get((h, bit), 0) + 1
        assert self.table.store(arr(*hashes), bit) == expected_new

    @rule(hashes=st.lists(st.sampled_from(POOL), max_size=6), bit=st.sampled_from(BITS))
    def remove(self, hashes: list[int], bit: int) -> None:
        released = unknown = 0
        for h in hashes:
            count = self.counts.get((h, bit), 0)
            if count == 0:
                unknown += 1
            elif count == 1:
                del self.counts[h, bit]
                released += 1
            else:
                self.counts[h, bit] = count - 1
        # A hash removed more often than announced releases once; the rest is unknown.
        assert self.table.remove(arr(*hashes), bit) == (released, unknown)

    @rule(slot=st.sampled_from([0, 1, 16]))
    def drop(self, slot: int) -> None:
        mask = 0b1111 << (4 * slot)
        expected: dict[int, int] = {}
        for h, bit in list(self.counts):
            if (mask >> bit) & 1:
                expected[bit] = expected.get(bit, 0) + 1
                del self.counts[h, bit]
        assert self.table.drop(mask) == expected

    @invariant()
    def lookups_agree(self) -> None:
        want = [sum(1 << bit for (h, bit) in self.counts if h == key) for key in POOL]
        assert masks_of(self.table, *POOL) == want
        assert len(self.table) == len({h for h, _ in self.counts})


TestTableMachine = TableMachine.TestCase
TestTableMachine.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)


@given(st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=50))
@settings(max_examples=60, deadline=None)
def test_any_u64_hashes_round_trip(hashes: list[int]) -> None:
    table = BlockTable(buckets=2)
    table.store(arr(*hashes), 3)
    assert masks_of(table, *hashes) == [8] * len(hashes)
    assert sorted(table.holds(3)) == sorted(set(hashes))
