"""A backend without an active probe, through the real router: only consecutive connect
failures eject it, and after the cool-down a half-open retry brings it back without a
restart. The backend is a sim behind a relay that can stop listening (connections are
then refused, as from a crashed engine) and listen again on the same port."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator

import pytest_asyncio

from harness.sim.fleet import SimFleet

from .conftest import (
    RouterProc,
    StartRouter,
    assert_openai_error,
    backend,
    chat_body,
    metric_value,
    wait_until,
)


class SwitchableRelay:
    """A TCP relay to ``target`` on a fixed port that can be taken down and brought up.

    Down closes the listener and every relayed connection (the router's pooled keep-alive
    ones too), so the next connect is refused.
    """

    def __init__(self, target_host: str, target_port: int) -> None:
        self._target = (target_host, target_port)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def up(self) -> None:
        self._server = await asyncio.start_server(
            self._serve, "127.0.0.1", self.port, reuse_address=True
        )

    async def down(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for w in list(self._writers):
            w.transport.abort()
        self._writers.clear()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self._target)
        self._writers.update((writer, up_writer))

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(ConnectionError, OSError):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.transport.abort()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        self._writers.difference_update((writer, up_writer))


@pytest_asyncio.fixture(loop_scope="session")
async def relay(sims: SimFleet) -> AsyncIterator[SwitchableRelay]:
    host, _, port = sims[0].url.removeprefix("http://").partition(":")
    r = SwitchableRelay(host, int(port))
    await r.up()
    try:
        yield r
    finally:
        await r.down()


async def start(start_router: StartRouter, url: str) -> RouterProc:
    return await start_router(
        {
            "health_check": {
                "enabled": False,
                "unhealthy_threshold": 3,
                "ejection_cooldown_ms": 300,
            },
            "backends": [backend("flaky", url, models=["demo-model"])],
        }
    )


async def state(router: RouterProc) -> str:
    text = await router.metrics()
    for s in ("healthy", "ejected", "half_open", "unhealthy"):
        if metric_value(text, "continuum_backend_state", backend="flaky", state=s) == 1:
            return s
    raise AssertionError(f"no state for flaky in:\n{text}")


async def test_only_consecutive_connect_failures_eject(
    start_router: StartRouter, relay: SwitchableRelay
) -> None:
    router = await start(start_router, relay.url)
    for _ in range(3):  # 2 failures, a success: the count starts again every time
        await relay.down()
        for _ in range(2):
            assert_openai_error(await router.chat(), 502)
        await relay.up()
        assert (await router.chat()).status == 200
    assert await state(router) == "healthy"


async def test_an_ejected_backend_comes_back_after_the_cool_down(
    start_router: StartRouter, relay: SwitchableRelay
) -> None:
    router = await start(start_router, relay.url)
    await relay.down()
    for _ in range(3):
        assert_openai_error(await router.chat(), 502)
    err = assert_openai_error(await router.chat(), 503)
    assert "no healthy backend" in err["message"]
    assert await state(router) == "ejected"
    doc = await router.stats_of("/admin/backends")
    (flaky,) = doc["backends"]
    assert flaky["name"] == "flaky"
    assert flaky["state"] == "ejected"
    assert flaky["consecutive_failures"] == 3

    await relay.up()

    async def served() -> bool:
        return (await router.chat(chat_body("again"))).status == 200

    await wait_until(served, 10.0, interval=0.1, what="the half-open retry to succeed")
    assert await state(router) == "healthy"
    doc = await router.stats_of("/admin/backends")
    assert doc["backends"][0]["state"] == "healthy"
    assert doc["backends"][0]["consecutive_failures"] == 0
