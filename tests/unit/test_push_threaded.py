"""``ThreadedStreamCall``: a Stream call sent from gRPC's thread, driven from the loop.

A real grpc.aio server in this process (plaintext: TLS is the integration tests' part);
the client side is the synchronous channel the listener uses for its streams.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from bus._gen.continuum.bus.v1 import bus_pb2 as pb
from bus._gen.continuum.bus.v1 import bus_pb2_grpc as pb_grpc
from listener.push.threaded import ThreadedStub
from tests.waiting import eventually


class Servicer(pb_grpc.EventBusServicer):
    def __init__(self) -> None:
        self.data = bytearray()
        self.kinds: list[str] = []
        self.abort_after: int | None = None
        self.gate = asyncio.Event()
        self.gate.set()

    async def Stream(self, request_iterator: Any, context: Any) -> pb.StreamResponse:
        async for req in request_iterator:
            await self.gate.wait()  # closed: a slow reader, HTTP/2 flow control pushes back
            self.kinds.append(req.WhichOneof("kind"))
            if req.WhichOneof("kind") == "data":
                self.data += req.data.data
                if self.abort_after is not None and len(self.kinds) > self.abort_after:
                    await context.abort(grpc.StatusCode.PERMISSION_DENIED, "go away")
        return pb.StreamResponse(stream_id="s", bytes_received=len(self.data))


@pytest.fixture
async def bus() -> AsyncIterator[tuple[Servicer, ThreadedStub]]:
    servicer = Servicer()
    server = grpc.aio.server()
    pb_grpc.add_EventBusServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield servicer, ThreadedStub(channel, asyncio.get_running_loop())
    finally:
        channel.close()
        await server.stop(0)


def data(payload: bytes) -> pb.StreamRequest:
    req = pb.StreamRequest()
    req.data.data = payload
    return req


async def test_requests_and_slices_arrive_in_order_and_the_response_comes_back(
    bus: tuple[Servicer, ThreadedStub],
) -> None:
    servicer, stub = bus
    call = stub.Stream(metadata=[("x-test", "1")])
    await call.write(pb.StreamRequest(open=pb.StreamOpen(stream_id="s")))
    chunk = bytes(range(256)) * 40
    sent = bytearray()
    for i in range(200):
        if i % 2:
            await call.write(data(chunk[:100]))
            sent += chunk[:100]
        else:
            await call.write_data(chunk, 7, 7 + i)  # a slice built on gRPC's thread
            sent += chunk[7 : 7 + i]
    await call.done_writing()
    resp = await call
    assert resp.bytes_received == len(sent) and bytes(servicer.data) == bytes(sent)
    assert servicer.kinds[0] == "open" and call.done()


async def test_a_slow_reader_makes_write_wait_then_everything_arrives(
    bus: tuple[Servicer, ThreadedStub],
) -> None:
    servicer, stub = bus
    servicer.gate.clear()
    call = stub.Stream()
    payload = b"x" * (256 * 1024)
    writer = asyncio.create_task(_write_many(call, payload, 64))
    await asyncio.sleep(0.5)  # let the pipeline fill (not an assertion on time)
    assert not writer.done()  # 16 MiB cannot all be queued: write waits for room
    servicer.gate.set()
    await asyncio.wait_for(writer, 30)
    await call.done_writing()
    assert (await call).bytes_received == 64 * len(payload)


async def _write_many(call: Any, payload: bytes, n: int) -> None:
    for _ in range(n):
        await call.write(data(payload))


async def test_a_refused_call_surfaces_its_status_on_write_and_on_await(
    bus: tuple[Servicer, ThreadedStub],
) -> None:
    servicer, stub = bus
    servicer.abort_after = 2
    call = stub.Stream()
    with pytest.raises(grpc.RpcError) as err:
        for _ in range(1000):
            await call.write(data(b"y" * 1000))
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED  # type: ignore[attr-defined]
    with pytest.raises(grpc.RpcError):
        await call


async def test_cancel_ends_the_call_and_its_sending_thread(
    bus: tuple[Servicer, ThreadedStub],
) -> None:
    _, stub = bus
    before = threading.active_count()
    call = stub.Stream()
    await call.write(data(b"z"))
    call.cancel()
    await eventually(call.done, 10, what="the call to end")
    with pytest.raises(grpc.aio.UsageError):
        await call.write(data(b"z"))
    await eventually(lambda: threading.active_count() <= before, 10, what="gRPC's thread")
