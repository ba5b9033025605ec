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
        req = pb.StreamRequest.FromString(wire)
        assert decode_stream_request(wire) in (req, req.data.data)
        self.requests.append(req)
        if req.WhichOneof("kind") == "data":
            self.data += req.data.data

    async def done_writing(self) -> None:
        self._done.set()

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


async def test_a_backlog_goes_out_in_full_messages_without_lingering() -> None:
    hub = EventHub(history_size=100_000, queue_size=100_000)
    hub.add_backend(B)
    n = 20_000
    for i in range(1, n + 1):
        hub.publish(B, KvEvent("cache_created", B, f"{i:064x}", 16, "gpu"))
    start = f"{hub.epoch}-0"  # replay the whole history, as a resuming router would ask
    expected = b"".join(r.sse for r in hub.subscribe(B, start).ready(limit=n + 10))
    assert expected.count(b"\n\n") == n

    stub = FakeStub()
    max_bytes = 64 * 1024
    writer = StreamWriter(
        stub.Stream,  # type: ignore[arg-type]
        [],
        hub,
        pb.Subscribe(stream_id="s", source=B, last_event_id=start),
        heartbeat_interval=15.0,
        batch_max_bytes=max_bytes,
        linger_s=1000.0,
    )
    task = asyncio.create_task(writer.run())
    try:
        # A readiness wait: it only fails if the writer lingered with a backlog left.
        await eventually(lambda: len(stub.call.data) >= len(expected), 30, what="the backlog")
        assert bytes(stub.call.data) == expected
        sizes = [len(r.data.data) for r in stub.call.requests if r.WhichOneof("kind") == "data"]
        record = len(expected) // n
        assert max_bytes - 2 * record < max(sizes) <= max_bytes  # batched up to the cap ...
        assert len(sizes) < 2 * len(expected) // max_bytes  # ... not a message per record
        assert stub.call.requests[0].WhichOneof("kind") == "open"
    finally:
        writer.stop(pb.CLOSE_REASON_DRAINING)
        await asyncio.wait_for(task, 5)
    assert stub.call.requests[-1].close.reason == pb.CLOSE_REASON_DRAINING


async def test_records_over_the_cap_are_cut_and_the_bytes_still_match() -> None:
    """A record larger than ``batch_max_bytes`` (a big resync snapshot, say) goes out in
    pieces; chunk boundaries carry no meaning, so the concatenation must still be exact."""
    hub = EventHub(history_size=1_000, queue_size=1_000)
    hub.add_backend(B)
    n = 50
    for i in range(1, n + 1):
        hub.publish(B, KvEvent("cache_created", B, f"{i:064x}", 16, "gpu"))
    start = f"{hub.epoch}-0"
    expected = b"".join(r.sse for r in hub.subscribe(B, start).ready(limit=n + 10))
    record = len(expected) // n
    stub = FakeStub()
    max_bytes = record // 3  # every record is over the cap
    writer = StreamWriter(
        stub.Stream,  # type: ignore[arg-type]
        [],
        hub,
        pb.Subscribe(stream_id="s", source=B, last_event_id=start),
        heartbeat_interval=15.0,
        batch_max_bytes=max_bytes,
        linger_s=0.0,
    )
    task = asyncio.create_task(writer.run())
    try:
        await eventually(lambda: len(stub.call.data) >= len(expected), 30, what="the records")
        assert bytes(stub.call.data) == expected
        sizes = [len(r.data.data) for r in stub.call.requests if r.WhichOneof("kind") == "data"]
        assert max(sizes) <= max_bytes and len(sizes) >= 3 * n
    finally:
        writer.stop(pb.CLOSE_REASON_DRAINING)
        await asyncio.wait_for(task, 5)
