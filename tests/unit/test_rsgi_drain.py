"""RSGIApp's graceful stop: 503 for new requests once closing, drain waits for the rest."""

from __future__ import annotations

import asyncio

import orjson

from router.http.rsgi import RSGIApp
from router.http.types import Request, Response


class _Scope:
    proto = "http"
    method = "POST"
    path = "/v1/chat/completions"
    query_string = ""
    client = "127.0.0.1:1"

    def __init__(self) -> None:
        self.headers = {"content-length": "2"}


class _Proto:
    """The part of granian's RSGI protocol object RSGIApp uses for a small body."""

    def __init__(self) -> None:
        self.sent: list[tuple[int, list[tuple[str, str]], bytes]] = []

    async def __call__(self) -> bytes:
        return b"{}"

    def response_bytes(self, status: int, headers: list[tuple[str, str]], body: bytes) -> None:
        self.sent.append((status, headers, body))


async def test_close_answers_503_and_drain_waits_for_requests_in_flight() -> None:
    release = asyncio.Event()

    async def handler(req: Request) -> Response:
        await release.wait()
        return Response(200, b'{"ok":true}', [("content-type", "application/json")])

    app = RSGIApp(handler, 1024)
    assert await app.drain(0.01) == 0  # idle: nothing to wait for
    first, second = _Proto(), _Proto()
    tasks = [asyncio.ensure_future(app.__rsgi__(_Scope(), p)) for p in (first, second)]
    await asyncio.sleep(0)
    assert app.in_flight == 2

    app.close()
    late = _Proto()
    await app.__rsgi__(_Scope(), late)
    [(status, headers, body)] = late.sent
    assert status == 503
    assert ("connection", "close") in headers
    assert orjson.loads(body)["error"]["code"] == "shutting_down"

    assert await app.drain(0.05) == 2  # the grace ran out with both still in flight
    release.set()
    assert await app.drain(5) == 0
    await asyncio.gather(*tasks)
    assert [p.sent[0][0] for p in (first, second)] == [200, 200]
