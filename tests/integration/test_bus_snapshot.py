"""A backend's snapshot over the event bus is the listener's ``GET /snapshot`` body.

The listener's push client (``EventBusClient``) dials the router's ``EventBus`` server
over TLS with a bearer token, as in production; the router side asks for a snapshot on
the session (``SessionRegistry.snapshot``, what push-mode anti-entropy calls). With the
smallest ``batch_max_bytes`` the answer spans dozens of ``SnapshotChunk`` messages; joined
they must be byte-equal to what the SSE server's ``GET /snapshot/<backend>`` serves from
the same hub, and parse as a snapshot at the hub's position. A source the listener
announced but does not hold is answered with an error, which fails that fetch only: the
session and the next fetch go on.
"""

from __future__ import annotations

import asyncio
import os

import aiohttp
import pytest

from bus.events import KvEvent
from harness.procs import free_port
from listener.push.client import EventBusClient
from listener.push.config import EventBusClientConfig
from listener.sse_server import SseServer
from listener.stream import EventHub
from router.config.models import BrokerConfig, EventBusConfig
from router.eventbus.server import EventBusServer
from router.eventbus.sessions import SessionRegistry
from router.ingest.snapshot import SnapshotError, parse_snapshot

from .conftest import wait_until
from .push_stack import TOKENS, Pki, broker, make_pki

B, GHOST = "vllm-1", "vllm-9"
SNAPSHOT = [KvEvent("cache_created", B, f"{i:064x}", 16 * (i + 1), "gpu") for i in range(300)]
TOKEN_VAR = "BUS_SNAPSHOT_TOKEN"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory)


async def test_the_bus_snapshot_is_the_http_snapshot_in_chunks(pki: Pki) -> None:
    hub = EventHub(epoch="5eed0001")
    hub.add_backend(B, lambda: list(SNAPSHOT))
    for ev in SNAPSHOT[:7]:
        hub.publish(B, ev)  # the snapshot's id is the hub's position: e-7
    sse = SseServer(hub)
    port = await sse.start("127.0.0.1", 0)
    try:
        async with (
            aiohttp.ClientSession() as s,
            s.get(f"http://127.0.0.1:{port}/snapshot/{B}") as r,
        ):
            assert r.status == 200
            http_body = await r.read()
    finally:
        await sse.stop()

    bus_port = free_port()
    registry = SessionRegistry(
        [BrokerConfig.model_validate(broker("kv-a", [B, GHOST]))], [B, GHOST]
    )
    server = EventBusServer(
        EventBusConfig.model_validate(
            {
                "enabled": True,
                "listen": f"127.0.0.1:{bus_port}",
                "tls": {"cert": str(pki.server.cert), "key": str(pki.server.key)},
            }
        ),
        registry,
    )
    await server.start()
    os.environ[TOKEN_VAR] = TOKENS["kv-a"]
    client = EventBusClient(
        EventBusClientConfig(
            url=f"https://localhost:{bus_port}",
            ca_file=str(pki.ca.cert),
            client_id="kv-a",
            credential_env=TOKEN_VAR,
            batch_max_bytes=1024,
        ),
        hub,
        [B, GHOST],  # announced, but the hub has no GHOST
    )
    run = asyncio.ensure_future(client.run())
    try:

        async def session() -> bool:
            return bool(registry.sessions)

        await wait_until(session, 10, what="the listener's session")
        raw = await registry.snapshot(B, 10)
        assert raw == http_body and len(raw) > 20 * 1024
        event_id, events = parse_snapshot(raw, B)
        assert event_id == "5eed0001-7" and events == SNAPSHOT
        with pytest.raises(SnapshotError, match="unknown source 'vllm-9'"):
            await registry.snapshot(GHOST, 10)
        assert await registry.snapshot(B, 10) == http_body  # the session goes on
        assert client.stats["snapshots"] == 3 and len(registry.sessions) == 1
        assert registry.counters["snapshot_requests"] == 3
        assert registry.counters["snapshot_failures"] == 1
    finally:
        await client.drain(run)
        await server.stop()
        del os.environ[TOKEN_VAR]
