"""Push mode end to end: engine -> listener -> TLS event bus -> router index.

Real processes and sockets only: the engine side is the simulator's vLLM KV event
encoder on a ZMQ PUB (salted chains, so the listener attributes every chain), the real
``continuum-kv-listener`` dials the real router's EventBus over TLS (bearer token or
mTLS client certificate), and the router's KV index must end up equal to the listener's
own state for the backend (``GET /events/{backend}``'s resync block): no missing entry,
no stale entry, the same token counts. Nothing sleeps a fixed time.
"""

from __future__ import annotations

import functools
import signal
from pathlib import Path

import pytest

from harness.procs import free_port

from .conftest import StartRouter, wait_until
from .push_stack import (
    TOKENS,
    ListenerProc,
    Pki,
    Publisher,
    backend_status,
    broker,
    listener_config,
    listener_state,
    make_pki,
    router_config,
    running,
    streaming_from,
    wait_router_matches,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory)


B = "vllm-1"


async def test_events_reach_the_index_over_tls_with_a_token(
    start_router: StartRouter, pki: Pki, tmp_path: Path
) -> None:
    bus_port, zmq_port = free_port(), free_port()
    router = await start_router(router_config(pki, bus_port, [B], [broker("kv-a", [B])]))
    pub = await Publisher(zmq_port, B).start()
    cfg = listener_config(pki, bus_port, "kv-a", {B: zmq_port})
    listener = await ListenerProc(cfg, tmp_path / "l.yaml", TOKENS["kv-a"]).start()
    async with running(listener, pub):
        await listener.warm_up(pub)
        await pub.burst(40, 8)  # 320 block events: 5 chains of 64 blocks
        state = await wait_router_matches(router.grpc_address, listener, B)
        assert len(state) >= 5
        st = await backend_status(router.grpc_address, B)
        assert st.connected and st.transport == "event_bus"
        assert st.last_event_id.startswith((await listener.stats())["epoch"] + "-")
        # The listener keeps its own SSE endpoint for pull consumers.
        assert await listener_state(listener.url, B) == state


async def test_mtls_client_certificate_alone_authenticates(
    start_router: StartRouter, pki: Pki, tmp_path: Path
) -> None:
    bus_port, zmq_port = free_port(), free_port()
    brokers = [broker("kv-a", [B], token=False)]
    router = await start_router(router_config(pki, bus_port, [B], brokers, client_ca=True))
    pub = await Publisher(zmq_port, B).start()
    cfg = listener_config(pki, bus_port, "kv-a", {B: zmq_port}, mtls=True, token=False)
    listener = await ListenerProc(cfg, tmp_path / "l.yaml").start()
    async with running(listener, pub):
        await listener.warm_up(pub)
        await pub.burst(16, 8)
        await wait_router_matches(router.grpc_address, listener, B)
        assert "(kv_listener, certificate)" in router.log()


async def test_listener_sigkill_and_restart_resyncs_without_stale_entries(
    start_router: StartRouter, pki: Pki, tmp_path: Path
) -> None:
    bus_port, zmq_port = free_port(), free_port()
    router = await start_router(router_config(pki, bus_port, [B], [broker("kv-a", [B])]))
    pub = await Publisher(zmq_port, B).start()
    cfg = listener_config(pki, bus_port, "kv-a", {B: zmq_port})
    listener = ListenerProc(cfg, tmp_path / "l.yaml", TOKENS["kv-a"])
    await listener.start()
    async with running(listener, pub):
        await listener.warm_up(pub)
        await pub.burst(24, 8)
        before = await wait_router_matches(router.grpc_address, listener, B)
        assert before
        await listener.kill()  # mid-stream: no Draining, no StreamClose, no FIN handshake
        await listener.start()  # new epoch, empty tracker
        await listener.warm_up(pub)
        await pub.burst(8, 8)
        after = await wait_router_matches(router.grpc_address, listener, B)
        assert after and not set(after) & set(before)  # every old entry is gone
        st = await backend_status(router.grpc_address, B)
        assert st.last_event_id.startswith((await listener.stats())["epoch"] + "-")


