"""Worker-side transfers between an engine's device KV cache and a host block pool.

``KVLayout`` describes the device memory, ``HostBlockPool`` the host memory, and
``TransferEngine`` moves pages between them in store and load jobs described by a
``DeviceLoadStoreSpec`` and a ``kvoffload.cpu.CPULoadStoreSpec``. Needs torch.
"""

from kvoffload.transfer.engine import LOAD, STORE, TransferEngine, TransferResult
from kvoffload.transfer.host_pool import HostBlockPool
from kvoffload.transfer.layout import KVLayout, block_byte_view
from kvoffload.transfer.mapping import GroupMapping, host_blocks_per_group, map_sub_blocks
from kvoffload.transfer.specs import DeviceLoadStoreSpec

__all__ = [
    "LOAD",
    "STORE",
    "DeviceLoadStoreSpec",
    "GroupMapping",
    "HostBlockPool",
    "KVLayout",
    "TransferEngine",
    "TransferResult",
    "block_byte_view",
    "host_blocks_per_group",
    "map_sub_blocks",
]
