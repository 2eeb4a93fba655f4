"""Worker-side transfers between an engine's device KV cache and a host block pool.

``KVLayout`` describes the device memory, ``HostBlockPool`` the host memory, and
``TransferEngine`` (a ``kvoffload.worker.OffloadingWorker``) moves pages between them in
store and load jobs described by ``kvoffload.specs``. Needs torch; names are re-exported
lazily so that ``kvoffload.transfer.mapping`` alone does not load it."""

from kvoffload._lazy import lazy_exports

_EXPORTS = {
    "LOAD": "kvoffload.transfer.engine",
    "STORE": "kvoffload.transfer.engine",
    "TransferEngine": "kvoffload.transfer.engine",
    "TransferResult": "kvoffload.transfer.engine",
    "HostBlockPool": "kvoffload.transfer.host_pool",
    "KVLayout": "kvoffload.transfer.layout",
    "block_byte_view": "kvoffload.transfer.layout",
    "GroupMapping": "kvoffload.transfer.mapping",
    "host_blocks_per_group": "kvoffload.transfer.mapping",
    "map_sub_blocks": "kvoffload.transfer.mapping",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
