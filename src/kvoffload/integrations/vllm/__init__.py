"""vLLM integration: kvoffload as a vLLM v1 KV connector (``KVOffloadConnector``).

Only the seam lives here: the connector, its two halves, its config, metadata and the
KV-layout helpers. ``KVOffloadConnector`` is resolved lazily (vLLM imports this package
by ``kv_connector_module_path`` and then reads the attribute).

vLLM's ``--kv-offloading-size`` (``kv_offloading_size``) replaces the configured
connector's name with its own (``OffloadingConnector``) and keeps the module path: reading
that name here raises a ``ValueError`` that says so, instead of vLLM's "class not found"."""

from kvoffload._lazy import lazy_exports
from kvoffload.extras import require

require("vllm", "vllm", "kvoffload's vLLM connector")

_EXPORTS = {
    "KVOffloadConnector": "kvoffload.integrations.vllm.connector",
}
# the connector names vLLM's kv_offloading_size puts in the place of the configured one
_REPLACED_BY_VLLM = ("OffloadingConnector", "SimpleCPUOffloadConnector")

__all__ = sorted(_EXPORTS)
_lazy_getattr, __dir__ = lazy_exports(__name__, _EXPORTS)


def __getattr__(name: str):
    if name in _REPLACED_BY_VLLM:
        raise ValueError(
            f"kv_connector is {name!r} with kv_connector_module_path {__name__!r}: vLLM's "
            "--kv-offloading-size (kv_offloading_size) replaced KVOffloadConnector with its own "
            "connector. Drop --kv-offloading-size and give kvoffload's host memory as "
            "kv_connector_extra_config['cpu_bytes_to_use']"
        )
    return _lazy_getattr(name)
