"""Helpers for the transfer tests: random layouts and a loop-by-loop reference copy."""

from __future__ import annotations

import numpy as np
import torch

from kvoffload.transfer import HostBlockPool, KVLayout


def randomize(t: torch.Tensor, gen: torch.Generator) -> None:
    t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=gen))


def snapshot(layout: KVLayout, pool: HostBlockPool) -> tuple[list, list]:
    return [t.clone() for t in layout.tensors], [t.clone() for t in pool.tensors]


def expected_after(layout, pool, before, store, device_ids, group_sizes, block_indices, host_ids):
    """Apply a job to copies of ``before`` one sub-block at a time (the oracle)."""
    dev, host = [t.clone() for t in before[0]], [t.clone() for t in before[1]]
    f = pool.blocks_per_offload_block
    d_off = h_off = 0
    for g, n in enumerate(group_sizes):
        skip = block_indices[g] % f
        for i in range(n):
            pos = skip + i
            h = host_ids[h_off + pos // f]
            k = pos % f
            d = device_ids[d_off + i]
            for t in layout.groups[g]:
                page = layout.page_bytes(t)
                host_row = host[t][h, k * page : (k + 1) * page]
                if store:
                    host_row.copy_(dev[t][d])
                else:
                    dev[t][d].copy_(host_row)
        d_off += n
        h_off += -(-(skip + n) // f) if n else 0
    return dev, host


def assert_state(layout, pool, expected) -> None:
    dev, host = expected
    for t, (actual, want) in enumerate(zip(layout.tensors, dev)):
        assert torch.equal(actual, want), f"device tensor {t} ({layout.names[t]}) differs"
    for t, (actual, want) in enumerate(zip(pool.tensors, host)):
        assert torch.equal(actual, want), f"host tensor {t} differs"


def three_group_layer_caches(num_blocks: int, gen: torch.Generator):
    """Four groups: 256-byte, 512-byte and 36-byte pages, and a 64-byte group kept idle.

    Returns (kv_caches dict, groups as layer-name lists)."""
    caches = {}
    groups = []
    shapes = [
        (4, (2, 4, 16), torch.float16),
        (2, (2, 8, 16), torch.float16),
        (3, (3, 3, 4), torch.uint8),
        (1, (16,), torch.float32),
    ]
    for g, (layers, shape, dtype) in enumerate(shapes):
        names = []
        for layer in range(layers):
            name = f"g{g}.layer{layer}"
            raw = torch.empty((num_blocks, *shape), dtype=dtype)
            randomize(raw.view(torch.uint8), gen)
            caches[name] = raw
            names.append(name)
        groups.append(names)
    return caches, groups


def distinct(rng: np.random.Generator, limit: int, count: int) -> list[int]:
    return rng.choice(limit, size=count, replace=False).tolist()


def make_pool(num_host: int = 16, f: int = 1, seed: int = 0) -> HostBlockPool:
    """A host pool over the three-group test layout (4 tensors, 256..16 bytes per page), its
    rows random (seeded)."""
    gen = torch.Generator().manual_seed(seed)
    caches, groups = three_group_layer_caches(8, gen)
    pool = HostBlockPool(KVLayout.from_layer_tensors(caches, groups), num_host, blocks_per_offload_block=f)
    for t in pool.tensors:
        randomize(t, gen)
    return pool


def pool_block_bytes(pool: HostBlockPool) -> int:
    """Bytes of one host block of ``pool`` (a row of every tensor)."""
    return sum(int(t.shape[1]) for t in pool.tensors)


def host_block(pool: HostBlockPool, host_id: int) -> bytes:
    """Host block ``host_id``'s bytes, tensor after tensor."""
    return b"".join(t[host_id].numpy().tobytes() for t in pool.tensors)
