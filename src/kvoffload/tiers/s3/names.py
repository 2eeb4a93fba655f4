"""The object-storage tier's specs and object names.

``S3LoadStoreSpec(keys)``: blocks of the object tier, addressed by key alone, in key order;
its medium (``MEDIUM_OBJECT``) routes jobs to ``S3Worker`` and names the tier in events,
so an object tier can sit beside a Redis or Mooncake tier.

``ObjectNames(prefix, namespace)``: one rank's object names, ``<prefix>/<namespace>/<key
hex>`` (without ``prefix``: ``<namespace>/<key hex>``). The namespace is the Redis tier's
(``kvoffload.tiers.redis.format.redis_namespace`` of the rank's identity) and so is the
value format, digest included: a block's object holds the same bytes as its Redis value.
Names are ``/``-separated, unlike the other shared tiers' ``:``, because S3 lists by
folder: one listing of ``<prefix>/<namespace>/`` is one layout's objects (what a
reconciliation reads), and ``key_of`` reads a key back from a listed name.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvoffload.specs import MEDIUM_OBJECT, RemoteLoadStoreSpec
from kvoffload.tiers.redis.format import namespace_digest


class S3LoadStoreSpec(RemoteLoadStoreSpec):
    """Keys of blocks in the object tier, in key order."""

    medium = MEDIUM_OBJECT

    def __repr__(self) -> str:
        return f"S3LoadStoreSpec({len(self.keys)} keys)"


class ObjectNames:
    """Object names of one namespace (one rank's blocks of one layout)."""

    def __init__(self, prefix: str, namespace: str) -> None:
        prefix = prefix.strip("/")
        self.folder = f"{prefix}/{namespace}" if prefix else namespace
        self.digest = namespace_digest(namespace)
        self._base = self.folder + "/"

    def name(self, key: bytes) -> str:
        return self._base + key.hex()

    def names(self, keys: Sequence[bytes]) -> list[str]:
        base = self._base
        return [base + key.hex() for key in keys]

    def key_of(self, name: str) -> bytes | None:
        """The block key a listed name holds, or ``None`` if it is not of this namespace."""
        if not name.startswith(self._base):
            return None
        try:
            return bytes.fromhex(name[len(self._base) :])
        except ValueError:
            return None

    def __repr__(self) -> str:
        return f"ObjectNames({self.folder!r})"
