"""SGLang's host KV pool as pages the tiers read and write in place.

kvoffload's tier workers move a *host block* as its row in every tensor of a host pool
(2-D ``uint8`` tensors ``(num_blocks, row_bytes)`` with contiguous rows,
``kvoffload.tiers.host_rows``). ``PageViews(pool)`` presents SGLang's host pool
(``MHATokenToKVPoolHost``, ``MLATokenToKVPoolHost``) that way, one block per SGLang page,
as views of the pool's own ``kv_buffer``: no copy, and the workers' reads land in the
pages SGLang then copies to the device.

A layout is known by the axis of ``kv_buffer`` that counts tokens or pages; every axis
before it gives one view per index (``(2, layer_num)`` for MHA ``layer_first``: a page is
``2 * layer_num`` pieces), everything after it is one page's row. A page's payload, the
rows in view order, is exactly ``get_data_page(index).flatten()`` (what SGLang's
whole-page methods hand a backend), so the two interfaces store the same bytes:

======================  ==================================  =========  ==========
pool                    ``kv_buffer``                       axis       pieces
======================  ==================================  =========  ==========
MHA ``layer_first``     (2, L, tokens, H, D)                2 tokens   2 x L
MHA ``page_first``      (2, tokens, L, H, D)                1 tokens   2
MHA ``page_first_direct`` (2, pages, L, page, H, D)         1 pages    2
MHA ``page_head``       (2, pages, H, page, L, D)           1 pages    2
MLA ``layer_first``     (L, tokens, 1, dim)                 1 tokens   L
MLA ``page_first``      (tokens, L, 1, dim)                 0 tokens   1
MLA ``page_first_direct`` (pages, L, page, 1, dim)          0 pages    1
======================  ==================================  =========  ==========

Any other layout or pool class is refused by name. ``page_ids(host_indices)`` turns the
token slots SGLang passes (``page_size`` per page, each page's first slot a multiple of
``page_size``) into page numbers, refusing anything else with a ``ValueError`` naming it.
``StagingPages`` is the whole-page interface's bounce buffer: pages of the same payload in
one tensor.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

# (pool kind, layout) -> (axis counting tokens or pages, unit)
_AXES: dict[tuple[str, str], tuple[int, str]] = {
    ("mha", "layer_first"): (2, "tokens"),
    ("mha", "page_first"): (1, "tokens"),
    ("mha", "page_first_direct"): (1, "pages"),
    ("mha", "page_head"): (1, "pages"),
    ("mla", "layer_first"): (1, "tokens"),
    ("mla", "page_first"): (0, "tokens"),
    ("mla", "page_first_direct"): (0, "pages"),
}
LAYOUTS = tuple(sorted({layout for _, layout in _AXES}))


def pool_kind(pool: Any) -> str:
    """``"mla"`` or ``"mha"`` for SGLang's host pool classes (by name: the backend must not
    import SGLang's pool modules, which differ between releases)."""
    names = [cls.__name__ for cls in type(pool).__mro__]
    if "MLATokenToKVPoolHost" in names:
        return "mla"
    if "MHATokenToKVPoolHost" in names:
        return "mha"
    raise ValueError(
        f"host pool {type(pool).__name__} is not supported by kvoffload's SGLang backend "
        "(MHATokenToKVPoolHost and MLATokenToKVPoolHost are; hybrid pools need SGLang's v2 interface)"
    )


