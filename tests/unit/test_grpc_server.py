"""bus.grpc_server and bus.grpc_tls: the set-up the router's and the listener's gRPC
servers share, on real sockets with real TLS (the development PKI)."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from bus._gen.continuum.kvindex.v1 import kvindex_pb2, kvindex_pb2_grpc
from bus.grpc_server import HEALTH_SERVICE_NAME, StartedServer, generated, start_server
from bus.grpc_tls import channel_credentials, server_credentials
from certs import dev_bundle
from router.config.models import EventBusConfig, EventBusTlsConfig
from router.eventbus.server import EventBusConfigError, EventBusServer
from router.eventbus.sessions import SessionRegistry

KVINDEX = kvindex_pb2.DESCRIPTOR.services_by_name["KvIndex"].full_name
REFLECTION = "grpc.reflection.v1alpha.ServerReflection"


def _kvindex() -> object:
    # The generated base class: every RPC answers UNIMPLEMENTED, enough to be listed.
    return generated(
        kvindex_pb2_grpc.add_KvIndexServicer_to_server, kvindex_pb2_grpc.KvIndexServicer(), KVINDEX
    )


@pytest.fixture
async def started() -> AsyncIterator[StartedServer]:
    s = await start_server(
        "127.0.0.1:0",
        [_kvindex()],  # type: ignore[list-item]
        health_status={"": True, KVINDEX: False},
        reflection=True,
    )
    yield s
    await s.server.stop(0)


async def _status(channel: grpc.aio.Channel, service: str) -> int:
    reply = await health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service=service), timeout=5
    )
    return reply.status


async def test_health_has_a_status_per_service(started: StartedServer) -> None:
    assert started.port > 0 and started.health is not None
    async with grpc.aio.insecure_channel(f"127.0.0.1:{started.port}") as channel:
        assert await _status(channel, "") == health_pb2.HealthCheckResponse.SERVING
        assert await _status(channel, KVINDEX) == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await _status(channel, "no.such.Service")
        assert info.value.code() == grpc.StatusCode.NOT_FOUND


async def test_reflection_lists_the_services_health_and_itself(started: StartedServer) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{started.port}") as channel:
        call = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")])
        )
        reply = await call.read()
        call.cancel()
    names = {s.name for s in reply.list_services_response.service}
    assert names == {KVINDEX, HEALTH_SERVICE_NAME, REFLECTION}


async def test_without_health_and_reflection_the_server_has_only_its_services() -> None:
    s = await start_server("127.0.0.1:0", [_kvindex()])  # type: ignore[list-item]
    try:
        assert s.health is None
        async with grpc.aio.insecure_channel(f"127.0.0.1:{s.port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await _status(channel, "")
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        await s.server.stop(0)


async def test_a_taken_port_is_a_runtime_error() -> None:
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        port = blocker.getsockname()[1]
        with pytest.raises(RuntimeError):
            await start_server(f"127.0.0.1:{port}", [])


async def _health_over_tls(port: int, creds: grpc.ChannelCredentials) -> int:
    async with grpc.aio.secure_channel(f"localhost:{port}", creds) as channel:
        return await _status(channel, "")


async def test_tls_with_a_client_ca_requires_a_client_certificate(tmp_path: Path) -> None:
    pki = dev_bundle(tmp_path, clients=["kv-listener-a"])
    ca, srv, client = pki["ca"], pki["server"], pki["kv-listener-a"]
    s = await start_server(
        "127.0.0.1:0",
        [],
        credentials=server_credentials(str(srv.cert), str(srv.key), str(ca.cert)),
        health_status={"": True},
    )
    try:
        mtls = channel_credentials(str(ca.cert), str(client.cert), str(client.key))
        assert await _health_over_tls(s.port, mtls) == health_pb2.HealthCheckResponse.SERVING
        # A certificate without its key (or a key alone) is not presented at all.
        for cert, key in ((str(client.cert), None), (None, str(client.key))):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await _health_over_tls(s.port, channel_credentials(str(ca.cert), cert, key))
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        async with grpc.aio.insecure_channel(f"127.0.0.1:{s.port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await _status(channel, "")
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await s.server.stop(0)


async def test_tls_without_a_client_ca_takes_any_client(tmp_path: Path) -> None:
    pki = dev_bundle(tmp_path)
    ca, srv = pki["ca"], pki["server"]
    s = await start_server(
        "127.0.0.1:0",
        [],
        credentials=server_credentials(str(srv.cert), str(srv.key)),
        health_status={"": True},
    )
    try:
        creds = channel_credentials(str(ca.cert))
        assert await _health_over_tls(s.port, creds) == health_pb2.HealthCheckResponse.SERVING
        # The system roots do not know the development CA.
        with pytest.raises(grpc.aio.AioRpcError):
            await _health_over_tls(s.port, channel_credentials())
    finally:
        await s.server.stop(0)


def test_an_unreadable_pem_names_its_path(tmp_path: Path) -> None:
    pki = dev_bundle(tmp_path)
    missing = str(tmp_path / "missing.pem")
    srv = pki["server"]
    with pytest.raises(OSError, match=r"missing\.pem"):
        server_credentials(str(srv.cert), str(srv.key), missing)
    with pytest.raises(OSError, match=r"missing\.pem"):
        server_credentials(missing, str(srv.key))
    with pytest.raises(OSError, match=r"missing\.pem"):
        channel_credentials(missing)


async def test_the_event_bus_names_its_config_path_for_an_unreadable_pem(
    tmp_path: Path,
) -> None:
    pki = dev_bundle(tmp_path)
    missing = str(tmp_path / "missing-ca.pem")
    cert, key = str(pki["server"].cert), str(pki["server"].key)

    def server(**tls: str | None) -> EventBusServer:
        bus = EventBusConfig(enabled=True, listen="127.0.0.1:0", tls=EventBusTlsConfig(**tls))
        return EventBusServer(bus, SessionRegistry([], ()))

    with pytest.raises(EventBusConfigError) as info:
        await server(cert=cert, key=key, client_ca=missing).start()
    assert str(info.value).startswith("dynamo.event_bus.tls: ")
    assert "missing-ca.pem" in str(info.value)
    with pytest.raises(EventBusConfigError, match="the event bus is TLS only"):
        await server(key=key).start()
