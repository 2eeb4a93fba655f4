"""vLLM integration: kvoffload as a vLLM v1 KV connector (``KVOffloadConnector``)."""

from kvoffload.integrations.vllm.connector import KVOffloadConnector

__all__ = ["KVOffloadConnector"]