class PageViews:
    """SGLang's host pool as kvoffload host blocks, one per page (see the module docstring).

    ``tensors``: the 2-D ``uint8`` views; ``num_blocks``: pages; ``block_bytes``: one page's
    payload; ``kind``/``layout``/``page_size`` as SGLang has them."""

    interleaved = False  # (the Mooncake tier then keeps each header in a slot of its own)
    row_prefix_bytes = 0
    region = None

    def __init__(self, pool: Any) -> None:
        self.kind = pool_kind(pool)
        self.layout = str(pool.layout)
        self.page_size = int(pool.page_size)
        if (self.kind, self.layout) not in _AXES:
            known = sorted(layout for kind, layout in _AXES if kind == self.kind)
            raise ValueError(
                f"host pool layout {self.layout!r} is not supported for {self.kind.upper()}; known: {known}"
            )
        buffer = pool.kv_buffer
        if not isinstance(buffer, torch.Tensor) or buffer.device.type != "cpu" or not buffer.is_contiguous():
            raise ValueError(
                f"the host pool's kv_buffer must be a contiguous CPU tensor, got {type(buffer).__name__}"
            )
        axis, unit = _AXES[(self.kind, self.layout)]
        self.axis = axis  # of kv_buffer: its length is the pool's size, no part of a page
        self.dtype = str(buffer.dtype).removeprefix("torch.")
        self.shape = tuple(int(n) for n in buffer.shape)
        length = self.shape[axis]
        pages = length // self.page_size if unit == "tokens" else length
        pieces = math.prod(self.shape[:axis])
        per_unit = buffer.numel() * buffer.element_size() // (pieces * length)  # bytes of one token/page
        row = per_unit * (self.page_size if unit == "tokens" else 1)
        flat = buffer.view(-1).view(torch.uint8).view(pieces, length * per_unit)
        self.tensors = [flat[i, : pages * row].view(pages, row) for i in range(pieces)]
        self.num_blocks = pages
        self.block_bytes = row * pieces
        self.nbytes = self.block_bytes * pages
        self._buffer = buffer  # keeps the memory alive

    def page_ids(self, host_indices: Any, count: int) -> list[int]:
        """The pages of ``count`` pages' token slots ``host_indices`` (``count * page_size``
        of them, each page's first a multiple of ``page_size``), in order."""
        size = self.page_size
        indices = host_indices.numpy() if isinstance(host_indices, torch.Tensor) else np.asarray(host_indices)
        if indices.ndim != 1 or indices.shape[0] != count * size:
            raise ValueError(
                f"host_indices must hold {count} pages x page_size {size} = {count * size} slots, "
                f"got shape {tuple(indices.shape)}"
            )
        firsts = indices[::size].astype(np.int64)
        wrong = (firsts % size != 0) | (firsts < 0) | (firsts // size >= self.num_blocks)
        if wrong.any():
            bad = int(firsts[np.argmax(wrong)])
            raise ValueError(
                f"host_indices must start each page at a multiple of page_size {size} within the pool's "
                f"{self.num_blocks} pages, got slot {bad}"
            )
        return (firsts // size).tolist()


class StagingPages:
    """``count`` pages of ``block_bytes`` in one tensor: a pool of the tiers' kind
    (``tensors``, ``num_blocks``) for the whole-page interface's copies."""

    interleaved = False
    row_prefix_bytes = 0
    region = None

    def __init__(self, count: int, block_bytes: int) -> None:
        self.rows = torch.zeros((count, block_bytes), dtype=torch.uint8)
        self.tensors = [self.rows]
        self.num_blocks = count
        self.block_bytes = block_bytes
        self.nbytes = count * block_bytes

    def put(self, row: int, value: torch.Tensor) -> None:
        """Copy a flat page (any dtype, ``block_bytes`` in all) into ``row``."""
        data = value.detach().reshape(-1).contiguous().view(torch.uint8)
        if data.numel() != self.block_bytes:
            raise ValueError(f"a page of {self.block_bytes} bytes was expected, got {data.numel()} bytes")
        self.rows[row].copy_(data)

    def take(self, row: int, target: torch.Tensor) -> torch.Tensor:
        """Copy ``row`` into ``target`` (a flat page of any dtype, ``block_bytes`` in all)."""
        flat = target.view(-1)
        size = flat.numel() * flat.element_size()
        if size != self.block_bytes:
            raise ValueError(f"a page of {self.block_bytes} bytes was expected, got {size} bytes")
        flat.view(torch.uint8).copy_(self.rows[row])
        return target
