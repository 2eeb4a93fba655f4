"""The engine's KV memory, described as byte pages: ``KVLayout``.

A layout is a list of tensors, each viewed as ``(num_blocks, page_bytes)`` uint8 bytes,
plus, for each KV-cache group, the indices of the tensors (layers) that group uses (none
for a group that is not offloaded).
Row ``b`` of a tensor is block ``b``'s page in that tensor; rows may sit further apart
than ``page_bytes`` (padded pages, block-outermost packing), but each page's bytes must
be contiguous. A group's page size is the sum of its tensors' page sizes, so page sizes
may differ between groups.

* Per-layer layouts: one tensor per layer, ``groups[g]`` lists that group's layers.
* Cross-layer layouts: one tensor whose row holds every layer's page of a block
  (``(num_blocks, num_layers * page)``), used by a single group.
* Groups may share tensors. vLLM overlays its KV-cache groups on one allocation (a block
  id belongs to one group at a time), so layer ``i`` of two groups can alias the same
  bytes; aliasing views are merged into one tensor that both groups name.

Constructors:

* ``KVLayout(tensors, groups)`` takes byte views as they are (see ``block_byte_view``).
* ``KVLayout.from_layer_tensors(kv_caches, groups, block_dim=0)`` takes what an engine
  hands a KV connector, ``dict[layer_name, Tensor]`` whose dimension ``block_dim`` is the
  block dimension. With ``block_dim=1`` (e.g. ``(2, num_blocks, ...)`` K/V caches) every
  slice along the leading dimension becomes its own tensor.

Raises ``ValueError`` naming the offending layer or tensor when a page is not contiguous,
devices differ, or a group names an unknown layer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch


def block_byte_view(tensor: torch.Tensor, num_blocks: int | None = None) -> torch.Tensor:
    """View ``tensor`` (block dimension first) as ``(num_blocks, page_bytes)`` uint8.

    ``num_blocks`` may be smaller than ``tensor.shape[0]`` when the engine splits each
    block into equally strided kernel blocks (vLLM does when the attention kernel wants
    smaller blocks than the block manager): consecutive rows are then grouped.
    """
    if tensor.dim() == 0:
        raise ValueError("a KV tensor needs a block dimension, got a scalar")
    rows = tensor.shape[0]
    if num_blocks is not None and num_blocks != rows:
        if num_blocks <= 0 or rows % num_blocks:
            raise ValueError(f"tensor has {rows} rows, not a multiple of num_blocks={num_blocks}")
        tensor = tensor.unflatten(0, (num_blocks, rows // num_blocks))
    page = tensor[0] if tensor.shape[0] else tensor.new_empty(tensor.shape[1:])
    if not page.is_contiguous():
        raise ValueError(
            f"each block's page must be contiguous; shape {tuple(tensor.shape)} with "
            f"strides {tensor.stride()} is not (is the block dimension first?)"
        )
    elem = tensor.element_size()
    page_bytes = page.numel() * elem
    block_stride = tensor.stride(0) * elem if tensor.shape[0] > 1 else page_bytes
    if block_stride < page_bytes:
        raise ValueError(f"block stride {block_stride} bytes is smaller than the page ({page_bytes} bytes)")
    # set_ on the untyped storage reinterprets any dtype as bytes without copying.
    view = torch.empty(0, dtype=torch.uint8, device=tensor.device)
    view.set_(
        tensor.untyped_storage(),
        tensor.storage_offset() * elem,
        (tensor.shape[0], page_bytes),
        (block_stride, 1),
    )
    return view


def _identity(view: torch.Tensor) -> tuple:
    """Two byte views alias exactly when address, shape and strides agree."""
    return (view.device, view.data_ptr(), tuple(view.shape), view.stride())


class KVLayout:
    """Byte-page tensors and the tensors each KV-cache group uses."""

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        groups: Sequence[Sequence[int]] | None = None,
        names: Sequence[str] | None = None,
    ) -> None:
        if not tensors:
            raise ValueError("a layout needs at least one tensor")
        self.tensors: tuple[torch.Tensor, ...] = tuple(tensors)
        self.names: tuple[str, ...] = (
            tuple(names) if names is not None else tuple(f"tensor{i}" for i in range(len(tensors)))
        )
        if len(self.names) != len(self.tensors):
            raise ValueError(f"{len(self.names)} names given for {len(self.tensors)} tensors")
        for name, t in zip(self.names, self.tensors):
            if t.dtype != torch.uint8 or t.dim() != 2 or (t.shape[1] > 1 and t.stride(1) != 1):
                raise ValueError(
                    f"{name}: expected a (num_blocks, page_bytes) uint8 view with contiguous "
                    f"pages, got dtype {t.dtype}, shape {tuple(t.shape)}, strides {t.stride()}"
                    " (use block_byte_view)"
                )
            if t.shape[1] == 0:
                raise ValueError(f"{name}: page size is zero")
        devices = {t.device for t in self.tensors}
        if len(devices) != 1:
            raise ValueError(f"all KV tensors must be on one device, got {sorted(map(str, devices))}")
        self.device: torch.device = devices.pop()
        if groups is None:
            groups = [list(range(len(self.tensors)))]
        self.groups: tuple[tuple[int, ...], ...] = tuple(tuple(int(i) for i in g) for g in groups)
        for g, members in enumerate(self.groups):
            # a group with no tensor is one the engine keeps but kvoffload does not offload
            for i in members:
                if not 0 <= i < len(self.tensors):
                    raise ValueError(f"KV-cache group {g} names tensor {i}, out of range")
            if len(set(members)) != len(members):
                raise ValueError(f"KV-cache group {g} names a tensor twice: {list(members)}")

    # -- constructors -------------------------------------------------------------------

    @classmethod
    def from_layer_tensors(
        cls,
        kv_caches: Mapping[str, torch.Tensor],
        groups: Sequence[Sequence[str]] | None = None,
        *,
        block_dim: int = 0,
        num_blocks: int | None = None,
    ) -> KVLayout:
        """Build a layout from ``layer_name -> tensor`` as engines hand to connectors.

        ``groups`` lists each group's layer names (default: one group of every layer, in
        dict order). ``block_dim=0``: the block dimension is first. ``block_dim=1``: a
        leading non-block dimension (K/V) comes first and each of its slices becomes a
        tensor. ``num_blocks`` groups kernel-block rows (see ``block_byte_view``).
        Layers whose views alias the same bytes share one tensor.
        """
        if block_dim not in (0, 1):
            raise ValueError(f"block_dim must be 0 or 1, got {block_dim}")
        if groups is None:
            groups = [list(kv_caches)]
        tensors: list[torch.Tensor] = []
        names: list[str] = []
        index_of: dict[tuple, int] = {}
        layer_indices: dict[str, list[int]] = {}
        for layer, tensor in kv_caches.items():
            parts = [tensor] if block_dim == 0 else list(tensor.unbind(0))
            indices = []
            for k, part in enumerate(parts):
                try:
                    view = block_byte_view(part, num_blocks)
                except ValueError as exc:
                    raise ValueError(f"layer {layer!r}: {exc}") from None
                key = _identity(view)
                if key not in index_of:
                    index_of[key] = len(tensors)
                    tensors.append(view)
                    names.append(layer if block_dim == 0 else f"{layer}[{k}]")
                indices.append(index_of[key])
            layer_indices[layer] = indices
        group_ids: list[list[int]] = []
        for g, layers in enumerate(groups):
            members: list[int] = []
            for layer in layers:
                if layer not in layer_indices:
                    raise ValueError(f"KV-cache group {g} names unknown layer {layer!r}")
                # Layers sharing one cache (vLLM's KV sharing) are copied once.
                members.extend(i for i in layer_indices[layer] if i not in members)
            group_ids.append(members)
        return cls(tensors, group_ids, names)

    @classmethod
    def cross_layer(cls, tensor: torch.Tensor, num_blocks: int | None = None) -> KVLayout:
        """One tensor holding every layer of a block in one row; one group."""
        return cls([block_byte_view(tensor, num_blocks)], [[0]], ["cross_layer"])

    # -- queries ------------------------------------------------------------------------

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    def page_bytes(self, tensor: int) -> int:
        return int(self.tensors[tensor].shape[1])

    def num_blocks(self, tensor: int) -> int:
        return int(self.tensors[tensor].shape[0])

    def group_page_bytes(self, group: int) -> int:
        """Bytes of one block of ``group`` across all its tensors."""
        return sum(self.page_bytes(i) for i in self.groups[group])

    def group_num_blocks(self, group: int) -> int:
        """Device block ids of ``group`` must be below this."""
        return min((self.num_blocks(i) for i in self.groups[group]), default=0)

    def __repr__(self) -> str:
        pages = sorted({self.page_bytes(i) for i in range(len(self.tensors))})
        return (
            f"KVLayout({len(self.tensors)} tensors on {self.device}, page bytes {pages}, "
            f"groups {[list(g) for g in self.groups]})"
        )
