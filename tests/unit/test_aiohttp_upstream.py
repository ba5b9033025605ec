"""proxy_bench's aiohttp variant of the router: the client keeps the router's contract, and
``python -m bench.aiohttp_router`` really serves through it.

The ``full/full-aiohttp`` ratio only means something if the variant does the same work as
the router's own client: the same answers, and the same error classes where the proxy
decides by class (a connect error retries elsewhere, a timeout is a 504).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import orjson
import pytest

from bench.aiohttp_router import MARKER
from bench.aiohttp_upstream import AiohttpUpstreamClient
from harness.procs import Service, free_port
from harness.sim.fleet import SimFleet
from router.upstream import UpstreamConnectError, UpstreamProtocolError, UpstreamTimeout

ROOT = Path(__file__).resolve().parents[2]
MODEL = "m"
JSON = {"content-type": "application/json"}


def chat(stream: bool = False) -> bytes:
    return orjson.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    )


@pytest.fixture
async def client() -> AsyncIterator[AiohttpUpstreamClient]:
    c = AiohttpUpstreamClient(connect_timeout_s=2.0, read_timeout_s=0.5)
    await c.start()
    try:
        yield c
    finally:
        await c.close()


@pytest.fixture
async def sim_url() -> AsyncIterator[str]:
    async with SimFleet(n=1, model=MODEL, trivial=True) as fleet:
        yield fleet.urls[0]


async def test_answer_and_stream_from_an_engine(
    client: AiohttpUpstreamClient, sim_url: str
) -> None:
    resp = await client.request("b1", "POST", sim_url + "/v1/chat/completions", JSON, chat())
    assert resp.status == 200
    assert resp.content_type.startswith("application/json")
    assert resp.headers["CONTENT-TYPE"] == resp.content_type
    assert orjson.loads(await resp.read())["object"] == "chat.completion"

    resp = await client.request("b1", "POST", sim_url + "/v1/chat/completions", JSON, chat(True))
    assert resp.content_type.startswith("text/event-stream")
    body = b"".join([chunk async for chunk in resp.iter_chunks()])
    assert body.rstrip().endswith(b"data: [DONE]")


async def test_refused_connection_is_a_connect_error(client: AiohttpUpstreamClient) -> None:
    with pytest.raises(UpstreamConnectError) as exc:
        await client.request("b1", "GET", f"http://127.0.0.1:{free_port()}/health", {})
    assert exc.value.backend == "b1"


async def test_a_closed_client_refuses_like_an_unreachable_backend() -> None:
    c = AiohttpUpstreamClient(connect_timeout_s=1.0, read_timeout_s=1.0)
    await c.start()
    await c.close()
    with pytest.raises(UpstreamConnectError, match="shutting down"):
        await c.request("b1", "GET", "http://127.0.0.1:9/health", {})


async def _server(answer: bytes | None) -> tuple[asyncio.Server, str]:
    """Reads a request head, then answers ``answer`` (None: never answers)."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        if answer is None:
            await reader.read()  # until the client gives up
        else:
            writer.write(answer)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}"


async def test_no_answer_within_the_read_timeout_is_a_timeout(
    client: AiohttpUpstreamClient,
) -> None:
    server, url = await _server(None)
    async with server:
        with pytest.raises(UpstreamTimeout):
            await client.request("b1", "GET", url + "/health", {})


async def test_probe_timeout_is_a_total_deadline(client: AiohttpUpstreamClient) -> None:
    server, url = await _server(None)
    async with server:
        with pytest.raises(UpstreamTimeout):
            await client.request("b1", "GET", url + "/health", {}, client_timeout=0.1)


async def test_garbage_is_a_protocol_error(client: AiohttpUpstreamClient) -> None:
    server, url = await _server(b"SPDY/9 what\r\n\r\n")
    async with server:
        with pytest.raises(UpstreamProtocolError):
            await client.request("b1", "GET", url + "/health", {})


def test_install_refuses_once_a_router_module_holds_the_routers_client() -> None:
    """Swapped too late, the router would quietly keep its own client."""
    code = "import router.pool, bench.aiohttp_router as m; m.install()"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode != 0
    assert "router.pool" in proc.stderr


async def test_the_launcher_serves_through_the_aiohttp_client(sim_url: str, tmp_path: Path) -> None:
    config = {
        "server": {"listen": "127.0.0.1:0"},
        "health_check": {"interval_ms": 10000},
        "backends": [{"name": "b1", "url": sim_url, "type": "vllm", "models": [MODEL]}],
    }
    router = Service("router", ["bench.aiohttp_router", "serve"], config, tmp_path / "r.yaml")
    async with router, aiohttp.ClientSession() as session:
        url = router.url + "/v1/chat/completions"
        async with session.post(url, data=chat(), headers=JSON) as resp:
            assert resp.status == 200
            assert resp.headers["x-continuum-backend"] == "b1"
    assert MARKER in router.log()
