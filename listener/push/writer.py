"""One ``Subscribe`` served as one ``Stream`` call: StreamOpen, StreamData..., StreamClose.

The bytes are the ``sse_batches`` of an ``EventHub`` subscription: the same records, ids,
heartbeats and ``buffer_overflow`` error record as ``GET /events/{backend}`` with the
same ``Last-Event-ID``. Batching: each StreamData carries every record available when it
is sent, up to ``batch_max_bytes`` (a larger batch goes out in several messages; chunk
boundaries carry no meaning); after a message smaller than ``batch_max_bytes`` the writer waits
``batch_linger_ms`` before the next, so under load messages carry hundreds of records
(one gRPC message per event caps near 6k messages/s) while an idle stream adds at most
the linger to an event's latency. The records are framed into the serialized
StreamRequest by ``bus.stream_data``, so the call's serializer must be
``encode_stream_request``.

Close reasons: the subscription overflowed -> ``BUFFER_OVERFLOW``; the router sent
Unsubscribe -> ``UNSUBSCRIBED``; the listener is draining or shutting down -> ``DRAINING``;
anything else -> ``ERROR``. HTTP/2 flow control makes ``write`` wait while the router
reads slowly, so a slow consumer fills the bounded subscriber queue and gets
``buffer_overflow`` rather than unbounded buffering here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence

import grpc

from bus._gen.continuum.bus.v1 import bus_pb2 as pb
from bus.errors import BUFFER_OVERFLOW
from bus.stream_data import encode_stream_data

from ..sse_server import sse_batches
from ..stream import EventHub, Subscription, UnknownBackendError

__all__ = ["OpenStream", "StreamWriter"]

OpenStream = Callable[..., grpc.aio.StreamUnaryCall]
"""Starts a Stream call given ``metadata=``; its request serializer passes bytes through
(``bus.stream_data.encode_stream_request``)."""

log = logging.getLogger("continuum.listener.push")

_CLOSE_OF_SUB: dict[str, pb.CloseReason] = {
    BUFFER_OVERFLOW: pb.CLOSE_REASON_BUFFER_OVERFLOW,
    "shutdown": pb.CLOSE_REASON_DRAINING,
}


class StreamWriter:
    """Serves one Subscribe until it ends; :meth:`stop` ends it with a reason.

    Args:
        open_stream: The session channel's Stream method (:data:`OpenStream`).
        metadata: Call metadata (the bearer token, if any).
        hub: The listener's event hub.
        subscribe: The router's request.
        heartbeat_interval: Seconds of idleness before a heartbeat comment.
        batch_max_bytes: Largest StreamData payload.
        linger_s: Wait after a small message before the next.
    """

    def __init__(
        self,
        open_stream: OpenStream,
        metadata: Sequence[tuple[str, str]],
        hub: EventHub,
        subscribe: pb.Subscribe,
        *,
        heartbeat_interval: float,
        batch_max_bytes: int,
        linger_s: float,
    ) -> None:
        self.open_stream = open_stream
        self.metadata = tuple(metadata)
        self.hub = hub
        self.stream_id = subscribe.stream_id
        self.source = subscribe.source
        self.last_event_id = subscribe.last_event_id or None
        self.heartbeat_interval = heartbeat_interval
        self.batch_max_bytes = batch_max_bytes
        self.linger_s = linger_s
        self._stop_reason: pb.CloseReason | None = None
        self._stopping = asyncio.Event()
        self._sub: Subscription | None = None
        self.bytes_sent = 0
        self.messages_sent = 0

    def stop(self, reason: pb.CloseReason) -> None:
        """End the stream with ``reason`` (a CloseReason) after the write in flight."""
        if self._stop_reason is None:
            self._stop_reason = reason
        self._stopping.set()
        if self._sub is not None:
            self._sub.close("closed")

    async def run(self) -> None:
        """Open the Stream call, send until the subscription ends, close it. Never raises
        for transport errors (logged); CancelledError propagates."""
        call = self.open_stream(metadata=self.metadata)
        reason: pb.CloseReason = pb.CLOSE_REASON_ERROR
        detail = ""
        try:
            # As the session does: the StreamOpen goes once the router admitted the call,
            # so a refusal arrives as its own status, not as a failed write.
            await call.initial_metadata()
            if call.done():
                await call  # raises the refusal
            await call.write(pb.StreamRequest(open=pb.StreamOpen(stream_id=self.stream_id)))
            if self._stop_reason is not None:
                reason = self._stop_reason
            else:
                try:
                    self._sub = sub = self.hub.subscribe(self.source, self.last_event_id)
                except UnknownBackendError as exc:
                    detail = str(exc)
                else:
                    await self._pump(call, sub)
                    if self._stop_reason is not None:
                        reason = self._stop_reason
                    else:
                        reason = _CLOSE_OF_SUB.get(sub.close_reason or "", pb.CLOSE_REASON_ERROR)
                    if reason == pb.CLOSE_REASON_BUFFER_OVERFLOW:
                        detail = f"subscriber queue full ({self.hub.queue_size} events)"
                        log.warning(
                            "event bus: stream %s of %s closed: buffer_overflow",
                            self.stream_id,
                            self.source,
                        )
            await call.write(pb.StreamRequest(close=pb.StreamClose(reason=reason, detail=detail)))
            await call.done_writing()
            resp = await call
            log.debug(
                "event bus: stream %s of %s done (%s, router got %d bytes)",
                self.stream_id,
                self.source,
                pb.CloseReason.Name(reason),
                resp.bytes_received,
            )
        except grpc.aio.AioRpcError as exc:
            log.info(
                "event bus: stream %s of %s ended by the router: %s: %s",
                self.stream_id,
                self.source,
                exc.code().name,
                exc.details(),
            )
        except (
            grpc.aio.UsageError,
            grpc.RpcError,
            ConnectionError,
            asyncio.InvalidStateError,
        ) as exc:
            log.info("event bus: stream %s of %s failed: %s", self.stream_id, self.source, exc)
        finally:
            if self._sub is not None:
                self._sub.close("closed")
            if not call.done():
                call.cancel()

    async def _pump(self, call: grpc.aio.StreamUnaryCall, sub: Subscription) -> None:
        max_bytes = self.batch_max_bytes
        linger = self.linger_s
        # Up to ~2.6x max_bytes of ~200-byte records per batch: a batch of max_bytes or more
        # means a backlog, and then the writer does not linger (below). Smaller caps make
        # every batch "small" and put a linger after each message: at 1,024 records per
        # 10 ms that capped a stream near 100k records/s.
        batch_limit = max(16, max_bytes // 96)
        async with contextlib.aclosing(
            sse_batches(sub, self.heartbeat_interval, batch_limit)
        ) as batches:
            async for records in batches:
                # Joined first (a length per record in Python would cost more than the
                # copy), then framed with a view per message: two copies of the payload.
                payload = b"".join(records)
                total = len(payload)
                if total <= max_bytes:
                    await self._send(call, payload)
                else:
                    view = memoryview(payload)
                    for k in range(0, total, max_bytes):
                        await self._send(call, view[k : k + max_bytes])
                if total < max_bytes and linger > 0 and self._stop_reason is None:
                    # Caught up: wait for more to batch, unless stop() ends the stream.
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(linger):
                            await self._stopping.wait()

    async def _send(self, call: grpc.aio.StreamUnaryCall, payload: bytes | memoryview) -> None:
        await call.write(encode_stream_data(payload))
        self.bytes_sent += len(payload)
        self.messages_sent += 1
