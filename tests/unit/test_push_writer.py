"""``StreamWriter`` batching: a backlog goes out in full messages without lingering.

The writer lingers ``batch_linger_ms`` only after a message smaller than
``batch_max_bytes``, i.e. when it has caught up. Here the linger is 1,000 s: if the writer
lingered while a backlog remained, the stream would stall and the wait below would fail.
"""

from __future__ import annotations

import asyncio
from typing import Any

from bus._gen.continuum.bus.v1 import bus_pb2 as pb
from bus.events import KvEvent
from bus.stream_data import decode_stream_request, encode_stream_request
from listener.push.writer import StreamWriter
from listener.stream import EventHub
from tests.waiting import eventually

B = "vllm-1"


class FakeCall:
    """The client side of one Stream call, as ``grpc.aio`` gives it; records what is sent,
    through the serializer and deserializer the real call and server use."""

    def __init__(self) -> None:
        self.requests: list[pb.StreamRequest] = []
        self.data = bytearray()
        self._done = asyncio.Event()

    async def write(self, req: pb.StreamRequest | bytes) -> None:
        wire = encode_stream_request(req)
        sent = pb.StreamRequest.FromString(wire)
        assert decode_stream_request(wire) in (sent, sent.data.data)
        self.requests.append(sent)
        if sent.WhichOneof("kind") == "data":
            self.data += sent.data.data

    async def done_writing(self) -> None:
        self._done.set()

    async def initial_metadata(self) -> tuple[()]:
        """The router admitted the call at once."""
        return ()

    def __await__(self) -> Any:
        async def response() -> pb.StreamResponse:
            await self._done.wait()
            return pb.StreamResponse(stream_id="s", bytes_received=len(self.data))

        return response().__await__()

    def done(self) -> bool:
        return self._done.is_set()

    def cancel(self) -> None:
        self._done.set()


class FakeStub:
    def __init__(self) -> None:
        self.call = FakeCall()

    def Stream(self, metadata: Any = None) -> FakeCall:
        return self.call


def history(n: int) -> tuple[EventHub, str, bytes]:
    """A hub holding ``n`` events, the event ID that replays all of them (as a resuming
    router would ask) and the SSE bytes that replay must give."""
    hub = EventHub(history_size=max(n, 1_000), queue_size=max(n, 1_000))
    hub.add_backend(B)
    for i in range(1, n + 1):
        hub.publish(B, KvEvent("cache_created", B, f"{i:064x}", 16, "gpu"))
    start = f"{hub.epoch}-0"
    expected = b"".join(r.sse for r in hub.subscribe(B, start).ready(limit=n + 10))
    assert expected.count(b"\n\n") == n
    return hub, start, expected


async def replay(
    hub: EventHub, start: str, expected: bytes, max_bytes: int, linger_s: float
) -> list[pb.StreamRequest]:
    """Runs a writer from ``start`` until it has sent ``expected``; its requests."""
    stub = FakeStub()
    writer = StreamWriter(
        stub.Stream,
        [],
        hub,
        pb.Subscribe(stream_id="s", source=B, last_event_id=start),
        heartbeat_interval=15.0,
        batch_max_bytes=max_bytes,
        linger_s=linger_s,
    )
    task = asyncio.create_task(writer.run())
    try:
        # A readiness wait: with a long linger it only fails if the writer lingered with
        # a backlog left.
        await eventually(lambda: len(stub.call.data) >= len(expected), 30, what="the records")
        assert bytes(stub.call.data) == expected
    finally:
        writer.stop(pb.CLOSE_REASON_DRAINING)
        await asyncio.wait_for(task, 5)
    assert stub.call.requests[0].WhichOneof("kind") == "open"
    assert stub.call.requests[-1].close.reason == pb.CLOSE_REASON_DRAINING
    return stub.call.requests


def data_sizes(requests: list[pb.StreamRequest]) -> list[int]:
    return [len(r.data.data) for r in requests if r.WhichOneof("kind") == "data"]


async def test_a_backlog_goes_out_in_full_messages_without_lingering() -> None:
    n = 20_000
    hub, start, expected = history(n)
    max_bytes = 64 * 1024
    sizes = data_sizes(await replay(hub, start, expected, max_bytes, linger_s=1000.0))
    record = len(expected) // n
    assert max_bytes - 2 * record < max(sizes) <= max_bytes  # batched up to the cap ...
    assert len(sizes) < 2 * len(expected) // max_bytes  # ... not a message per record


async def test_records_over_the_cap_are_cut_and_the_bytes_still_match() -> None:
    """A record larger than ``batch_max_bytes`` (a big resync snapshot, say) goes out in
    pieces; chunk boundaries carry no meaning, so the concatenation must still be exact."""
    n = 50
    hub, start, expected = history(n)
    max_bytes = len(expected) // n // 3  # every record is over the cap
    sizes = data_sizes(await replay(hub, start, expected, max_bytes, linger_s=0.0))
    assert max(sizes) <= max_bytes and len(sizes) >= 3 * n
