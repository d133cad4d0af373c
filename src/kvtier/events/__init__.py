"""KV events in vLLM's wire format, fed by the radix index's moves on every tier.

``EventRecorder`` (the index's observer, engine thread), ``DropOldestQueue`` (the bounded
hand-off), ``encode_batch`` (msgpack), ``ZmqEventPublisher`` (PUB + ROUTER replay, its own
thread), ``KVEventFeed`` (the lot, from ``ServerConfig``). pyzmq and msgpack are imported only
when a publisher starts or a batch is encoded (``pip install 'kvtier[events]'``).
"""

from kvtier.events.feed import KVEventFeed
from kvtier.events.recorder import EventRecorder
from kvtier.events.types import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    MEDIUM_STORAGE,
    TIER_PLACEMENT,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
)

__all__ = ["MEDIUM_CPU", "MEDIUM_GPU", "MEDIUM_STORAGE", "TIER_PLACEMENT", "AllBlocksCleared",
           "BlockRemoved", "BlockStored", "EventRecorder", "KVEvent", "KVEventFeed"]