async def test_router_restart_rebuilds_the_index_from_the_listener(
    start_router: StartRouter, pki: Pki, tmp_path: Path
) -> None:
    bus_port, zmq_port = free_port(), free_port()
    config = router_config(pki, bus_port, [B], [broker("kv-a", [B])])
    router = await start_router(config)
    pub = await Publisher(zmq_port, B).start()
    cfg = listener_config(pki, bus_port, "kv-a", {B: zmq_port})
    listener = await ListenerProc(cfg, tmp_path / "l.yaml", TOKENS["kv-a"]).start()
    async with running(listener, pub):
        await listener.warm_up(pub)
        await pub.burst(16, 8)
        await wait_router_matches(router.grpc_address, listener, B)
        router.proc.send_signal(signal.SIGTERM)  # sessions end UNAVAILABLE; index lost
        assert await router.proc.wait() == 0
        second = await start_router(config)  # same bus port: the listener reconnects
        await wait_router_matches(second.grpc_address, listener, B)
        await pub.burst(8, 8)  # and live events keep flowing to the new router
        await wait_router_matches(second.grpc_address, listener, B)
        assert "event bus: session" in listener.log()


async def test_sigterm_drains_and_a_second_listener_takes_over(
    start_router: StartRouter, pki: Pki, tmp_path: Path
) -> None:
    bus_port, zmq_port = free_port(), free_port()
    brokers = [broker("kv-a", [B]), broker("kv-b", [B])]
    router = await start_router(router_config(pki, bus_port, [B], brokers))
    pub = await Publisher(zmq_port, B).start()
    a = ListenerProc(
        listener_config(pki, bus_port, "kv-a", {B: zmq_port}), tmp_path / "a.yaml", TOKENS["kv-a"]
    )
    b = ListenerProc(
        listener_config(pki, bus_port, "kv-b", {B: zmq_port}), tmp_path / "b.yaml", TOKENS["kv-b"]
    )
    await a.start()
    await b.start()
    async with running(a, b, pub):
        await a.warm_up(pub)
        await b.warm_up(pub)
        await pub.burst(16, 8)
        # The router streams from the newest session; find which one it is.
        serving = await wait_until(
            functools.partial(streaming_from, router.grpc_address, B, [a, b]),
            20,
            what="a stream from one listener",
        )
        other = b if serving is a else a
        await wait_router_matches(router.grpc_address, serving, B)
        assert await serving.terminate() == 0  # SIGTERM: Draining, streams closed, exit 0
        assert "event bus: drained" in serving.log()
        await pub.burst(8, 8)  # events after the drain reach the router through the other
        await wait_router_matches(router.grpc_address, other, B)
        assert "is draining" in router.log()


async def test_a_reload_adds_and_removes_an_event_bus_source(
    start_router: StartRouter, pki: Pki, tmp_path: Path
) -> None:
    """A listener's session is open before the router consumes its source: the reload
    that adds the ``transport: event_bus`` source subscribes over that session (no
    reconnect), and the one that removes it stops the stream."""
    bus_port, zmq_port = free_port(), free_port()
    cfg = router_config(pki, bus_port, [B], [broker("kv-a", [B])])
    sources = cfg["kv_cache_index"]["event_sources"]
    cfg["kv_cache_index"] = {**cfg["kv_cache_index"], "event_sources": []}
    router = await start_router(cfg)
    pub = await Publisher(zmq_port, B).start()
    lcfg = listener_config(pki, bus_port, "kv-a", {B: zmq_port})
    listener = await ListenerProc(lcfg, tmp_path / "l.yaml", TOKENS["kv-a"]).start()
    async with running(listener, pub):
        await listener.warm_up(pub)
        await router.wait_for_log("(kv_listener, token) announces vllm-1", within=15)
        await pub.burst(16, 8)
        consumers = await router.stats_of("/admin/kv-index/backends")
        assert consumers["backends"] == [], consumers

        with_source = {**cfg, "kv_cache_index": {**cfg["kv_cache_index"], "event_sources": sources}}
        assert await router.reload(with_source)
        state = await wait_router_matches(router.grpc_address, listener, B)
        assert len(state) >= 2
        st = await backend_status(router.grpc_address, B)
        assert st.connected and st.transport == "event_bus"
        assert router.log().count("announces vllm-1") == 1, "the session was not reopened"

        assert await router.reload(cfg)

        async def stopped() -> bool:
            return (await router.stats_of("/admin/kv-index/backends"))["backends"] == []

        await wait_until(stopped, 10, what="the removed source's consumer to stop")
        assert "applies only after a restart" not in router.log()
