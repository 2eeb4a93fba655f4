"""KV events: vLLM-compatible wire types and codec, a ZMQ publisher with replay, and a
subscriber that repairs gaps. See each module's docstring for its contract."""

from kvoffload.events.codec import FORMATS, EventDecodeError, EventEncoder, decode, encode
from kvoffload.events.publisher import END_MARKER, END_SEQ, PublisherStats, ZmqEventPublisher
from kvoffload.events.subscriber import EventSubscriber, SubscriberStats
from kvoffload.events.types import (
    HASH_FORMATS,
    MEDIUM_CPU,
    MEDIUM_GPU,
    MEDIUM_STORAGE,
    AllBlocksCleared,
    BlockHashValue,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVEvent,
    KVEventBatch,
    wire_hash,
)

__all__ = [
    "FORMATS",
    "HASH_FORMATS",
    "END_MARKER",
    "END_SEQ",
    "MEDIUM_CPU",
    "MEDIUM_GPU",
    "MEDIUM_STORAGE",
    "AllBlocksCleared",
    "BlockHashValue",
    "BlockRemoved",
    "BlockStored",
    "EventDecodeError",
    "EventEncoder",
    "EventSubscriber",
    "KVCacheEvent",
    "KVEvent",
    "KVEventBatch",
    "PublisherStats",
    "SubscriberStats",
    "ZmqEventPublisher",
    "decode",
    "encode",
    "wire_hash",
]
