"""The Mooncake tier's specs and object names.

``MooncakeLoadStoreSpec(keys)``: blocks of the Mooncake tier, addressed by key alone, in
key order; its medium (``MEDIUM_MOONCAKE``) routes jobs to ``MooncakeWorker`` and names
the tier in events, so a Mooncake tier and a Redis tier can sit side by side.

Object names are the Redis tier's key names as text (``<prefix>:<namespace>:<key hex>``,
``kvoffload.tiers.redis.format.KeyNames``): the values have that tier's format too, so a
block's namespace is derived the same way (``redis_namespace`` of the rank's identity).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvoffload.specs import MEDIUM_MOONCAKE, RemoteLoadStoreSpec
from kvoffload.tiers.redis.format import KeyNames


class MooncakeLoadStoreSpec(RemoteLoadStoreSpec):
    """Keys of blocks in the Mooncake tier, in key order."""

    medium = MEDIUM_MOONCAKE

    def __repr__(self) -> str:
        return f"MooncakeLoadStoreSpec({len(self.keys)} keys)"


def object_names(names: KeyNames, keys: Sequence[bytes]) -> list[str]:
    """The object name of each key (Mooncake keys are text)."""
    base = names.base.decode()
    return [base + key.hex() for key in keys]
