"""harness.h2proxy: the HTTP/2-aware TLS proxy the push-mode fault rows inject with.

Against a real gRPC server and client (grpc.aio, TLS from a dev PKI, ALPN h2), through the
proxy: calls pass unchanged; ``reset_streams`` ends exactly the calls of one method, on
both ends, and the connection carries new calls at full speed afterwards (the dropped
frames were credited back to the connection window); ``goaway`` sends the client to a
new connection. The frame helpers are checked on their own, malformed input included.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from bus.grpc_tls import channel_credentials, server_credentials
from certs import dev_bundle
from harness.h2proxy import (
    FLAG_PADDED,
    FLAG_PRIORITY,
    FRAME_RST_STREAM,
    H2Proxy,
    frame,
    header_fragment,
    parse_header,
)

PUMP = "/test.Pipe/Pump"
ECHO = "/test.Pipe/Echo"


# -- frames --------------------------------------------------------------------------------


@given(
    kind=st.integers(0, 255),
    flags=st.integers(0, 255),
    sid=st.integers(0, 2**31 - 1),
    payload=st.binary(max_size=300),
)
def test_frame_header_round_trips(kind: int, flags: int, sid: int, payload: bytes) -> None:
    raw = frame(kind, flags, sid, payload)
    assert parse_header(raw[:9]) == (len(payload), kind, flags, sid)
    assert raw[9:] == payload


def test_rst_stream_frame_is_the_rfc_layout() -> None:
    assert frame(FRAME_RST_STREAM, 0, 5, b"\x00\x00\x00\x08") == bytes.fromhex(
        "00000403000000000500000008"
    )


def test_reserved_bit_is_ignored_and_short_headers_refused() -> None:
    assert parse_header(bytes.fromhex("000000000080000003"))[3] == 3
    with pytest.raises(ValueError):
        parse_header(b"\x00" * 8)


def test_header_fragment_strips_padding_and_priority() -> None:
    block = b"\x82\x86"
    assert header_fragment(0, block) == block
    assert header_fragment(FLAG_PADDED, b"\x03" + block + b"\x00" * 3) == block
    prio = b"\x00\x00\x00\x01\x10"
    padded = b"\x02" + prio + block + b"\x00\x00"
    assert header_fragment(FLAG_PADDED | FLAG_PRIORITY, padded) == block
    for bad in (b"", b"\x09" + block):
        with pytest.raises(ValueError):
            header_fragment(FLAG_PADDED, bad)


# -- through a real gRPC server ------------------------------------------------------------


class Pipe:
    """Pump: a client stream whose bytes the server counts; Echo: unary echo."""

    def __init__(self) -> None:
        self.pumped = 0
        self.ends: list[str] = []
        self.started = asyncio.Event()

    async def pump(self, requests: AsyncIterator[bytes], context: Any) -> bytes:
        self.started.set()
        try:
            async for chunk in requests:
                self.pumped += len(chunk)
        except asyncio.CancelledError:
            self.ends.append("ended")
            raise
        self.ends.append("ended")
        return b"%d" % self.pumped

    async def echo(self, request: bytes, context: Any) -> bytes:
        return request


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[tuple[Pipe, H2Proxy, dict[str, Any]]]:
    pki = dev_bundle(tmp_path)
    pipe = Pipe()
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "test.Pipe",
                {
                    "Pump": grpc.stream_unary_rpc_method_handler(pipe.pump),
                    "Echo": grpc.unary_unary_rpc_method_handler(pipe.echo),
                },
            ),
        )
    )
    creds = server_credentials(str(pki["server"].cert), str(pki["server"].key))
    port = server.add_secure_port("127.0.0.1:0", creds)
    await server.start()
    proxy = await H2Proxy(
        port, cert=pki["server"].cert, key=pki["server"].key, ca=pki["ca"].cert
    ).start()
    try:
        yield pipe, proxy, {"ca": str(pki["ca"].cert)}
    finally:
        await proxy.close()
        await server.stop(None)


def _channel(proxy: H2Proxy, ca: str) -> grpc.aio.Channel:
    return grpc.aio.secure_channel(
        f"localhost:{proxy.port}",
        channel_credentials(ca),
        # No retry of a call that failed: the test sees what the proxy did.
        options=[("grpc.enable_retries", 0)],
    )


async def test_calls_pass_and_a_reset_ends_only_that_method(
    served: tuple[Pipe, H2Proxy, dict[str, Any]],
) -> None:
    pipe, proxy, files = served
    async with _channel(proxy, files["ca"]) as ch:
        echo = ch.unary_unary(ECHO)
        assert await echo(b"hello", timeout=10) == b"hello"
        pump = ch.stream_unary(PUMP)(timeout=30)
        await pump.write(b"x" * 1000)
        await asyncio.wait_for(pipe.started.wait(), 10)
        for _ in range(1000):
            if pipe.pumped >= 1000:
                break
            await asyncio.sleep(0.01)
        assert proxy.open_streams(PUMP) and proxy.streams_seen[ECHO] == 1
        assert proxy.reset_streams(PUMP) == 1 and proxy.open_streams(PUMP) == []
        with pytest.raises(grpc.aio.AioRpcError) as info:
            for _ in range(200):  # whatever is in flight is dropped, not delivered
                await pump.write(b"y" * 16384)
            await pump.done_writing()
            await pump
        # CANCELLED, or INTERNAL when a write was under way (grpc core's report of a write
        # on a stream that is gone).
        assert info.value.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.INTERNAL)
        for _ in range(100):
            if pipe.ends:
                break
            await asyncio.sleep(0.05)
        # The server's call ended too, though the client never half-closed it: the reset
        # reached it (a request iterator ends on RST_STREAM as on a half-close).
        assert pipe.ends == ["ended"]
        # The same connection still carries calls, and more bytes than one connection
        # window (64 KiB): what the proxy dropped was credited back.
        pump2 = ch.stream_unary(PUMP)(timeout=30)
        for _ in range(64):
            await pump2.write(b"z" * 16384)
        await pump2.done_writing()
        assert int(await pump2) == pipe.pumped
        assert await echo(b"again", timeout=10) == b"again"
    assert proxy.accepted == 1 and proxy.rst_sent == 1


async def test_goaway_sends_the_client_to_a_new_connection(
    served: tuple[Pipe, H2Proxy, dict[str, Any]],
) -> None:
    _pipe, proxy, files = served
    async with _channel(proxy, files["ca"]) as ch:
        echo = ch.unary_unary(ECHO)
        assert await echo(b"one", timeout=10) == b"one"
        assert proxy.goaway(linger=0.1) == 1
        await asyncio.sleep(0.3)
        assert proxy.connections == 0
        assert await echo(b"two", timeout=10, wait_for_ready=True) == b"two"
    assert proxy.accepted == 2 and proxy.goaways_sent == 1
