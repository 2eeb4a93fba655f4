"""The free-space floor: the free space the disk tier's stores leave the file system.

The floor is ``max(min_free_bytes, min_free_fraction * file-system size)`` bytes; both 0
is no floor. A store is declined when reserving its not-yet-reserved chunks
(``kvoffload.tiers.fs.space``) would leave the file system less free space than the floor.
Only chunks this process has not reserved yet count as needing space: rewriting a slot
takes none.

* ``check_floor_settings(min_free_fraction, min_free_bytes)``: ``ValueError`` naming a bad
  setting (a fraction outside [0, 1), bytes not a non-negative int); it touches no disk, so
  it can run before anything is created.
* ``floor_bytes(path, min_free_fraction, min_free_bytes)``: the floor for the file system
  holding ``path`` (one ``statvfs``).
* ``check_floor(path, floor, space, slots)``: ``FloorDeclined`` (its message says how much
  is free, needed and kept) when storing ``slots`` would go below ``floor``. It calls
  ``statvfs`` only when there is a floor and the store needs space; that ``OSError``
  propagates.
"""

from __future__ import annotations

import os

from kvoffload.tiers.fs.space import SlotSpace


class FloorDeclined(Exception):
    """A store that would leave the file system less free space than the floor."""


def check_floor_settings(min_free_fraction: float, min_free_bytes: int) -> None:
    if not isinstance(min_free_fraction, (int, float)) or not 0 <= min_free_fraction < 1:
        raise ValueError(f"min_free_fraction must be in [0, 1), got {min_free_fraction!r}")
    if not isinstance(min_free_bytes, int) or isinstance(min_free_bytes, bool) or min_free_bytes < 0:
        raise ValueError(f"min_free_bytes must be a non-negative int, got {min_free_bytes!r}")


def floor_bytes(path: str, min_free_fraction: float, min_free_bytes: int) -> int:
    fs = os.statvfs(path)
    return max(min_free_bytes, int(min_free_fraction * fs.f_blocks * fs.f_frsize))


def check_floor(path: str, floor: int, space: SlotSpace, slots: list[int]) -> None:
    if not floor:  # no floor: the file system's own ENOSPC is the limit
        return
    new = space.unreserved_bytes(slots)
    if not new:
        return
    fs = os.statvfs(path)
    free = fs.f_bavail * fs.f_frsize
    if free - new < floor:
        raise FloorDeclined(f"{free} bytes free, it needs {new}, and the free-space floor is {floor}")
