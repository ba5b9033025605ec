"""The gRPC listener: load balancers and Kubernetes probe the standard health service."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from .conftest import StartRouter, http


async def test_grpc_health_serving(start_router: StartRouter) -> None:
    router = await start_router({"server": {"grpc_listen": "127.0.0.1:0"}, "backends": []})
    assert router.grpc_target is not None, "READY line must announce the gRPC port"
    host, _, port = router.grpc_target.rpartition(":")
    assert host == "127.0.0.1" and int(port) > 0, router.grpc_target

    async with grpc.aio.insecure_channel(router.grpc_target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING

        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=5)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND

    # The HTTP listener runs beside it in the same process.
    r = await http("GET", router.url + "/health")
    assert r.status == 200 and r.json()["status"] == "ok", r


async def test_no_grpc_listener_unless_configured(start_router: StartRouter) -> None:
    router = await start_router({"backends": []})
    assert router.grpc_target is None


async def test_grpc_over_tls_when_configured(start_router: StartRouter, tmp_path) -> None:
    """With grpc_tls_cert/key the services answer only over TLS, verified against the CA."""
    import shutil
    import subprocess

    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI not available to make a test certificate")
    key, cert = tmp_path / "tls.key", tmp_path / "tls.crt"
    subprocess.run(  # noqa: ASYNC221 - a one-off certificate before the router starts
        [
            "openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
            "-keyout", str(key), "-out", str(cert), "-subj", "/CN=localhost",
            "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )  # fmt: skip
    router = await start_router(
        {
            "server": {
                "grpc_listen": "127.0.0.1:0",
                "grpc_tls_cert": str(cert),
                "grpc_tls_key": str(key),
            },
            "backends": [],
        }
    )
    assert router.grpc_target is not None
    creds = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
    async with grpc.aio.secure_channel(router.grpc_target, creds) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    async with grpc.aio.insecure_channel(router.grpc_target) as plain:
        with pytest.raises(grpc.aio.AioRpcError):
            await health_pb2_grpc.HealthStub(plain).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=3
            )
