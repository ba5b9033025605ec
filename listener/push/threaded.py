"""A ``Stream`` call whose sending runs on gRPC's own thread, off the listener's event loop.

The listener's event loop also ingests every engine event, so it is the listener's
bottleneck. On a ``grpc.aio`` call, serializing each StreamData message, copying it into
gRPC's buffers, HTTP/2 framing and TLS encryption all run on that loop, inline in
``call.write``. With the synchronous API, a client-streaming call consumes its request
iterator on a thread of gRPC's, which does that work there (gRPC's core runs without the
GIL). :class:`ThreadedStub` gives :class:`~listener.push.writer.StreamWriter` the same
call surface as the aio stub (``write``, ``done_writing``, ``await``, ``done``,
``cancel``), over a bounded hand-off queue, plus ``write_data(chunk, start, end)``: the
loop queues a reference to the SSE bytes, and the StreamData message (a copy of them) is
built on gRPC's thread too.

Flow control is unchanged: when the router reads slowly, HTTP/2 makes gRPC's thread wait,
the queue fills (``depth`` messages), ``write`` waits for room, and the subscriber queue
behind it overflows into ``buffer_overflow`` as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
from collections.abc import Iterator, Sequence
from typing import Any

import grpc

from bus._gen.continuum.bus.v1 import bus_pb2 as pb
from bus._gen.continuum.bus.v1 import bus_pb2_grpc as pb_grpc

__all__ = ["ThreadedStreamCall", "ThreadedStub"]

_END = object()
"""Half-close: the request iterator ends."""
_POLL_S = 0.5
"""How often gRPC's thread, waiting for a request, checks whether the call was cancelled."""


class ThreadedStreamCall:
    """One ``Stream`` call on a synchronous channel, driven from an asyncio loop."""

    def __init__(
        self,
        stub: pb_grpc.EventBusStub,
        metadata: Sequence[tuple[str, str]],
        loop: asyncio.AbstractEventLoop,
        depth: int = 4,
    ) -> None:
        self._loop = loop
        self._outbox: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self._room = asyncio.Event()
        self._finished = asyncio.Event()
        self._cancelled = False
        self._future = stub.Stream.future(self._requests(), metadata=tuple(metadata))
        self._future.add_done_callback(self._done_from_grpc)

    # -- gRPC's thread -------------------------------------------------------------------

    def _requests(self) -> Iterator[pb.StreamRequest]:
        while True:
            try:
                item = self._outbox.get(timeout=_POLL_S)
            except queue.Empty:
                if self._cancelled:
                    return
                continue
            self._call_soon(self._room.set)
            if item is _END:
                return
            if type(item) is tuple:  # write_data: the copies happen here, not on the loop
                chunk, start, end = item
                request = pb.StreamRequest()
                request.data.data = chunk if end - start == len(chunk) else chunk[start:end]
                yield request
            else:
                yield item

    def _done_from_grpc(self, _future: Any) -> None:
        self._call_soon(self._finish)

    def _call_soon(self, fn: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits anymore
            self._loop.call_soon_threadsafe(fn)

    # -- the event loop ------------------------------------------------------------------

    def _finish(self) -> None:
        self._finished.set()
        self._room.set()

    def _raise_if_over(self) -> None:
        if not self._future.done():
            return
        if self._future.cancelled():
            raise grpc.aio.UsageError("the call was cancelled")
        exc = self._future.exception()
        raise exc if exc is not None else grpc.aio.UsageError("the call has ended")

    async def _put(self, item: Any) -> None:
        while True:
            self._raise_if_over()
            try:
                self._outbox.put_nowait(item)
                return
            except queue.Full:
                pass
            self._room.clear()
            if self._outbox.full() and not self._future.done():
                await self._room.wait()

    async def write(self, request: pb.StreamRequest) -> None:
        """Queue ``request``; waits while ``depth`` requests are already queued."""
        await self._put(request)

    async def write_data(self, chunk: bytes, start: int, end: int) -> None:
        """``write`` of a StreamData holding ``chunk[start:end]``, built on gRPC's thread."""
        await self._put((chunk, start, end))

    async def done_writing(self) -> None:
        await self._put(_END)

    def __await__(self) -> Any:
        async def response() -> pb.StreamResponse:
            await self._finished.wait()
            if self._future.cancelled():
                raise grpc.aio.UsageError("the call was cancelled")
            return self._future.result()  # raises the call's RpcError if it failed

        return response().__await__()

    def done(self) -> bool:
        return bool(self._future.done())

    def cancel(self) -> bool:
        self._cancelled = True
        return bool(self._future.cancel())


class ThreadedStub:
    """``stub.Stream(metadata=...)`` as on the aio stub, returning a
    :class:`ThreadedStreamCall` on a synchronous channel to the same router."""

    def __init__(self, channel: grpc.Channel, loop: asyncio.AbstractEventLoop) -> None:
        self._stub = pb_grpc.EventBusStub(channel)
        self._loop = loop

    def Stream(self, metadata: Sequence[tuple[str, str]] = ()) -> ThreadedStreamCall:
        return ThreadedStreamCall(self._stub, metadata, self._loop)
