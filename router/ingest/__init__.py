"""KV event ingestion: the listener's event streams, read and handed to the KV index in order.

One :class:`KvEventConsumer` per configured event source holds one connection at a time
(``consumer``), opened by a :data:`StreamOpener` (``opener``): the built-in SSE-over-HTTP
and WebSocket ones (``transports``), or push mode's event bus (``router.eventbus``, which
imports this package for the seam, never the other way). :class:`KvEventConsumerManager`
runs one consumer task per source (``manager``); ``errors`` says why a connection ended.

Ingestion knows nothing of the index: each event goes to an injected ``apply`` callable
(``router.kvindex.apply_event`` bound to the index, wired by ``router.kv_runtime``).
"""

from .consumer import (
    MAX_BACKOFF_S,
    ApplyFn,
    ApplyManyFn,
    ConsumerStats,
    EndResyncFn,
    KvEventConsumer,
    default_backoff,
)
from .errors import (
    ConsumerError,
    EventApplyError,
    SourceUnavailable,
    StreamClosedByPeer,
    StreamRejected,
)
from .manager import KvEventConsumerManager
from .opener import StreamOpener

__all__ = [
    "MAX_BACKOFF_S",
    "ApplyFn",
    "ApplyManyFn",
    "ConsumerError",
    "ConsumerStats",
    "EndResyncFn",
    "EventApplyError",
    "KvEventConsumer",
    "KvEventConsumerManager",
    "SourceUnavailable",
    "StreamClosedByPeer",
    "StreamOpener",
    "StreamRejected",
    "default_backoff",
]
