"""Eviction policies and the registry that resolves them by name.

``resolve_policy(spec)`` accepts a registered name (``"lru"``, ``"arc"``, …), a
``"package.module:ClassName"`` import path, or a ``CachePolicy`` subclass.
"""

from __future__ import annotations

import importlib

from kvoffload.policies.arc import ARCPolicy
from kvoffload.policies.base import BlockStatus, CachePolicy
from kvoffload.policies.lru import LRUPolicy
from kvoffload.policies.s3fifo import S3FIFOPolicy
from kvoffload.policies.turnlru import TurnLRUPolicy
from kvoffload.policies.wtinylfu import WTinyLFUPolicy

_REGISTRY: dict[str, type[CachePolicy]] = {}


def register_policy(cls: type[CachePolicy], name: str | None = None) -> type[CachePolicy]:
    """Register ``cls`` under ``name`` (default ``cls.name``); usable as a decorator.

    Names are case-insensitive; a name already registered raises ``ValueError`` (as vLLM's
    registry does), so a policy can never silently replace another."""
    if not (isinstance(cls, type) and issubclass(cls, CachePolicy)):
        raise TypeError(f"not a CachePolicy subclass: {cls!r}")
    key = (name or cls.name).lower()
    if not key:
        raise ValueError(f"policy {cls.__name__} has no name")
    if key in _REGISTRY:
        raise ValueError(f"eviction policy name {key!r} is already registered (to {_REGISTRY[key].__name__})")
    _REGISTRY[key] = cls
    return cls


def available_policies() -> list[str]:
    """Names of the registered policies."""
    return sorted(_REGISTRY)


def resolve_policy(spec: str | type[CachePolicy]) -> type[CachePolicy]:
    """The policy class for a registered name, an import path, or a class."""
    if isinstance(spec, type):
        if issubclass(spec, CachePolicy):
            return spec
        raise TypeError(f"not a CachePolicy subclass: {spec!r}")
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"eviction policy must be a name or 'module:Class', got {spec!r}")
    if ":" not in spec:
        cls = _REGISTRY.get(spec.lower())
        if cls is None:
            raise ValueError(
                f"unknown eviction policy {spec!r}; known: {', '.join(available_policies())}"
                " (or give 'package.module:ClassName')"
            )
        return cls
    module_name, _, attr = spec.partition(":")
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot import eviction policy {spec!r}: {exc}") from exc
    if not (isinstance(obj, type) and issubclass(obj, CachePolicy)):
        raise ValueError(f"eviction policy {spec!r} is not a CachePolicy subclass")
    return obj


register_policy(LRUPolicy)
register_policy(ARCPolicy)
register_policy(S3FIFOPolicy)
register_policy(WTinyLFUPolicy)
register_policy(TurnLRUPolicy)

__all__ = [
    "ARCPolicy",
    "BlockStatus",
    "CachePolicy",
    "LRUPolicy",
    "S3FIFOPolicy",
    "TurnLRUPolicy",
    "WTinyLFUPolicy",
    "available_policies",
    "register_policy",
    "resolve_policy",
]
