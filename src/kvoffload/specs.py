"""Load/store specs: where the blocks of one transfer job live in one medium.

The scheduler side hands out specs (block ids, nothing else); the worker side turns a
(source, destination) pair of specs into copies. Every spec has a ``medium``, the name
events and job routing use. Torch-free: the scheduler imports this without the worker.

* ``CPULoadStoreSpec(block_ids)``: host block ids of the CPU tier (int64), in key order.
* ``DiskLoadStoreSpec(block_ids, keys)``: slots of the local-disk tier and the key each
  holds (the worker writes the key into the block and checks it on every read).
* ``RemoteLoadStoreSpec(keys)``: blocks of the shared remote tier, addressed by key.
* ``DeviceLoadStoreSpec(block_ids, group_sizes, block_indices)``: the device half of a
  job. ``block_ids`` are the device block ids of every KV-cache group concatenated in
  group order; ``group_sizes[g]`` says how many belong to group ``g`` (zero is allowed: a
  group may take no part in a job); ``block_indices[g]`` is the logical index, counted in
  device blocks within the request, of group ``g``'s first block in this job. The logical
  index only matters when one host block spans several device blocks (see
  ``kvoffload.transfer.mapping``): it says how far into its first host block a group
  starts. The medium is ``"GPU"`` for every accelerator, as in vLLM's events; a
  CPU-resident engine KV cache (vLLM's CPU build) uses the same spec. The host half of
  such a job lists the host blocks of all groups concatenated in the same group order.
"""

from __future__ import annotations

from abc import ABC
from collections.abc import Sequence

import numpy as np

MEDIUM_DEVICE = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_DISK = "DISK"  # the local-disk tier; its wire events say medium STORAGE, locality LOCAL
MEDIUM_REMOTE = "REMOTE"  # the shared Redis/Valkey tier; wire: medium STORAGE, locality REMOTE
MEDIUM_MOONCAKE = "MOONCAKE"  # the shared Mooncake Store tier; wire: medium STORAGE, locality REMOTE
MEDIUM_OBJECT = "OBJECT"  # the object-storage (S3 API) tier; wire: medium STORAGE, locality REMOTE


class LoadStoreSpec(ABC):
    """Where blocks live in one medium; the worker side turns pairs of specs into copies."""

    medium: str = ""


def _int_array(name: str, values: Sequence[int] | np.ndarray) -> np.ndarray:
    array = np.asarray(values)
    if array.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {array.shape}")
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"{name} must hold integers, got dtype {array.dtype}")
    return array.astype(np.int64, copy=False)


class CPULoadStoreSpec(LoadStoreSpec):
    """Host block ids (int64), in key order. Given as a sequence, the ids are kept as a
    tuple and the array is made on the first read of ``block_ids``: the scheduler thread
    hands out a spec per job and rarely reads it; the worker does."""

    medium = MEDIUM_CPU

    def __init__(self, block_ids: Sequence[int] | np.ndarray) -> None:
        if isinstance(block_ids, np.ndarray):
            self._array: np.ndarray | None = block_ids.astype(np.int64, copy=False)
            self._ids: tuple[int, ...] | None = None
        else:
            self._array, self._ids = None, tuple(block_ids)

    @property
    def block_ids(self) -> np.ndarray:
        array = self._array
        if array is None:  # (the ids stay: a second thread reading now makes an equal array)
            array = self._array = np.asarray(self._ids, dtype=np.int64)
        return array

    def __repr__(self) -> str:
        return f"CPULoadStoreSpec({self.block_ids.tolist()})"


class DiskLoadStoreSpec(LoadStoreSpec):
    """Disk-tier slot ids (int64) and the key of each, in key order."""

    medium = MEDIUM_DISK

    def __init__(self, block_ids: Sequence[int] | np.ndarray, keys: Sequence[bytes]) -> None:
        self.block_ids = _int_array("block_ids", block_ids)
        self.keys = list(keys)
        if len(self.keys) != len(self.block_ids):
            raise ValueError(
                f"{len(self.block_ids)} block_ids but {len(self.keys)} keys; give one key per block"
            )

    def __repr__(self) -> str:
        return f"DiskLoadStoreSpec({self.block_ids.tolist()}, {len(self.keys)} keys)"


class RemoteLoadStoreSpec(LoadStoreSpec):
    """Keys of blocks in the shared remote tier, in key order (the store addresses blocks
    by key alone: there are no slots)."""

    medium = MEDIUM_REMOTE

    def __init__(self, keys: Sequence[bytes]) -> None:
        self.keys = list(keys)

    def __repr__(self) -> str:
        return f"RemoteLoadStoreSpec({len(self.keys)} keys)"


class DeviceLoadStoreSpec(LoadStoreSpec):
    """Device block ids of several KV-cache groups, concatenated in group order."""

    medium = MEDIUM_DEVICE

    def __init__(
        self,
        block_ids: Sequence[int] | np.ndarray,
        group_sizes: Sequence[int] | np.ndarray,
        block_indices: Sequence[int] | np.ndarray,
    ) -> None:
        self.block_ids = _int_array("block_ids", block_ids)
        self.group_sizes = _int_array("group_sizes", group_sizes)
        self.block_indices = _int_array("block_indices", block_indices)
        if len(self.block_indices) != len(self.group_sizes):
            raise ValueError(
                f"block_indices has {len(self.block_indices)} entries but group_sizes has "
                f"{len(self.group_sizes)}; give one per KV-cache group"
            )
        if (self.group_sizes < 0).any():
            bad = int(self.group_sizes[self.group_sizes < 0][0])
            raise ValueError(f"group_sizes must be non-negative, got {bad}")
        if (self.block_indices < 0).any():
            bad = int(self.block_indices[self.block_indices < 0][0])
            raise ValueError(f"block_indices must be non-negative, got {bad}")
        total = int(self.group_sizes.sum())
        if total != len(self.block_ids):
            raise ValueError(f"group_sizes sum to {total} but {len(self.block_ids)} block_ids were given")

    @property
    def num_groups(self) -> int:
        return len(self.group_sizes)

    def group_block_ids(self, group: int) -> np.ndarray:
        """The device block ids of ``group`` (a view into ``block_ids``)."""
        offsets = np.concatenate(([0], np.cumsum(self.group_sizes)))
        return self.block_ids[offsets[group] : offsets[group + 1]]

    def __repr__(self) -> str:
        return (
            f"DeviceLoadStoreSpec({self.block_ids.tolist()}, "
            f"group_sizes={self.group_sizes.tolist()}, "
            f"block_indices={self.block_indices.tolist()})"
        )
