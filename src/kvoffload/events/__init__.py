"""KV events: vLLM-compatible wire types and codec, a ZMQ publisher with replay, and a
subscriber that repairs gaps. See each module's docstring for its contract.

Names are re-exported lazily: ``kvoffload.events.types`` and ``codec`` need msgspec only;
the publisher and subscriber load pyzmq when first used."""

from kvoffload._lazy import lazy_exports

_EXPORTS = {
    "FORMATS": "kvoffload.events.codec",
    "EventDecodeError": "kvoffload.events.codec",
    "EventEncoder": "kvoffload.events.codec",
    "decode": "kvoffload.events.codec",
    "encode": "kvoffload.events.codec",
    "END_MARKER": "kvoffload.events.publisher",
    "END_SEQ": "kvoffload.events.publisher",
    "PublisherStats": "kvoffload.events.publisher",
    "ZmqEventPublisher": "kvoffload.events.publisher",
    "Delivery": "kvoffload.events.subscriber",
    "EventSubscriber": "kvoffload.events.subscriber",
    "SubscriberStats": "kvoffload.events.subscriber",
    "HASH_FORMATS": "kvoffload.events.types",
    "MEDIUM_CPU": "kvoffload.events.types",
    "MEDIUM_GPU": "kvoffload.events.types",
    "MEDIUM_STORAGE": "kvoffload.events.types",
    "AllBlocksCleared": "kvoffload.events.types",
    "BlockHashValue": "kvoffload.events.types",
    "BlockRemoved": "kvoffload.events.types",
    "BlockStored": "kvoffload.events.types",
    "KVCacheEvent": "kvoffload.events.types",
    "KVEvent": "kvoffload.events.types",
    "KVEventBatch": "kvoffload.events.types",
    "wire_hash": "kvoffload.events.types",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
