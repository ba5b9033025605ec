"""Transport equivalence: the golden stream is byte-equal on both transports.

``tests/fixtures/push_stream_golden.sse`` is what a listener hub with a fixed epoch sends
a fresh subscriber of ``vllm-1``: a resync block (resync + a snapshot of two prefixes and
two conversation keys), then live created / evicted / offloaded / updated events of both
kinds (prefixes and chain keys). The same bytes must come out of

* ``GET /events/vllm-1`` (the listener's SSE server), and
* the event bus: the listener's push client streams them over TLS to the router's
  EventBus server, and the router-side opener yields them to the consumer;

and a real router process consuming the fixture over pull (SSE) and over push
(StreamData, in deliberately odd chunk sizes) must end with the same index. (Chain records
do not change the prefix index.)
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import grpc
import pytest
from aiohttp import web

from bus._gen.continuum.bus.v1 import bus_pb2 as bpb
from bus.events import KvEvent
from harness.procs import free_port
from listener.push.client import EventBusClient
from listener.push.config import EventBusClientConfig
from listener.sse_server import SseServer
from listener.stream import EventHub
from router.config.models import BrokerConfig, EventBusConfig
from router.eventbus.server import EventBusServer
from router.eventbus.sessions import SessionRegistry

from .conftest import ROOT, StartRouter, wait_until
from .push_stack import TOKENS, BusPeer, Pki, broker, make_pki, router_config, router_state

pytestmark = pytest.mark.slow

GOLDEN = ROOT / "tests" / "fixtures" / "push_stream_golden.sse"
B = "vllm-1"
EPOCH = "c0ffee00"
P = {i: f"{i:02x}" * 32 for i in range(1, 7)}
K = {i: f"{0xA0 + i:02x}" * 16 for i in range(1, 6)}
SNAPSHOT = [
    KvEvent("cache_created", B, P[1], 1024, "gpu"),
    KvEvent("cache_offloaded", B, P[2], 2048, "storage"),
    KvEvent("chain_created", B, token_count=250, tier="gpu", chain_key=K[1]),
    KvEvent("chain_offloaded", B, token_count=510, tier="storage", chain_key=K[2]),
]
LIVE = [
    KvEvent("cache_created", B, P[3], 512, "gpu"),
    KvEvent("chain_created", B, token_count=240, tier="gpu", chain_key=K[3]),
    KvEvent("cache_created", B, P[4], 256, "gpu"),
    KvEvent("chain_created", B, token_count=498, tier="gpu", chain_key=K[4]),
    KvEvent("cache_evicted", B, P[3]),
    KvEvent("chain_evicted", B, chain_key=K[4]),
    KvEvent("cache_offloaded", B, P[4], 256, "storage"),
    KvEvent("chain_offloaded", B, token_count=240, tier="storage", chain_key=K[3]),
    KvEvent("cache_created", B, P[5], 768, "gpu"),
    KvEvent("cache_created", B, P[6], 4096, "gpu"),
    KvEvent("chain_created", B, token_count=255, tier="gpu", chain_key=K[5]),
    KvEvent("cache_created", B, P[6], 8192, "gpu"),
]
FINAL = {P[1]: 1024, P[5]: 768, P[6]: 8192}
"""The index after the fixture, with storage offloading off (the default)."""


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory)


def make_hub() -> EventHub:
    hub = EventHub(epoch=EPOCH)
    hub.add_backend(B, lambda: list(SNAPSHOT))
    return hub


async def live_after_subscribe(hub: EventHub) -> None:
    """Publish the live events once the transport under test has subscribed."""

    async def subscribed() -> bool:
        return hub.stats()["backends"][B]["subscribers"] == 1

    await wait_until(subscribed, 10, interval=0.01, what="a subscriber")
    for ev in LIVE:
        hub.publish(B, ev)


async def collect(chunks: AsyncIterator[bytes], size: int) -> bytes:
    out = b""
    async with asyncio.timeout(10):
        async for chunk in chunks:
            out += chunk
            if len(out) >= size:
                return out
    return out


def test_the_fixture_is_what_the_hub_sends() -> None:
    hub = make_hub()
    sub = hub.subscribe(B, None)
    for ev in LIVE:
        hub.publish(B, ev)
    assert b"".join(r.sse for r in sub.ready(1000)) == GOLDEN.read_bytes()


async def test_sse_and_event_bus_carry_the_same_bytes(pki: Pki, tmp_path: Path) -> None:
    golden = GOLDEN.read_bytes()
    # Pull: GET /events/vllm-1.
    hub = make_hub()
    sse = SseServer(hub)
    port = await sse.start("127.0.0.1", 0)
    try:
        async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/events/{B}") as r:
            feeder = asyncio.ensure_future(live_after_subscribe(hub))
            pulled = await collect(r.content.iter_any(), len(golden))
            await feeder
    finally:
        await sse.stop()
    assert pulled == golden

    # Push: the listener's client -> TLS -> the router's EventBus server -> the opener.
    hub = make_hub()
    bus_port = free_port()
    router_hub = SessionRegistry([BrokerConfig.model_validate(broker("kv-a", [B]))], [B])
    server = EventBusServer(
        EventBusConfig.model_validate(
            {
                "enabled": True,
                "listen": f"127.0.0.1:{bus_port}",
                "tls": {"cert": str(pki.server.cert), "key": str(pki.server.key)},
            }
        ),
        router_hub,
    )
    await server.start()
    os.environ["GOLDEN_BUS_TOKEN"] = TOKENS["kv-a"]
    client = EventBusClient(
        EventBusClientConfig(
            url=f"https://localhost:{bus_port}",
            ca_file=str(pki.ca.cert),
            client_id="kv-a",
            credential_env="GOLDEN_BUS_TOKEN",
        ),
        hub,
        [B],
    )
    run = asyncio.ensure_future(client.run())
    try:

        async def session() -> bool:
            return bool(router_hub.sessions)

        await wait_until(session, 10, what="the listener's session")
        stream = router_hub.opener(B)(None)
        feeder = asyncio.ensure_future(live_after_subscribe(hub))
        try:
            pushed = await collect(stream, len(golden))
        finally:
            await stream.aclose()  # type: ignore[attr-defined]
        await feeder
    finally:
        await client.drain(run)
        await server.stop()
        del os.environ["GOLDEN_BUS_TOKEN"]
    assert pushed == golden


async def test_router_index_is_the_same_over_pull_and_push(
    start_router: StartRouter, pki: Pki
) -> None:
    golden = GOLDEN.read_bytes()

    async def serve_golden(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(golden)
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.Event().wait()  # keep the stream open
        return resp

    app = web.Application()
    app.router.add_get("/events/{backend}", serve_golden)
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    http_port = runner.addresses[0][1]
    bus_port = free_port()
    pull = {"g-pull": f"http://127.0.0.1:{http_port}/events/g-pull"}
    cfg = router_config(pki, bus_port, ["g-push"], [broker("kv-a", ["g-push"])], pull=pull)
    router = await start_router(cfg)
    peer = BusPeer(pki, bus_port, token=TOKENS["kv-a"])
    try:
        session, first = await peer.hello("kv-a", ["g-push"])
        assert first.WhichOneof("kind") == "welcome"
        msg = await session.read()
        assert msg.WhichOneof("kind") == "subscribe"
        call = peer.stub.Stream(metadata=peer.metadata)
        await call.write(bpb.StreamRequest(open=bpb.StreamOpen(stream_id=msg.subscribe.stream_id)))
        for i in range(0, len(golden), 7):  # chunk boundaries carry no meaning
            await call.write(bpb.StreamRequest(data=bpb.StreamData(data=golden[i : i + 7])))

        async def both_done() -> bool:
            got = [await router_state(router.grpc_address, b, list(P.values())) for b in pull]
            got += [await router_state(router.grpc_address, "g-push", list(P.values()))]
            return all(g == (len(FINAL), FINAL) for g in got)

        await wait_until(both_done, 10, what="the fixture's final state on both backends")
        call.cancel()
        session.cancel()
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.CancelledError):
            await call
    finally:
        await peer.close()
        await runner.cleanup()
