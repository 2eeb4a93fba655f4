"""The host block pool: where offloaded KV pages live in host memory.

``HostBlockPool(layout, num_host_blocks, blocks_per_offload_block=F)`` allocates one host
tensor per layout tensor, shaped ``(num_host_blocks, page_bytes * F)`` uint8, pinned
(page-locked) when CUDA is available so device copies can run asynchronously at full
speed. An offloaded (host) block spans ``F`` consecutive device blocks: host block ``b``
of a tensor holds device-sized sub-blocks ``b*F .. b*F+F-1``, and ``sub_blocks(t)`` views
tensor ``t`` as ``(num_host_blocks * F, page_bytes)`` rows in that numbering.

A host block id addresses the same slot in every tensor; a block of group ``g`` uses only
the tensors of ``g``. With groups that share no tensors this leaves the other groups'
slots of that id unused; vLLM's overlaid groups share their tensors and waste nothing.

The memory is allocated uninitialised: a host block holds meaningful bytes only after a
successful store into it, which is what the tier manager's bookkeeping tracks.
"""

from __future__ import annotations

import torch

from kvoffload.transfer.layout import KVLayout
from kvoffload.validation import non_negative_int, positive_int


class HostBlockPool:
    """One host tensor per device tensor of ``layout``."""

    def __init__(
        self,
        layout: KVLayout,
        num_host_blocks: int,
        blocks_per_offload_block: int = 1,
        pin_memory: bool | None = None,
    ) -> None:
        non_negative_int("num_host_blocks", num_host_blocks)
        positive_int("blocks_per_offload_block", blocks_per_offload_block)
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        self.layout = layout
        self.num_blocks = num_host_blocks
        self.blocks_per_offload_block = blocks_per_offload_block
        self.pinned = bool(pin_memory)
        self.tensors: tuple[torch.Tensor, ...] = tuple(
            torch.empty(
                (num_host_blocks, layout.page_bytes(i) * blocks_per_offload_block),
                dtype=torch.uint8,
                pin_memory=self.pinned,
            )
            for i in range(len(layout.tensors))
        )

    def sub_blocks(self, tensor: int) -> torch.Tensor:
        """Tensor ``tensor`` as ``(num_host_blocks * F, page_bytes)``: row ``b*F + k`` is
        sub-block ``k`` of host block ``b``."""
        return self.tensors[tensor].view(-1, self.layout.page_bytes(tensor))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() for t in self.tensors)

    def __repr__(self) -> str:
        return (
            f"HostBlockPool({self.num_blocks} blocks x {self.blocks_per_offload_block} device "
            f"blocks, {self.nbytes / 2**20:.1f} MiB, pinned={self.pinned})"
        )
