"""kvoffload.scheduler.passes: the C loops give the Python versions' answers, and both
the contract's."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from kvoffload.scheduler import passes


def _built():
    # (with CI set, an import skip fails: make venv builds the extension)
    pytest.importorskip("kvoffload.scheduler._passes")


@pytest.fixture(params=["python", "native"])
def impl(request):
    """(tokens_after, note_running, append_blocks, advance_below) of one implementation."""
    if request.param == "native":
        _built()
        return passes.tokens_after, passes.note_running, passes.append_blocks, passes.advance_below
    return (
        passes.python_tokens_after,
        passes.python_note_running,
        passes.python_append_blocks,
        passes.python_advance_below,
    )


def test_tokens_after_adds_the_scheduled_tokens(impl):
    tokens_after = impl[0]
    ids = ["a", "b", "c"]
    assert tokens_after(ids, [10, 20, 2**70], {"a": 1, "c": 5, "x": 9}) == [11, 20, 2**70 + 5]
    assert tokens_after((), (), {}) == []
    with pytest.raises(ValueError, match=r"\[3, 2\]"):
        tokens_after(ids, [1, 2], {})


def test_note_running_records_every_count_and_returns_who_reached(impl):
    note_running = impl[1]
    known = {"old": 3}
    store_at = {"a": 16, "b": 32, "c": float("inf"), "d": 8}
    ids = ["a", "b", "c", "d", "e"]
    reached, slack = note_running(ids, [16, 31, 10**6, 40, 99], known, store_at)
    assert reached == [0, 3]  # "e" has no bound: it never reaches
    assert slack == -32.0 and type(slack) is float  # the least bound - computed: d's
    assert known == {"old": 3, "a": 16, "b": 31, "c": 10**6, "d": 40, "e": 99}
    assert note_running(["a", "a"], [1, 2], known, store_at) == ([], 14.0)
    assert known["a"] == 2  # in order: the last one said stays
    assert note_running(["c", "e"], [5, 6], known, store_at) == ([], float("inf"))
    assert note_running([], [], known, store_at) == ([], float("inf"))
    with pytest.raises(ValueError, match=r"\[1, 2\]"):
        note_running(["a"], [1, 2], known, store_at)


def test_tokens_after_with_the_dict_in_the_ids_order_or_partly(impl):
    tokens_after = impl[0]
    ids = ["a", "b", "c", "d"]
    aligned = dict(zip(ids, [1, 2, 3, 4]))  # (vLLM's order: the running requests first)
    aligned["new"] = 9
    assert tokens_after(ids, [10, 20, 30, 40], aligned) == [11, 22, 33, 44]
    diverging = {"a": 1, "b": 2, "x": 5, "d": 4, "c": 3}
    assert tokens_after(ids, [10, 20, 30, 40], diverging) == [11, 22, 33, 44]
    equal_not_same = {"".join(["a"]): 1, "".join(["b"]): 2}  # equal strings, other objects
    assert tokens_after(["a", "b", "a"], [0, 0, 5], equal_not_same) == [1, 2, 6]


def test_advance_below(impl):
    advance_below = impl[3]
    assert advance_below([5, 9], [4, 7], 3.0)  # advanced 1 and 2
    assert not advance_below([5, 10], [4, 7], 3.0)  # 3 is not below 3
    assert advance_below([3, 9], [4, 9], 0.5)  # a rejected draft: went back
    assert advance_below([10**9], [1], float("inf"))
    assert advance_below([], [], 1.0)
    with pytest.raises(ValueError, match=r"\[2, 1\]"):
        advance_below([1, 2], [1], 1.0)


def test_append_blocks_extends_each_group_of_known_requests(impl):
    append_blocks = impl[2]
    one = SimpleNamespace(block_ids=[[1, 2], [7]])
    two = SimpleNamespace(block_ids=[[3], []])
    requests = {"one": one, "two": two}
    append_blocks(["one", "two", "gone"], [([4, 5], [8]), None, ([9], [9])], requests)
    assert one.block_ids == [[1, 2, 4, 5], [7, 8]]
    assert two.block_ids == [[3], []]
    append_blocks(["two"], [[[6]]], requests)  # fewer groups given: zip's shorter decides
    assert two.block_ids == [[3, 6], []]
    with pytest.raises(ValueError, match=r"\[2, 1\]"):
        append_blocks(["one", "two"], [None], requests)


def test_native_rejects_what_is_not_a_dict():
    _built()
    with pytest.raises(TypeError, match="scheduled must be a dict, not list"):
        passes.tokens_after(["a"], [1], [("a", 1)])
    with pytest.raises(TypeError, match="store_at must be a dict"):
        passes.note_running(["a"], [1], {}, None)
    with pytest.raises(TypeError, match="requests must be a dict"):
        passes.append_blocks(["a"], [None], ())


@pytest.mark.parametrize("seed", range(20))
def test_native_equals_python_on_random_steps(seed):
    _built()
    rng = random.Random(seed)
    n = rng.randrange(0, 300)
    pool = [f"req-{i}" for i in range(n + 20)]
    ids = [rng.choice(pool) for _ in range(n)]  # repeats included
    before = [rng.randrange(0, 40_000) for _ in ids]
    scheduled = {r: rng.randrange(1, 5) for r in rng.sample(pool, len(pool) // 2)}
    assert passes.tokens_after(ids, before, scheduled) == passes.python_tokens_after(ids, before, scheduled)

    computed = passes.python_tokens_after(ids, before, scheduled)
    store_at = {r: rng.choice([rng.randrange(0, 40_000), float("inf")]) for r in rng.sample(pool, n // 2)}
    start = {r: rng.randrange(100) for r in rng.sample(pool, 5)}
    known_c, known_py = dict(start), dict(start)
    got = passes.note_running(ids, computed, known_c, store_at)
    assert got == passes.python_note_running(ids, computed, known_py, store_at)
    assert list(known_c.items()) == list(known_py.items())  # same values, same insertion order
    aligned = dict(zip(ids, before))  # (the order vLLM fills it in)
    assert passes.tokens_after(ids, before, aligned) == passes.python_tokens_after(ids, before, aligned)
    later = [c + rng.randrange(-1, 4) for c in computed]
    for slack in (0.0, 1.0, 2.0, 3.0, float("inf"), float(got[1])):
        native = passes.advance_below(later, computed, slack)
        assert native == passes.python_advance_below(later, computed, slack)

    def states():
        local = random.Random(seed)
        return {r: SimpleNamespace(block_ids=[[local.randrange(99)] for _ in range(2)]) for r in pool[::2]}

    new = [rng.choice([None, ([rng.randrange(99)], []), ([1, 2], [3])]) for _ in ids]
    req_c, req_py = states(), states()
    passes.append_blocks(ids, new, req_c)
    passes.python_append_blocks(ids, new, req_py)
    assert {r: s.block_ids for r, s in req_c.items()} == {r: s.block_ids for r, s in req_py.items()}
