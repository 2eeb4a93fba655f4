"""``HostRows``: a host block's bytes as the fewest byte buffers, for ``pwritev``/``preadv``.

A host block's payload (``kvoffload.tiers.fs.format``) is its row in every host-pool
tensor, in tensor order. ``HostRows(host_pool).block(b)`` returns those rows as 1-D
``memoryview`` slices (format ``"B"``) of one view over the pool's memory, with rows that
lie back to back in memory merged into one slice: a block-interleaved pool's block is one
buffer, a tensor-major pool's is one per tensor. Slicing a byte view costs a fraction of
indexing a numpy array and casting it, which the store and load paths did per page
(``bench/profile_disk_io.py``). The disk and the shared tier both move blocks through it.

Contract: every pool tensor is 2-D uint8 ``(num_blocks, row_bytes)`` with contiguous rows
(``HostBlockPool``'s guarantee); the views write straight into the pool's memory, and the
pool must outlive this object (it keeps references to the tensors' arrays).
"""

from __future__ import annotations

import ctypes


class HostRows:
    """The rows of host block ``b`` as merged byte views over the pool's memory."""

    def __init__(self, host_pool) -> None:
        arrays = [t.numpy() for t in host_pool.tensors]
        for i, a in enumerate(arrays):
            if a.ndim != 2 or a.itemsize != 1 or (a.shape[1] > 1 and a.strides[1] != 1):
                raise ValueError(
                    f"host pool tensor {i} must be 2-D uint8 with contiguous rows, got shape {a.shape} "
                    f"strides {a.strides} itemsize {a.itemsize}"
                )
        self._arrays = arrays  # keeps the memory alive
        self.num_blocks = int(arrays[0].shape[0]) if arrays else 0
        self.block_bytes = sum(int(a.shape[1]) for a in arrays)
        addresses = [a.__array_interface__["data"][0] for a in arrays]
        if not self.num_blocks:
            self._view, self.segments = memoryview(b""), []
            return
        base = min(addresses)
        end = max(
            addr + (self.num_blocks - 1) * a.strides[0] + a.shape[1] for addr, a in zip(addresses, arrays)
        )
        self._view = memoryview((ctypes.c_uint8 * (end - base)).from_address(base)).cast("B")
        # (offset of row 0, row stride, width) per tensor; a tensor whose row starts where
        # the previous one's ends, with the same stride, extends the previous segment.
        segments: list[list[int]] = []
        for addr, a in zip(addresses, arrays):
            offset, stride, width = addr - base, int(a.strides[0]), int(a.shape[1])
            last = segments[-1] if segments else None
            if last is not None and last[1] == stride and last[0] + last[2] == offset:
                last[2] += width
            else:
                segments.append([offset, stride, width])
        self.segments = [tuple(s) for s in segments]

    def aligned(self, alignment: int) -> bool:
        """Whether every view ``block`` returns starts and ends on a multiple of ``alignment``."""
        if not self.segments:
            return False
        base = ctypes.addressof(ctypes.c_uint8.from_buffer(self._view))
        return all((base + o) % alignment == s % alignment == w % alignment == 0 for o, s, w in self.segments)

    def block(self, b: int) -> list[memoryview]:
        """Host block ``b``'s payload, in order, as byte views into the pool."""
        view = self._view
        return [view[o + b * s : o + b * s + w] for o, s, w in self.segments]
