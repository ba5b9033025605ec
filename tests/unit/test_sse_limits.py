"""The listener's SSE server bounds what subscribers can hold: at most ``max_subscribers``
open streams (503 beyond), and a subscriber whose socket takes no bytes for
``write_timeout`` is disconnected and counted, releasing its snapshot. Real sockets on
loopback; the stalled client is a raw TCP socket that never reads."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator

import aiohttp
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bus.events import KvEvent
from listener.config import ListenerConfig
from listener.sse_server import SseServer
from listener.stream import EventHub
from tests import waiting

B = "vllm-1"
BIG_SNAPSHOT = [
    KvEvent("cache_created", B, f"{i:064x}", token_count=i, tier="gpu") for i in range(60_000)
]
"""About 10 MB of SSE records: more than loopback socket buffers hold."""


def test_the_limits_have_documented_defaults() -> None:
    cfg = ListenerConfig()
    assert (cfg.max_subscribers, cfg.subscriber_write_timeout_ms) == (256, 30_000)


@contextlib.asynccontextmanager
async def serving(snapshot: list[KvEvent], write_timeout: float) -> AsyncIterator[SseServer]:
    hub = EventHub(1024, 1024)
    hub.add_backend(B, lambda: snapshot)
    srv = SseServer(hub, heartbeat_interval=60, max_subscribers=2, write_timeout=write_timeout)
    await srv.start("127.0.0.1", 0)
    try:
        yield srv
    finally:
        await srv.stop()
        hub.close()


@pytest.fixture
async def server() -> AsyncIterator[SseServer]:
    async with serving(BIG_SNAPSHOT, 0.2) as srv:
        yield srv


@pytest.fixture
async def small_server() -> AsyncIterator[SseServer]:
    """Streams that fit in the socket buffers: nothing stalls."""
    async with serving(BIG_SNAPSHOT[:2], 30.0) as srv:
        yield srv


def never_reading_client(port: int) -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.sendall(f"GET /events/{B} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    return sock


async def test_a_subscriber_that_never_reads_is_disconnected_and_counted(
    server: SseServer,
) -> None:
    assert server.port is not None
    sock = never_reading_client(server.port)
    try:
        await waiting.eventually(lambda: server.counters["stalled_subscribers"] == 1, 10.0)
        await waiting.eventually(lambda: server.open_streams == 0, 5.0)
        assert server.hub.stats()["backends"][B]["subscribers"] == 0
        # The server closed its end: reading drains what was sent, then ends.
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(10):
            while await loop.sock_recv(sock, 1 << 20):
                pass
    finally:
        sock.close()
    async with aiohttp.ClientSession() as s:
        async with s.get(f"http://127.0.0.1:{server.port}/metrics") as r:
            text = await r.text()
        async with s.get(f"http://127.0.0.1:{server.port}/stats") as r:
            stats = orjson.loads(await r.read())
    values = {
        sample.name: sample.value
        for fam in text_string_to_metric_families(text)
        for sample in fam.samples
    }
    assert values["continuum_kv_listener_sse_stalled_subscribers_total"] == 1
    assert stats["sse"]["stalled_subscribers"] == 1


async def test_subscribers_beyond_the_cap_get_503(small_server: SseServer) -> None:
    server = small_server
    assert server.port is not None
    url = f"http://127.0.0.1:{server.port}/events/{B}"
    async with aiohttp.ClientSession() as s:
        first = await s.get(url)
        second = await s.get(url)
        await waiting.eventually(lambda: server.open_streams == 2, 5.0)
        async with s.get(url) as third:
            assert third.status == 503
            body = await third.json()
        assert "max_subscribers (2)" in body["error"]["message"]
        assert server.counters["refused_subscribers"] == 1
        first.close()
        second.close()
        await waiting.eventually(lambda: server.open_streams == 0, 5.0)
        async with s.get(url) as again:
            assert again.status == 200
