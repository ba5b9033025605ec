"""The event bus server's admission: credentials are judged from the call's metadata
before any message is read, and concurrent Session and Stream calls are capped
(``dynamo.event_bus.max_sessions`` / ``max_streams``), over real TLS on loopback."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from bus._gen.continuum.bus.v1 import bus_pb2 as pb
from bus._gen.continuum.bus.v1 import bus_pb2_grpc as pb_grpc
from certs import dev_bundle
from router.config.models import BrokerConfig, EventBusConfig, EventBusTlsConfig
from router.eventbus.auth import hash_token
from router.eventbus.server import EventBusServer
from router.eventbus.service import EventBusServicer
from router.eventbus.sessions import SessionRegistry
from tests import waiting

A = "vllm-1"
TOKEN = "tok-kv-a"
TIMEOUT = 5.0


def brokers() -> list[BrokerConfig]:
    return [
        BrokerConfig.model_validate(
            {"id": "kv-a", "role": "kv_listener", "backends": [A], "token_hash": hash_token(TOKEN)}
        )
    ]


def test_the_caps_have_documented_defaults() -> None:
    cfg = EventBusConfig()
    assert (cfg.max_sessions, cfg.max_streams) == (256, 4096)
    text = (Path(__file__).parents[2] / "deploy" / "config.example.yaml").read_text()
    assert "max_sessions: 256" in text and "max_streams: 4096" in text


# -- no message is read before the credentials are judged ----------------------------------


class _Aborted(Exception):
    pass


class FakeContext:
    def __init__(self, metadata: tuple[tuple[str, str], ...] = ()) -> None:
        self.metadata = metadata
        self.status: tuple[grpc.StatusCode, str] | None = None

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self.metadata

    def auth_context(self) -> dict[str, list[bytes]]:
        return {}

    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"

    async def send_initial_metadata(self, metadata: Any) -> None:
        raise AssertionError("an unauthenticated call is never admitted")

    async def abort(self, code: grpc.StatusCode, detail: str) -> None:
        self.status = (code, detail)
        raise _Aborted


class Untouched:
    """A request stream that records whether anything asked it for a message."""

    def __init__(self) -> None:
        self.reads = 0

    def __aiter__(self) -> Untouched:
        return self

    async def __anext__(self) -> Any:
        self.reads += 1
        return pb.SessionRequest(hello=pb.Hello(client_id="kv-a", sources=[A]))


@pytest.mark.parametrize("method", ["Session", "Stream"])
@pytest.mark.parametrize("token", [None, "wrong"])
async def test_an_unauthenticated_call_is_refused_before_any_message_is_read(
    method: str, token: str | None
) -> None:
    servicer = EventBusServicer(SessionRegistry(brokers(), [A]))
    requests = Untouched()
    context = FakeContext((("authorization", f"Bearer {token}"),) if token else ())
    with pytest.raises(_Aborted):
        await getattr(servicer, method)(requests, context)
    assert context.status is not None and context.status[0] == grpc.StatusCode.UNAUTHENTICATED
    assert requests.reads == 0


# -- over TLS ------------------------------------------------------------------------------


class Peer:
    def __init__(self, port: int, ca: bytes, token: str | None = TOKEN) -> None:
        creds = grpc.ssl_channel_credentials(ca)
        self.channel = grpc.aio.secure_channel(f"localhost:{port}", creds)
        self.stub = pb_grpc.EventBusStub(self.channel)
        self.metadata = (("authorization", f"Bearer {token}"),) if token else ()

    async def welcomed(self, client_id: str = "kv-a") -> Any:
        call = self.stub.Session(metadata=self.metadata)
        await asyncio.wait_for(call.initial_metadata(), TIMEOUT)
        hello = pb.Hello(client_id=client_id, role=pb.ROLE_KV_LISTENER, sources=[A])
        await call.write(pb.SessionRequest(hello=hello))
        first = await asyncio.wait_for(call.read(), TIMEOUT)
        assert first.WhichOneof("kind") == "welcome", first
        return call

    async def refused(self, method: str) -> tuple[grpc.StatusCode, str]:
        """Open a call, send nothing, and return the status it is ended with."""
        call = getattr(self.stub, method)(metadata=self.metadata)
        try:
            if method == "Session":
                assert await asyncio.wait_for(call.read(), TIMEOUT) is grpc.aio.EOF
            else:
                await asyncio.wait_for(call, TIMEOUT)
        except grpc.aio.AioRpcError as exc:
            return exc.code(), exc.details() or ""
        return await call.code(), await call.details() or ""


def _server(
    pki: dict[str, Any], max_sessions: int = 256, max_streams: int = 4096
) -> EventBusServer:
    cfg = EventBusConfig(
        enabled=True,
        listen="127.0.0.1:0",
        tls=EventBusTlsConfig(cert=str(pki["server"].cert), key=str(pki["server"].key)),
        max_sessions=max_sessions,
        max_streams=max_streams,
    )
    return EventBusServer(cfg, SessionRegistry(brokers(), [A]))


@pytest.fixture
async def bus(tmp_path: Path) -> AsyncIterator[tuple[EventBusServer, bytes]]:
    pki = dev_bundle(tmp_path)
    server = _server(pki, max_sessions=1, max_streams=1)
    await server.start()
    try:
        yield server, pki["ca"].cert.read_bytes()
    finally:
        await server.stop(0)


async def test_no_credential_is_unauthenticated_without_waiting_for_a_message(
    bus: tuple[EventBusServer, bytes],
) -> None:
    server, ca = bus
    assert server.port is not None
    peer = Peer(server.port, ca, token=None)
    try:
        for method in ("Session", "Stream"):
            code, detail = await peer.refused(method)
            assert code == grpc.StatusCode.UNAUTHENTICATED and "no credential" in detail
    finally:
        await peer.channel.close()


async def test_calls_beyond_the_caps_are_resource_exhausted(
    bus: tuple[EventBusServer, bytes],
) -> None:
    server, ca = bus
    assert server.port is not None
    peer = Peer(server.port, ca)
    try:
        session = await peer.welcomed()
        code, detail = await peer.refused("Session")
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "dynamo.event_bus.max_sessions (1)" in detail, detail
        stream = peer.stub.Stream(metadata=peer.metadata)  # holds the one stream slot
        assert server.servicer is not None
        servicer = server.servicer
        await waiting.eventually(lambda: servicer.active["Stream"] == 1, TIMEOUT, 0.001)
        code, detail = await peer.refused("Stream")
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "dynamo.event_bus.max_streams (1)" in detail, detail
        assert server.sessions.counters["calls_over_cap"] == 2
        stream.cancel()
        session.cancel()
        # The slots are given back when the calls end.
        again = await asyncio.wait_for(_welcomed_eventually(peer), TIMEOUT)
        again.cancel()
    finally:
        await peer.channel.close()


async def _welcomed_eventually(peer: Peer) -> Any:
    while True:
        try:
            return await peer.welcomed()
        except (AssertionError, grpc.aio.AioRpcError):
            await asyncio.sleep(0.01)


# -- messages that do not parse ------------------------------------------------------------


def _raw(b: bytes) -> bytes:
    return b


GARBAGE = b"\x08\xff\xff\xff"  # field 1 (hello / open) as a varint: the wrong wire type


@pytest.mark.parametrize("method", ["Session", "Stream"])
async def test_a_first_message_that_does_not_parse_is_invalid_argument(
    bus: tuple[EventBusServer, bytes], method: str
) -> None:
    """Not UNKNOWN with a Python exception's text: the code the proto gives malformed
    messages, and the parse error in words."""
    server, ca = bus
    assert server.port is not None
    peer = Peer(server.port, ca)
    path = f"/continuum.bus.v1.EventBus/{method}"
    try:
        call: Any = (
            peer.channel.stream_stream(path, request_serializer=_raw, response_deserializer=_raw)
            if method == "Session"
            else peer.channel.stream_unary(
                path, request_serializer=_raw, response_deserializer=_raw
            )
        )(metadata=peer.metadata)
        await asyncio.wait_for(call.initial_metadata(), TIMEOUT)
        await call.write(GARBAGE)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await asyncio.wait_for(call.read() if method == "Session" else call, TIMEOUT)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
        assert "does not parse" in (err.value.details() or "")
    finally:
        await peer.channel.close()


async def test_a_session_message_after_the_hello_that_does_not_parse_is_invalid_argument(
    bus: tuple[EventBusServer, bytes],
) -> None:
    """Not UNAVAILABLE ("session read failed"), which would tell the listener to retry."""
    server, ca = bus
    assert server.port is not None
    peer = Peer(server.port, ca)
    path = "/continuum.bus.v1.EventBus/Session"
    try:
        call: Any = peer.channel.stream_stream(
            path, request_serializer=_raw, response_deserializer=pb.SessionResponse.FromString
        )(metadata=peer.metadata)
        await asyncio.wait_for(call.initial_metadata(), TIMEOUT)
        hello = pb.Hello(client_id="kv-a", role=pb.ROLE_KV_LISTENER, sources=[A])
        await call.write(pb.SessionRequest(hello=hello).SerializeToString())
        first = await asyncio.wait_for(call.read(), TIMEOUT)
        assert first.WhichOneof("kind") == "welcome"
        await call.write(GARBAGE)
        with pytest.raises(grpc.aio.AioRpcError) as err:  # a Subscribe may come first
            while await asyncio.wait_for(call.read(), TIMEOUT) is not grpc.aio.EOF:
                pass
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
        assert "a SessionRequest does not parse" in (err.value.details() or "")
    finally:
        await peer.channel.close()


async def test_the_bus_keeps_per_stream_flow_control_windows_small(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gRPC's core takes in what the HTTP/2 window allows before the servicer refuses an
    unauthenticated call; BDP probing would grow that window to megabytes per stream,
    which a flood of refused calls with large first messages turns into resident memory
    (the fault matrix's ``abuse/bus-preauth`` row shows it)."""
    import router.eventbus.server as server_module

    seen: list[Any] = []
    real = server_module.start_server

    async def recording(*args: Any, options: Any = (), **kw: Any) -> Any:
        seen.extend(options)
        return await real(*args, options=options, **kw)

    monkeypatch.setattr(server_module, "start_server", recording)
    server = _server(dev_bundle(tmp_path))
    await server.start()
    await server.stop(0)
    assert ("grpc.http2.bdp_probe", 0) in seen
