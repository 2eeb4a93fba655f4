"""Sub-block mapping: which host sub-block each device block of a job goes to or from.

With ``F = blocks_per_offload_block`` device blocks per host block, host block ``b`` holds
device-sized sub-blocks ``b*F .. b*F+F-1`` (rows of ``HostBlockPool.sub_blocks``). For
KV-cache group ``g`` of a job, with ``n = group_sizes[g]`` device blocks whose first has
logical index ``s = block_indices[g]`` in its request:

* the group's first host block is entered part-way: ``s % F`` sub-blocks are skipped;
* device block ``i`` (``0 <= i < n``) maps to host block ``host[(s % F + i) // F]``,
  sub-block ``(s % F + i) % F``;
* the last host block may be partial; sub-blocks outside the mapping are not touched;
* the group therefore uses ``ceil((s % F + n) / F)`` host blocks (0 when ``n == 0``).

The host spec lists the host blocks of all groups concatenated in group order (each
group's offload keys are its own, so each group has its own host blocks); group ``g``'s
host blocks are the contiguous slice after those of groups ``0..g-1``. The same mapping
serves stores and loads.

Everything is computed with vectorised numpy over the whole job.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class GroupMapping:
    """Row pairs of one group: ``device_rows[i]`` <-> host sub-block ``host_rows[i]``."""

    group: int
    device_rows: np.ndarray  # int64, device block ids
    host_rows: np.ndarray  # int64, host_block_id * F + sub-block


def host_blocks_per_group(
    group_sizes: np.ndarray, block_indices: np.ndarray, blocks_per_offload_block: int
) -> np.ndarray:
    """How many host blocks each group of a job spans."""
    f = blocks_per_offload_block
    sizes = np.asarray(group_sizes, dtype=np.int64)
    skips = np.asarray(block_indices, dtype=np.int64) % f
    return np.where(sizes > 0, -(-(skips + sizes) // f), 0)


def map_sub_blocks(
    device_block_ids: np.ndarray,
    group_sizes: np.ndarray,
    block_indices: np.ndarray,
    host_block_ids: np.ndarray,
    blocks_per_offload_block: int,
) -> list[GroupMapping]:
    """Pair every device block of a job with its host sub-block, per group.

    Raises ``ValueError`` when the number of host block ids does not match what the
    groups span.
    """
    f = blocks_per_offload_block
    sizes = np.asarray(group_sizes, dtype=np.int64)
    device = np.asarray(device_block_ids, dtype=np.int64)
    host = np.asarray(host_block_ids, dtype=np.int64)
    per_group = host_blocks_per_group(sizes, block_indices, f)
    expected = int(per_group.sum())
    if len(host) != expected:
        raise ValueError(
            f"host spec has {len(host)} block ids but the device spec spans {expected} "
            f"host blocks (per group {per_group.tolist()}, {f} device blocks per host block)"
        )
    num_groups = len(sizes)
    device_start = np.concatenate(([0], np.cumsum(sizes)))
    host_start = np.concatenate(([0], np.cumsum(per_group)))
    group_of = np.repeat(np.arange(num_groups), sizes)
    # Position of each device block within its group's run of host sub-blocks.
    position = (
        np.arange(len(device), dtype=np.int64)
        - device_start[group_of]
        + (np.asarray(block_indices, dtype=np.int64) % f)[group_of]
    )
    host_block = host[host_start[group_of] + position // f] if len(device) else host[:0]
    host_rows = host_block * f + position % f
    return [
        GroupMapping(
            g, device[device_start[g] : device_start[g + 1]], host_rows[device_start[g] : device_start[g + 1]]
        )
        for g in range(num_groups)
    ]
