"""Lazy re-exports for package ``__init__``s.

``__getattr__, __dir__ = lazy_exports(__name__, {"Name": "package.module", ...})`` makes
``package.Name`` import ``package.module`` on first use only, so importing a package (or
any of its light submodules) never loads the heavy dependencies of its other modules
(torch, pyzmq).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(
    package: str, exports: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """Module ``__getattr__`` and ``__dir__`` resolving each name of ``exports`` from its module."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module), name)

    def __dir__() -> list[str]:
        return sorted(exports)

    return __getattr__, __dir__
