"""SGLang integration: kvoffload's tiers as SGLang's HiCache storage backend (``KVOffloadStorage``).

Only the seam lives here: the backend class (``backend``), its configuration (``config``),
SGLang's host pool as pages (``pages``), the pages' namespace identity (``identity``), the
tiers as a synchronous page store (``tiers``, ``jobs``), events (``events``) and metrics
(``metrics``). ``KVOffloadStorage`` is resolved lazily: SGLang imports this package by
``module_path`` and then reads the attribute; the configuration can be checked without
SGLang installed.
"""

from kvoffload._lazy import lazy_exports

_EXPORTS = {
    "KVOffloadStorage": "kvoffload.integrations.sglang.backend",
    "StorageSettings": "kvoffload.integrations.sglang.config",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
