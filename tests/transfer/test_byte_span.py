"""ByteSpan: the layout's tensors as granule rows of one byte range (CPU tensors)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvoffload.transfer import HostBlockPool, KVLayout
from kvoffload.transfer.byte_span import ByteSpan
from kvoffload.transfer.staging_plan import plan_batches


def two_tensor_layout(page: int = 512, gap_pages: int = 3):
    """Two views of one allocation, ``gap_pages`` pages apart, 8 blocks each."""
    whole = torch.arange((16 + gap_pages) * page, dtype=torch.int64).to(torch.uint8)
    first = whole[: 8 * page].view(8, page)
    second = whole[(8 + gap_pages) * page :].view(8, page)
    return whole, KVLayout.from_layer_tensors({"a": first, "b": second})


def test_granule_is_the_largest_size_dividing_offsets_strides_and_pages():
    whole, layout = two_tensor_layout(page=512)
    span = ByteSpan.of(layout)
    assert span.granule == 512
    assert span.first.tolist() == [0, 11] and span.row_stride.tolist() == [1, 1]
    assert span.rows.shape == (19, 512 // 8) and span.rows.dtype == torch.int64
    # the span aliases the allocation: granule row 12 is block 1 of the second tensor
    assert torch.equal(span.rows[12].view(torch.uint8), layout.tensors[1][1])


def test_below_the_minimum_granule_there_is_no_span():
    whole = torch.zeros(4096, dtype=torch.uint8)
    layout = KVLayout([whole[:960].view(8, 120), whole[1000:1960].view(8, 120)])
    assert ByteSpan.of(layout, 1).granule == 40  # gcd(1000, 120)
    assert ByteSpan.of(layout, 256) is None


@pytest.mark.parametrize("interleave", [True, False])
def test_granules_cover_every_staging_granule_once_and_name_the_right_bytes(interleave):
    caches = {f"l{i}": torch.randint(0, 256, (16, 2, 256), dtype=torch.uint8) for i in range(3)}
    layout = KVLayout.from_layer_tensors(caches)
    pool = HostBlockPool(layout, 8, pin_memory=False, interleave=interleave)
    span = ByteSpan.of(layout)
    device, host = np.array([5, 1, 9, 12]), np.array([6, 2, 0, 3])
    pieces = [(t, device, host) for t in range(3)]
    for batch in plan_batches(pieces, pool, cap=2 * 512 * 3):
        index = span.granules(batch.gathers, batch.staging_bytes)
        assert len(index) * span.granule == batch.staging_bytes
        staging = span.rows[torch.from_numpy(index)].view(torch.uint8).reshape(-1)
        for gather in batch.gathers:
            for col in gather.columns:
                for i, row in enumerate(gather.device_rows):
                    at = col.offset + i * col.stride
                    page = layout.page_bytes(col.tensor)
                    assert torch.equal(staging[at : at + page], layout.tensors[col.tensor][row])


def test_check_refuses_released_or_moved_memory():
    whole, layout = two_tensor_layout()
    span = ByteSpan.of(layout)
    span.check([0, 1])
    whole.untyped_storage().resize_(0)
    with pytest.raises(RuntimeError, match="a: its memory was released"):
        span.check([0])
