"""TLS 1.2 at least on every TLS context the router builds as a client: the upstream HTTP
client (backends, Gemini, embeddings), even with a context handed in, and Redis over TLS.
Real handshakes against a local server pinned to one TLS version."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator

import pytest

from certs import CertPair, dev_bundle
from router.config import RedisConfig
from router.http.client import ConnectError, HttpClient
from router.http.tls import client_context
from router.redis.pools import build_redis
from tests.tls_servers import pinned_server, tls11

_OK = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-type: text/plain\r\n\r\nok"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, CertPair]:
    return dev_bundle(tmp_path_factory.mktemp("pki"))


async def _serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(_OK)
        await writer.drain()
    except (ConnectionError, asyncio.IncompleteReadError, ssl.SSLError):
        pass
    finally:
        writer.close()


async def https_server(pki: dict[str, CertPair], version: ssl.TLSVersion) -> asyncio.Server:
    ctx = pinned_server(pki["server"].cert, pki["server"].key, version)
    return await asyncio.start_server(_serve, "127.0.0.1", 0, ssl=ctx)


@pytest.fixture
async def servers(pki: dict[str, CertPair]) -> AsyncIterator[dict[str, int]]:
    old = await https_server(pki, tls11())
    new = await https_server(pki, ssl.TLSVersion.TLSv1_2)
    try:
        yield {
            "1.1": old.sockets[0].getsockname()[1],
            "1.2": new.sockets[0].getsockname()[1],
        }
    finally:
        old.close()
        new.close()


def permissive(pki: dict[str, CertPair]) -> ssl.SSLContext:
    """What a caller might hand in: verifies, but would accept TLS 1.0 and 1.1."""
    ctx = ssl.create_default_context(cafile=str(pki["ca"].cert))
    with pytest.warns(DeprecationWarning):
        ctx.minimum_version = ssl.TLSVersion.TLSv1
    ctx.set_ciphers("DEFAULT:@SECLEVEL=0")
    return ctx


def test_the_client_context_starts_at_tls_1_2() -> None:
    ctx = client_context()
    assert ctx.minimum_version == ssl.TLSVersion.TLSv1_2
    assert ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname


async def test_the_upstream_client_refuses_a_tls_1_1_server(
    pki: dict[str, CertPair], servers: dict[str, int]
) -> None:
    client = HttpClient(connect_timeout=5, ssl_context=permissive(pki))
    try:
        resp = await client.request("GET", f"https://localhost:{servers['1.2']}/")
        assert resp.status == 200 and await resp.read() == b"ok"  # the control
        with pytest.raises(ConnectError):
            await client.request("GET", f"https://localhost:{servers['1.1']}/")
    finally:
        await client.close()


def test_redis_over_tls_asks_for_tls_1_2() -> None:
    for cfg in (RedisConfig(url="rediss://127.0.0.1:6380"), RedisConfig(tls=True)):
        kwargs = build_redis(cfg).connection_pool.connection_kwargs
        assert kwargs["ssl_min_version"] == ssl.TLSVersion.TLSv1_2, cfg
    plain = build_redis(RedisConfig()).connection_pool.connection_kwargs
    assert "ssl_min_version" not in plain
