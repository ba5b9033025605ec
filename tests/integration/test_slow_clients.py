"""Slow clients cannot starve the router: a body that takes longer than
``server.body_read_timeout_ms`` to arrive gets 408, and requests beyond
``server.max_concurrent_requests`` get 503 with ``Retry-After`` at once, while the slow
ones hold their slots. Real sockets against a running router: each trickling client
sends its headers, then one body byte every so often."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest_asyncio

from harness.sim.fleet import SimFleet

from .conftest import (
    ERROR_KEYS,
    RouterProc,
    StartRouter,
    assert_openai_error,
    backend,
    metric_value,
    wait_until,
)

BODY = orjson.dumps({"model": "demo-model", "messages": [{"role": "user", "content": "hi"}]})


class Trickler:
    """One client on its own socket: the headers at once, then a body byte per ``every`` s."""

    def __init__(self, url: str, every: float) -> None:
        host, _, port = url.removeprefix("http://").partition(":")
        self._addr = (host, int(port))
        self._every = every
        self._task: asyncio.Task[bytes] | None = None
        self.sent = 0

    async def start(self) -> Trickler:
        reader, writer = await asyncio.open_connection(*self._addr)
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: router\r\n"
            b"content-type: application/json\r\n"
            b"content-length: %d\r\n\r\n" % len(BODY)
        )
        await writer.drain()
        self._task = asyncio.ensure_future(self._run(reader, writer))
        return self

    async def _run(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
        read = asyncio.ensure_future(reader.read())  # until the router closes
        try:
            for byte in BODY:
                if read.done():
                    break
                writer.write(bytes([byte]))
                with contextlib.suppress(ConnectionError):
                    await writer.drain()
                self.sent += 1
                await asyncio.wait([read], timeout=self._every)
            return await read
        finally:
            read.cancel()
            writer.close()

    async def response(self) -> tuple[int, dict[str, str], Any]:
        """Status, headers and JSON body of what the router answered."""
        assert self._task is not None
        raw = await asyncio.wait_for(self._task, 30)
        head, _, body = raw.partition(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        status = int(lines[0].split()[1])
        headers = dict(line.split(": ", 1) for line in lines[1:])
        headers = {k.lower(): v for k, v in headers.items()}
        return status, headers, orjson.loads(body)

    def cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()


@pytest_asyncio.fixture(loop_scope="session")
async def tricklers() -> AsyncIterator[list[Trickler]]:
    started: list[Trickler] = []
    try:
        yield started
    finally:
        for t in started:
            t.cancel()


async def start(start_router: StartRouter, sims: SimFleet, **server: Any) -> RouterProc:
    return await start_router(
        {
            "server": server,
            "health_check": {"enabled": False},
            "backends": [backend("sim", sims[0].url, models=["demo-model"])],
        }
    )


async def test_a_body_slower_than_the_deadline_gets_408(
    start_router: StartRouter, sims: SimFleet, tricklers: list[Trickler]
) -> None:
    router = await start(start_router, sims, body_read_timeout_ms=500)
    # One byte per 100 ms: never a long gap, but the whole body takes about 8 s.
    slow = await Trickler(router.url, 0.1).start()
    tricklers.append(slow)
    status, headers, body = await slow.response()
    assert status == 408, body
    assert headers["content-type"].startswith("application/json")
    assert set(body["error"]) == ERROR_KEYS
    assert body["error"]["code"] == "request_timeout"
    assert slow.sent < len(BODY), "the router answered before the body was complete"
    # The router still serves everyone else.
    assert (await router.chat()).status == 200
    text = await router.metrics()
    assert metric_value(text, "continuum_http_rejected_total", reason="body_timeout") == 1


async def test_requests_over_the_cap_get_503_with_retry_after(
    start_router: StartRouter, sims: SimFleet, tricklers: list[Trickler]
) -> None:
    router = await start(start_router, sims, max_concurrent_requests=4, body_read_timeout_ms=60_000)
    for _ in range(4):
        tricklers.append(await Trickler(router.url, 1.0).start())

    async def refused() -> Any:
        r = await router.chat()
        return r if r.status == 503 else None

    r = await wait_until(refused, 10.0, interval=0.1, what="a request over the cap to get 503")
    err = assert_openai_error(r, 503)
    assert err["code"] == "overloaded"
    assert int(r.headers["Retry-After"]) >= 1
    text = await router.metrics()
    assert metric_value(text, "continuum_http_rejected_total", reason="overloaded") >= 1
    assert metric_value(text, "continuum_http_requests_in_flight") >= 4

    for t in tricklers:  # the slow clients give up: their slots are free again
        t.cancel()

    async def served() -> bool:
        return (await router.chat()).status == 200

    await wait_until(served, 15.0, interval=0.1, what="the router to serve again")
