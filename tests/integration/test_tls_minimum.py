"""The router's gRPC port with TLS on refuses a TLS 1.1 client and accepts TLS 1.2 (the
control, with the same client code). gRPC's TLS is grpc core's, whose floor is TLS 1.2;
this pins it. Certificates come from the development PKI (``certs``)."""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path

import pytest

from certs import dev_bundle

from ..tls_servers import pinned_client, tls11
from .conftest import StartRouter


async def handshake(port: int, ctx: ssl.SSLContext) -> str:
    """The negotiated version; raises ssl.SSLError (or a reset) when refused."""
    _, writer = await asyncio.wait_for(
        asyncio.open_connection("127.0.0.1", port, ssl=ctx, server_hostname="localhost"), 10
    )
    try:
        version = writer.get_extra_info("ssl_object").version()
        assert isinstance(version, str)
        return version
    finally:
        writer.close()


async def test_the_grpc_port_refuses_tls_1_1(start_router: StartRouter, tmp_path: Path) -> None:
    pki = dev_bundle(tmp_path)
    router = await start_router(
        {
            "server": {
                "grpc_listen": "127.0.0.1:0",
                "grpc_tls_cert": str(pki["server"].cert),
                "grpc_tls_key": str(pki["server"].key),
            },
            "backends": [],
        }
    )
    port = int(router.grpc_address.rpartition(":")[2])
    ca = pki["ca"].cert
    assert await handshake(port, pinned_client(ca, ssl.TLSVersion.TLSv1_2, "h2")) == "TLSv1.2"
    with pytest.raises((ssl.SSLError, ConnectionError)):
        await handshake(port, pinned_client(ca, tls11(), "h2"))
