"""``ByteSpan``: every KV tensor of a layout as rows of one byte range, for one-kernel gathers.

A device executor that gathers a batch's pages into staging with one kernel per tensor
pays a kernel launch per layer per batch; on a 32-layer model that launch cost, not the
bus, bounded a store or load at about 0.7 of one pinned ``copy_``. A ``ByteSpan`` views the
address range from the lowest to the highest byte of the layout's tensors as rows of ``g``
bytes (*granules*), ``g`` the largest size that divides every tensor's distance from the
range's start, every row stride and every page size (an engine's per-layer KV tensors are
separate allocations aligned far beyond a page, so ``g`` is usually a whole page). A
batch's pages of every tensor are then one list of granule numbers, and its gather
(``index_select``) or scatter (``index_copy_``) is one kernel.

Contract:

* ``ByteSpan.of(layout, min_granule)`` returns ``None`` when ``g < min_granule`` (the
  index would grow past a small fraction of the bytes moved) or the layout has no rows.
* ``granules(gathers, staging_bytes)`` returns, for a batch of ``staging_plan`` gathers,
  the span granule that each granule of its staging bytes comes from (a store) or goes to
  (a load); staging is dense, so every entry is set.
* ``rows`` is the span as a ``(num_granules, g / width)`` tensor of the widest integer
  type ``g`` and the start allow. It aliases the layout's memory without owning it: the
  executor that holds the layout keeps the tensors alive and calls ``check`` before each
  job (a tensor whose memory was released or moved fails the job instead of touching
  freed memory). The bytes between tensors are never indexed.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence

import numpy as np
import torch

from kvoffload.transfer.cpu_executor import WIDE_TYPES, check_backed
from kvoffload.transfer.layout import KVLayout
from kvoffload.transfer.staging_plan import Gather


class _CudaMemory:
    """The ``__cuda_array_interface__`` of raw device memory (torch aliases it)."""

    def __init__(self, ptr: int, rows: int, width: int, itemsize: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (rows, width),
            "typestr": f"<i{itemsize}" if itemsize > 1 else "|u1",
            "data": (ptr, False),
            "version": 3,
            "strides": None,
        }


def _alias(device: torch.device, ptr: int, nbytes: int, dtype: torch.dtype, width: int) -> torch.Tensor:
    """A ``(nbytes / (width * itemsize), width)`` tensor over ``nbytes`` at ``ptr``."""
    itemsize = dtype.itemsize
    rows = nbytes // (width * itemsize)
    if device.type == "cuda":
        return torch.as_tensor(_CudaMemory(ptr, rows, width, itemsize), device=device)
    raw = (ctypes.c_uint8 * nbytes).from_address(ptr)
    return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).view(rows, width)


class ByteSpan:
    """The layout's tensors as granule rows of one aliasing tensor; see the module docstring."""

    def __init__(self, layout: KVLayout, granule: int, start: int, end: int) -> None:
        self.layout, self.granule = layout, granule
        self._ptrs = [t.data_ptr() for t in layout.tensors]
        self.first = np.asarray([(p - start) // granule for p in self._ptrs], np.int64)
        self.row_stride = np.asarray([t.stride(0) // granule for t in layout.tensors], np.int64)
        self.page = np.asarray(
            [layout.page_bytes(i) // granule for i in range(len(layout.tensors))], np.int64
        )
        dtype = next(d for d in WIDE_TYPES if granule % d.itemsize == 0 and start % d.itemsize == 0)
        self.rows = _alias(layout.device, start, end - start, dtype, granule // dtype.itemsize)

    @classmethod
    def of(cls, layout: KVLayout, min_granule: int = 1) -> ByteSpan | None:
        live = [t for t in layout.tensors if t.shape[0]]
        if not live:
            return None
        start = min(t.data_ptr() for t in live)
        end = max(t.data_ptr() + (t.shape[0] - 1) * t.stride(0) + t.shape[1] for t in live)
        g = 0
        for t in layout.tensors:
            g = math.gcd(g, t.data_ptr() - start, t.shape[1], t.stride(0) if t.shape[0] > 1 else 0)
        if g < max(1, min_granule):
            return None
        return cls(layout, g, start, end)

    def check(self, tensors: Sequence[int]) -> None:
        """``RuntimeError`` naming a tensor whose memory was released or moved."""
        for t in tensors:
            tensor, name = self.layout.tensors[t], self.layout.names[t]
            check_backed(tensor, name)
            if tensor.data_ptr() != self._ptrs[t]:
                raise RuntimeError(f"{name}: its memory moved since the transfer engine was built")

    def granules(self, gathers: Sequence[Gather], staging_bytes: int) -> np.ndarray:
        g = self.granule
        out = np.empty(staging_bytes // g, np.int64)
        for gather in gathers:
            rows = np.asarray(gather.device_rows, np.int64)
            counter = np.arange(len(rows), dtype=np.int64)
            by_page: dict[int, list] = {}
            for col in gather.columns:
                by_page.setdefault(int(self.page[col.tensor]), []).append(col)
            for page, cols in by_page.items():
                t = np.asarray([c.tensor for c in cols], np.int64)
                at = (
                    np.asarray([c.offset // g for c in cols], np.int64)[:, None]
                    + counter * np.asarray([c.stride // g for c in cols], np.int64)[:, None]
                )
                src = self.first[t][:, None] + rows * self.row_stride[t][:, None]
                if page == 1:
                    out[at.ravel()] = src.ravel()
                else:
                    step = np.arange(page, dtype=np.int64)
                    out[(at[..., None] + step).ravel()] = (src[..., None] + step).ravel()
        return out
