"""Prefix scoring: for each engine, the longest prefix of a prompt it can serve, per tier.

Contract:

* Input: the prompt's length in blocks ``n``; per KV-cache group a ``GroupMasks`` (the
  holder bitmask of each of the prompt's blocks, ``kvoffload.index.table``; the list may
  be shorter than ``n``: missing blocks are held by nobody), its holders' strides, and
  how many trailing blocks it needs (``kvoffload.index.groups``; ``None``: all).
* Output: for each engine slot, four cumulative prefix lengths in blocks, ``(device,
  host, disk, shared)`` with ``device <= host <= disk <= shared``:

  - ``device``: the leading blocks all held on the engine's device (its own prefix cache).
  - level ``k`` > 0: ``device`` plus the run of blocks after it that each lie in at least
    one of the tiers ``host .. k``. Device copies after the device run do not count: an
    engine reuses its device cache for a leading run only, then loads the rest.
  - A tier whose blocks span ``f`` registered blocks (stride ``f``) holds a registered
    block when it holds the hash ending that block's span; a span cut by the prompt's
    end is not held.
  - Hybrid models: the full-attention groups bound each level (the smallest of their
    prefixes); a group that needs only the last ``w`` blocks then lowers it to the
    largest length ``L`` whose ``w`` blocks before ``L`` are each held in some tier up to
    that level (any of them, device included).
* ``weighted(levels, weights)`` = sum over levels of (blocks first reached at that level) x
  (that level's weight): device blocks count ``weights.device`` each, the blocks the
  host tier adds ``weights.host``, and so on.
* Cost: a constant number of numpy passes over the prompt per group and per 16 engines,
  then O(1) numpy calls per engine; pure arithmetic, no index access.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvoffload.index.tiers import BITS_PER_ENGINE, TierWeights

Levels = tuple[int, int, int, int]
ENGINES_PER_WORD = 64 // BITS_PER_ENGINE
_ONES = np.uint64(0x1111_1111_1111_1111)
_LEVEL_MASKS = (0b0001, 0b0011, 0b0111, 0b1111)  # tiers a level may use, within a nibble
ZERO: Levels = (0, 0, 0, 0)


@dataclass
class GroupMasks:
    words: list[np.ndarray]  # per 64 holder bits, each prompt block's holder mask (uint64[n])
    window: int | None = None  # trailing blocks needed; None = all (full attention)
    strides: dict[int, int] = field(default_factory=dict)  # holder bit -> stride


def prefix_levels(groups: Sequence[GroupMasks], slots: Sequence[int], n: int) -> dict[int, Levels]:
    """Per engine slot, the cumulative prefix lengths (device, host, disk, shared) in blocks."""
    if n <= 0 or not slots or not groups:
        return dict.fromkeys(slots, ZERO)
    full = [g for g in groups if g.window is None]
    partial = [g for g in groups if g.window is not None]
    words = sorted({slot // ENGINES_PER_WORD for slot in slots})
    bounds: dict[int, list[int]] = {slot: [n, n, n, n] for slot in slots}
    for group in full:
        if not any(len(w) and w[0] for w in group.words):
            return dict.fromkeys(slots, ZERO)  # nobody holds the first block
        for word in words:
            arr = _word_array(group, word, n)
            # No engine of this word holds block ``stop``: all their prefixes end there, so
            # the blocks after it are not scored (a prompt's new suffix costs nothing).
            stop = int((arr == 0).argmax()) if len(arr) else 0
            if stop < len(arr) and arr[stop]:
                stop = len(arr)  # held throughout (argmax found no zero)
            lengths = _run_lengths(_cumulative_levels(arr[:stop]), stop)
            for slot in slots:
                if slot // ENGINES_PER_WORD == word:
                    bound = bounds[slot]
                    for k, got in enumerate(lengths[slot % ENGINES_PER_WORD]):
                        if got < bound[k]:
                            bound[k] = got
    if partial:
        _apply_windows(partial, slots, words, bounds, n)
    return {slot: _monotone(bounds[slot]) for slot in slots}


def _apply_windows(
    partial: Sequence[GroupMasks],
    slots: Sequence[int],
    words: list[int],
    bounds: dict[int, list[int]],
    n: int,
) -> None:
    """Lower each bound to the largest length every windowed group allows. One group's
    answer can make another's invalid, so this repeats until no bound moves."""
    nibbles = []  # per group, per slot: each block's tier bits for that engine
    for group in partial:
        arrays = {word: _word_array(group, word, n) for word in words}
        nibbles.append(
            {
                slot: (
                    arrays[slot // ENGINES_PER_WORD] >> np.uint64(BITS_PER_ENGINE * (slot % ENGINES_PER_WORD))
                )
                & np.uint64(0xF)
                for slot in slots
            }
        )
    for slot in slots:
        bound = bounds[slot]
        for k in range(4):
            moved = True
            while moved and bound[k]:
                moved = False
                for group, per_slot in zip(partial, nibbles):
                    held = (per_slot[slot][: bound[k]] & np.uint64(_LEVEL_MASKS[k])) != 0
                    end = _largest_window_end(held, bound[k], group.window or 1)
                    if end != bound[k]:
                        bound[k], moved = end, True


def weighted(levels: Levels, weights: TierWeights) -> float:
    """The tier-weighted length of ``levels`` (in blocks)."""
    total, previous = 0.0, 0
    for level, weight in zip(levels, weights.by_tier()):
        total += (level - previous) * weight
        previous = level
    return total


def _monotone(bound: list[int]) -> Levels:
    # Each level may use every tier the one before it may, so it is never shorter.
    for k in range(1, 4):
        bound[k] = max(bound[k], bound[k - 1])
    return (bound[0], bound[1], bound[2], bound[3])


def _word_array(group: GroupMasks, word: int, n: int) -> np.ndarray:
    """The group's masks of one 64-bit word of holder bits, as uint64[n], with strided
    holders' bits moved to the registered blocks their spans cover."""
    arr = group.words[word] if word < len(group.words) else np.zeros(n, dtype=np.uint64)
    if group.strides:
        by_stride: dict[int, int] = {}
        low, high = 64 * word, 64 * (word + 1)
        for bit, stride in group.strides.items():
            if stride > 1 and low <= bit < high:
                by_stride[stride] = by_stride.get(stride, 0) | (1 << (bit - low))
        if by_stride:
            positions = np.arange(n)
            for stride, bits in by_stride.items():
                ends = (positions // stride + 1) * stride - 1
                spanned = np.where(ends < n, arr[np.minimum(ends, n - 1)], np.uint64(0))
                flags = np.uint64(bits)
                arr = (arr & ~flags) | (spanned & flags)
    return arr


def _cumulative_levels(arr: np.ndarray) -> np.ndarray:
    """uint64[4, n]: per level a running AND whose bit ``4e`` stays set while engine
    ``e``'s prefix at that level continues (see the module contract)."""
    out = np.empty((4, len(arr)), dtype=np.uint64)
    device = arr & _ONES
    np.bitwise_and.accumulate(device, out=out[0])
    lower = np.zeros_like(arr)
    for level in (1, 2, 3):
        lower |= (arr >> np.uint64(level)) & _ONES  # host, then disk, then shared joins
        np.bitwise_and.accumulate(lower | out[0], out=out[level])
    return out


def _run_lengths(cums: np.ndarray, n: int) -> list[list[int]]:
    """Per engine of the word and per level, how long its bit stays set in ``cums``.

    A running AND only loses bits, so each engine's length is where its bit drops: only
    the few positions where a level's value changes are looked at."""
    lengths = [[n, n, n, n] for _ in range(ENGINES_PER_WORD)]
    if not n:
        return lengths
    for level, dropped in enumerate((~cums[:, 0] & _ONES).tolist()):  # never set: length 0
        while dropped:
            low = dropped & -dropped
            lengths[(low.bit_length() - 1) // BITS_PER_ENGINE][level] = 0
            dropped ^= low
    # The levels' rows end to end, compared in one 1-D pass (half the cost of a 2-D one).
    flat = cums.reshape(-1)
    at = np.flatnonzero(flat[1:] != flat[:-1])
    drops = (flat[at] & ~flat[at + 1]).tolist()
    for place, dropped in zip(at.tolist(), drops):
        level, i = divmod(place, n)
        if i == n - 1:
            continue  # a row's last value against the next row's first: no drop
        while dropped:
            low = dropped & -dropped
            lengths[(low.bit_length() - 1) // BITS_PER_ENGINE][level] = i + 1
            dropped ^= low
    return lengths


def _largest_window_end(held: np.ndarray, bound: int, window: int) -> int:
    """The largest ``L <= bound`` whose ``window`` blocks before ``L`` are all held."""
    zeros = np.flatnonzero(~held[:bound])
    length = bound
    j = len(zeros) - 1
    while length > 0:
        while j >= 0 and zeros[j] >= length:
            j -= 1
        if j < 0 or zeros[j] < length - window:
            return length
        length = int(zeros[j])
    return 0
