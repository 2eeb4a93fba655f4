"""A decode step's passes over its running requests: one loop each, in C when built.

A step of a thousand decoding requests goes over their ids a few times: the tokens each
has computed once the step has run, the running table of those counts and who reached
its next store bound, and (one step in a block's worth) the device blocks appended to
each block table. Each is one function here, written in Python and, when the optional
extension ``kvoffload.scheduler._passes`` was built, in C with identical answers
(``NATIVE``; ``tests/scheduler/test_passes.py`` compares both).

- ``tokens_after(ids, before, scheduled)``: ``before[i] + scheduled.get(ids[i], 0)`` for
  each ``i``, as a new list.
- ``note_running(ids, computed, known, store_at)``: sets ``known[ids[i]] = computed[i]``
  for each ``i`` in order, and returns the indices ``i`` (ascending) where
  ``computed[i] >= store_at[ids[i]]`` (an id missing from ``store_at`` never reaches),
  and the slack: the least ``store_at[ids[i]] - computed[i]`` as a float (``inf`` where
  none has a bound).
- ``advance_below(computed, at_pass, slack)``: whether ``computed[i] - at_pass[i] <
  slack`` for every ``i``. With the slack a pass found nobody reached at (a positive
  one), none of the same ids has reached since unless this is false, bounds unchanged.
- ``append_blocks(ids, new_block_ids, requests)``: for each ``i`` whose
  ``new_block_ids[i]`` is not ``None`` and whose id is in ``requests``, extends each
  group's list of that state's ``block_ids`` by the group's new ids (``zip``: the
  shorter of the two decides).

The sequences given together must be lists or tuples of one length (``ValueError``
otherwise); ``scheduled``, ``known``, ``store_at`` and ``requests`` dicts; counts and
bounds ints (or floats, such as ``inf``) below 2**53.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import compress, repeat
from operator import add, ge, is_not, lt, sub
from typing import Any

_NEVER = float("inf")


def _same_length(*lists: Sequence) -> None:
    if len({len(x) for x in lists}) > 1:
        raise ValueError(f"lists of different lengths: {[len(x) for x in lists]}")


def tokens_after(ids: Sequence[str], before: Sequence[int], scheduled: dict[str, int]) -> list[int]:
    _same_length(ids, before)
    return list(map(add, before, map(scheduled.get, ids, repeat(0))))


def note_running(
    ids: Sequence[str], computed: Sequence[int], known: dict[str, int], store_at: dict[str, float]
) -> tuple[list[int], float]:
    _same_length(ids, computed)
    known.update(zip(ids, computed))
    bounds = list(map(store_at.get, ids, repeat(_NEVER)))
    slack = min(map(sub, bounds, computed), default=_NEVER)
    return list(compress(range(len(ids)), map(ge, computed, bounds))), float(slack)


def advance_below(computed: Sequence[int], at_pass: Sequence[int], slack: float) -> bool:
    _same_length(computed, at_pass)
    return all(map(lt, map(sub, computed, at_pass), repeat(slack)))


def append_blocks(ids: Sequence[str], new_block_ids: Sequence[Any], requests: dict[str, Any]) -> None:
    _same_length(ids, new_block_ids)
    for req_id, new in compress(zip(ids, new_block_ids), map(is_not, new_block_ids, repeat(None))):
        state = requests.get(req_id)
        if state is not None:
            for have, more in zip(state.block_ids, new):
                have += more


python_tokens_after, python_note_running, python_append_blocks = tokens_after, note_running, append_blocks
python_advance_below = advance_below

try:
    from kvoffload.scheduler._passes import (  # type: ignore[no-redef] # noqa: F401
        advance_below,
        append_blocks,
        note_running,
        tokens_after,
    )

    NATIVE = True
except ImportError:  # not built: the Python versions above
    NATIVE = False
