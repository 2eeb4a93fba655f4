"""Optional dependencies, by the install extra that brings them.

The core (keys, contracts, policies, the CPU tier's bookkeeping, the scheduler, events,
the index, the simulator, metrics) needs none of them. ``require(module, extra, what)``
imports ``module`` or raises an ``ImportError`` saying which extra installs it:
``pip install 'kvoffload[redis]'``. ``EXTRAS`` maps each extra to the top-level modules it
brings, for tests and error messages.
"""

from __future__ import annotations

import importlib
from types import ModuleType

EXTRAS = {
    "torch": ("torch",),  # the transfer engine (worker side)
    "vllm": ("vllm", "torch"),  # the vLLM connector
    "sglang": ("sglang", "torch"),  # the SGLang HiCache storage backend
    "redis": ("redis",),  # the shared Redis/Valkey tier
    "mooncake": ("mooncake",),  # the shared Mooncake Store tier
    "s3": ("obstore",),  # the object-storage (S3 API) tier
    "index": ("aiohttp",),  # the index's HTTP service
    "plot": ("matplotlib",),  # the simulator's plots
}


def require(module: str, extra: str, what: str) -> ModuleType:
    """``module`` imported; an ``ImportError`` naming ``extra`` if it is not installed."""
    if extra not in EXTRAS:
        raise ValueError(f"unknown extra {extra!r}; known: {sorted(EXTRAS)}")
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"{what} needs {module.split('.')[0]}, which is not installed: pip install 'kvoffload[{extra}]' "
            f"({exc})"
        ) from exc
