"""Why one connection of a KV event consumer ended: each ends a connection, none the consumer.

An opener (``router.ingest.opener``) raises these for its transport's own failures; the
consumer raises them for what it finds in the stream; the supervisor loop
(``KvEventConsumer.run``) catches them, logs, waits its backoff and reconnects.
"""

from __future__ import annotations

__all__ = [
    "ConsumerError",
    "EventApplyError",
    "SourceUnavailable",
    "StreamClosedByPeer",
    "StreamRejected",
]


class ConsumerError(Exception):
    """Root of the consumer's errors; each ends one connection, none ends the consumer."""


class StreamRejected(ConsumerError):
    """The endpoint answered, but not with an event stream (status, content type)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class StreamClosedByPeer(ConsumerError):
    """The listener ended the stream with an ``event: error`` record."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"listener closed the stream: {reason}")
        self.reason = reason


class SourceUnavailable(ConsumerError):
    """Nobody offers the source yet (push mode: no live listener session announces it).

    Not a failure of a peer: the supervisor retries after the first backoff step
    (``reconnect_interval_ms``) every time, without doubling, so a stream opens soon after
    a listener connects.
    """


class EventApplyError(ConsumerError):
    """``apply`` raised; the event was not applied and will be asked for again."""

    def __init__(self, backend: str, event_id: str | None, event: str) -> None:
        super().__init__(f"applying {event} (id {event_id}) for {backend} failed")
        self.backend = backend
        self.event_id = event_id
