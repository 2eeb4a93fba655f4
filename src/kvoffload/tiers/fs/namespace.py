"""Namespaces: the directory under ``root_dir`` that holds the blocks of one byte layout.

Two engines may read each other's blocks only if every stored byte means the same to both.
``fs_namespace(identity)`` hashes everything that changes the bytes (the model, the KV
dtype, the host layout with every tensor's page size, the block size, the KV-cache group
specs, the hash seed that makes the keys, the worker's rank, and this tier's on-disk
``FORMAT_VERSION``) into a directory name ``kv-<32 hex digits>``. Both halves of the tier
(the scheduler-side manager and the worker) are given that name; the worker writes its
digest into every header and both check it on read.

``namespace_identity(...)`` builds the identity from named fields; ``layout_identity``
describes a ``KVLayout`` (duck-typed, so this module stays torch-free). Values must be
JSON-serialisable (str, int, float, bool, None, lists, dicts with str keys): anything else
is a ``TypeError`` naming the field, because a ``repr`` may differ between processes.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
from collections.abc import Mapping, Sequence
from typing import Any

from kvoffload.private import open_private, private_dir
from kvoffload.tiers.fs.format import DIGEST_BYTES, FORMAT_VERSION, LOCK_FILE
from kvoffload.tiers.identity import canonical_identity

PREFIX = "kv-"


def namespace_identity(
    *,
    model: str,
    dtype: str,
    layout: Mapping[str, Any],
    block_size: int,
    kv_cache_groups: Sequence[Any],
    hash_seed: str,
    rank: int = 0,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The identity of a block's bytes. ``layout`` is e.g. ``layout_identity(...)``;
    ``kv_cache_groups`` one JSON-able description per group (kind, block size, heads,
    head size, sliding window, ...); ``extra`` anything else that changes the bytes
    (tensor-parallel size, quantisation, ...)."""
    identity = {
        "model": model,
        "dtype": dtype,
        "layout": dict(layout),
        "block_size": block_size,
        "kv_cache_groups": list(kv_cache_groups),
        "hash_seed": hash_seed,
        "rank": rank,
    }
    if extra:
        identity["extra"] = dict(extra)
    return identity


def layout_identity(layout: Any, blocks_per_offload_block: int = 1) -> dict[str, Any]:
    """Page bytes of every tensor and the tensors of every group of a ``KVLayout``, and
    how many device blocks one stored block spans."""
    return {
        "page_bytes": [int(layout.page_bytes(i)) for i in range(len(layout.tensors))],
        "groups": [list(map(int, group)) for group in layout.groups],
        "blocks_per_offload_block": int(blocks_per_offload_block),
    }


def _canonical(identity: Mapping[str, Any]) -> str:
    return canonical_identity({"format_version": FORMAT_VERSION, **identity})


def fs_namespace(identity: Mapping[str, Any]) -> str:
    """The directory name of ``identity`` (with the format version): ``kv-`` + 32 hex digits."""
    if not isinstance(identity, Mapping) or not identity:
        raise ValueError(f"namespace identity must be a non-empty mapping, got {identity!r}")
    return PREFIX + hashlib.sha256(_canonical(identity).encode()).hexdigest()[:32]


def namespace_digest(namespace: str) -> bytes:
    """The ``DIGEST_BYTES`` written into every header of ``namespace``'s blocks."""
    return hashlib.sha256(b"kvoffload-fs:" + namespace.encode()).digest()[:DIGEST_BYTES]


def check_namespace(namespace: object) -> str:
    """``namespace`` if it is a usable directory name; ``ValueError`` naming it otherwise."""
    if (
        not isinstance(namespace, str)
        or not namespace
        or namespace in (".", "..")
        or "/" in namespace
        or "\\" in namespace
        or "\0" in namespace
    ):
        raise ValueError(f"namespace must be a plain directory name, got {namespace!r}")
    return namespace


def describe(identity: Mapping[str, Any]) -> str:
    """The canonical text ``fs_namespace`` hashes (written beside the blocks for people)."""
    return _canonical(identity)


def open_namespace_dir(root_dir: str | os.PathLike, namespace: str) -> str:
    """``<root_dir>/<namespace>``, created if needed, mode 0700 (``kvoffload.private``);
    ``ValueError`` naming ``root_dir`` when it cannot be created or written."""
    check_namespace(namespace)
    path = os.path.join(os.fspath(root_dir), namespace)
    try:
        private_dir(path)  # 0700: the blocks are prompts
    except OSError as exc:
        raise ValueError(f"root_dir {os.fspath(root_dir)!r} cannot be created: {exc}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"root_dir {os.fspath(root_dir)!r} is not writable ({path})")
    return path


def lock_namespace_dir(path: str) -> int:
    """An exclusive lock on the namespace directory ``path`` (its lock file's descriptor;
    the lock dies with the descriptor or the process). ``ValueError`` when another manager,
    in any process, holds it or the directory cannot be written."""
    try:
        fd = open_private(os.path.join(path, LOCK_FILE), os.O_RDWR)
    except OSError as exc:
        raise ValueError(f"root_dir {os.path.dirname(path)!r} cannot be written: {exc}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise ValueError(
            f"namespace {path!r} is in use by another disk-tier manager (one per namespace; "
            "give each engine its own root_dir or close the other first)"
        ) from None
    return fd
