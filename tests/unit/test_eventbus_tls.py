"""Event bus TLS: extended key usage and protocol versions, with certificates from the
project's ``certs`` package over real TLS on loopback.

A client certificate must carry clientAuth, the router's certificate serverAuth: the TLS
stack refuses the wrong purpose at the handshake, the router refuses to start with a
server certificate that is not for serving, and the authenticator refuses a presented
client certificate without clientAuth even when the handshake let it through (a
certificate with no EKU extension at all). TLS below 1.2 never completes a handshake.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography.x509.oid import ExtendedKeyUsageOID

from bus._gen.continuum.bus.v1 import bus_pb2_grpc as pb_grpc
from bus.grpc_tls import has_extended_key_usage
from certs import CertPair, dev_bundle, make_client_cert, make_server_cert
from router.config.models import BrokerConfig, EventBusConfig, EventBusTlsConfig
from router.eventbus.auth import Authenticator, AuthError
from router.eventbus.server import EventBusConfigError, EventBusServer
from router.eventbus.sessions import SessionRegistry

A = "vllm-1"
SERVER_AUTH, CLIENT_AUTH = ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH


def kv_a() -> BrokerConfig:
    return BrokerConfig.model_validate({"id": "kv-a", "role": "kv_listener", "backends": [A]})


def bus_config(server: CertPair, client_ca: CertPair | None = None) -> EventBusConfig:
    tls = EventBusTlsConfig(
        cert=str(server.cert),
        key=str(server.key),
        client_ca=str(client_ca.cert) if client_ca else None,
    )
    return EventBusConfig(enabled=True, listen="127.0.0.1:0", tls=tls, brokers=[kv_a()])


async def admitted(port: int, ca: CertPair, client: CertPair | None = None) -> Any:
    """The status code a Session call gets before any message, or "admitted"."""
    key = client.key.read_bytes() if client else None
    chain = client.cert.read_bytes() if client else None
    creds = grpc.ssl_channel_credentials(ca.cert.read_bytes(), key, chain)
    async with grpc.aio.secure_channel(f"localhost:{port}", creds) as channel:
        call = pb_grpc.EventBusStub(channel).Session()
        try:
            await asyncio.wait_for(call.initial_metadata(), 10)
            if call.done():
                return await call.code(), await call.details()
            return "admitted"
        finally:
            call.cancel()


def test_the_certs_package_makes_certificates_for_one_purpose(tmp_path: Path) -> None:
    pki = dev_bundle(tmp_path, clients=["kv-a"])
    wrong = make_client_cert(
        pki["ca"], tmp_path, "kv-a", name="w", extended_key_usage=[SERVER_AUTH]
    )
    assert has_extended_key_usage(pki["kv-a"].cert.read_bytes(), CLIENT_AUTH)
    assert not has_extended_key_usage(pki["kv-a"].cert.read_bytes(), SERVER_AUTH)
    assert has_extended_key_usage(pki["server"].cert.read_bytes(), SERVER_AUTH)
    assert not has_extended_key_usage(wrong.cert.read_bytes(), CLIENT_AUTH)
    assert not has_extended_key_usage(b"not a certificate", CLIENT_AUTH)


async def test_a_client_certificate_without_client_auth_never_gets_a_call(
    tmp_path: Path,
) -> None:
    pki = dev_bundle(tmp_path, clients=["kv-a"])
    wrong = make_client_cert(
        pki["ca"], tmp_path, "kv-a", name="w", extended_key_usage=[SERVER_AUTH]
    )
    cfg = bus_config(pki["server"], pki["ca"])
    server = EventBusServer(cfg, SessionRegistry.from_config(cfg, [A]))
    port = await server.start()
    try:
        assert await admitted(port, pki["ca"], pki["kv-a"]) == "admitted"
        code, _ = await admitted(port, pki["ca"], wrong)
        assert code == grpc.StatusCode.UNAVAILABLE  # the handshake failed: no call was made
    finally:
        await server.stop(0)


def test_the_authenticator_refuses_a_presented_certificate_without_client_auth(
    tmp_path: Path,
) -> None:
    pki = dev_bundle(tmp_path)
    for usage in ([SERVER_AUTH], []):  # [] : no EKU extension at all
        wrong = make_client_cert(pki["ca"], tmp_path, "kv-a", name="w", extended_key_usage=usage)
        ctx = {"x509_pem_cert": [wrong.cert.read_bytes()]}
        auth = Authenticator([kv_a()], certificates=True)
        with pytest.raises(AuthError, match="clientAuth") as info:
            auth.authenticate([], ctx)
        assert info.value.code == grpc.StatusCode.UNAUTHENTICATED


async def test_the_router_refuses_to_serve_with_a_certificate_not_for_serving(
    tmp_path: Path,
) -> None:
    pki = dev_bundle(tmp_path)
    wrong = make_server_cert(pki["ca"], tmp_path, name="w", extended_key_usage=[CLIENT_AUTH])
    server = EventBusServer(bus_config(wrong), SessionRegistry([kv_a()], [A]))
    with pytest.raises(EventBusConfigError, match=r"dynamo\.event_bus\.tls\.cert: .*serverAuth"):
        await server.start()


# -- TLS versions ---------------------------------------------------------------------------


def handshake(port: int, ca: CertPair, version: ssl.TLSVersion) -> str:
    """Complete a TLS handshake at exactly ``version``; returns the version or the error."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(str(ca.cert))
    ctx.set_alpn_protocols(["h2"])
    ctx.set_ciphers("DEFAULT:@SECLEVEL=0")  # let this client offer old versions at all
    ctx.minimum_version = ctx.maximum_version = version
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        try:
            with ctx.wrap_socket(raw, server_hostname="localhost") as tls:
                return str(tls.version())
        except ssl.SSLError as exc:
            return f"refused: {exc.reason}"


@pytest.mark.filterwarnings("ignore:ssl.TLSVersion.TLSv1:DeprecationWarning")
async def test_the_bus_takes_tls_1_2_and_1_3_and_nothing_older(tmp_path: Path) -> None:
    pki = dev_bundle(tmp_path)
    server = EventBusServer(bus_config(pki["server"]), SessionRegistry([kv_a()], [A]))
    port = await server.start()
    try:
        for version, want in (
            (ssl.TLSVersion.TLSv1_3, "TLSv1.3"),
            (ssl.TLSVersion.TLSv1_2, "TLSv1.2"),
        ):
            assert await asyncio.to_thread(handshake, port, pki["ca"], version) == want
        for old in (ssl.TLSVersion.TLSv1, ssl.TLSVersion.TLSv1_1):
            got = await asyncio.to_thread(handshake, port, pki["ca"], old)
            assert got.startswith("refused"), got
            assert "NO_PROTOCOLS_AVAILABLE" not in got  # offered, and refused by the server
    finally:
        await server.stop(0)
