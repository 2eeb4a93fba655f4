"""vLLM integration: kvoffload as a vLLM v1 KV connector (``KVOffloadConnector``).

Only the seam lives here: the connector, its two halves, its config, metadata and the
KV-layout helpers. ``KVOffloadConnector`` is resolved lazily (vLLM imports this package
by ``kv_connector_module_path`` and then reads the attribute)."""

from kvoffload._lazy import lazy_exports

_EXPORTS = {
    "KVOffloadConnector": "kvoffload.integrations.vllm.connector",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
