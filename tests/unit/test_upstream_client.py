"""The upstream HTTP client (router.http.client via router.upstream) against real sockets.

Two kinds of servers: a ``harness.sim`` engine in a subprocess (the real thing the router talks
to: Content-Length answers, chunked SSE streams, keep-alive) and small raw asyncio servers
written here for what a well-behaved engine never does: closing idle connections, stalling,
answering garbage, breaking off mid-body. Every test runs on both the stdlib event loop and
uvloop (what the router runs on): transports differ in how they pause, close and report EOF.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import re
import shutil
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import orjson
import pytest
import uvloop

from router.http.client import _HIGH_WATER, HttpClient, parse_url
from router.upstream import (
    UpstreamClient,
    UpstreamConnectError,
    UpstreamProtocolError,
    UpstreamTimeout,
)

ROOT = Path(__file__).resolve().parents[2]
MODEL = "m"


def both_loops(fn: Callable[..., Awaitable[None]]) -> Callable[..., None]:
    """Run the async test once on the stdlib loop and once on uvloop.

    The test may take a ``client`` argument: a started ``UpstreamClient`` (2 s connect and
    read timeouts) made on the test's own loop and closed after it. Other arguments are
    fixtures, as usual.
    """
    sig = inspect.signature(fn)
    needs_client = "client" in sig.parameters
    params = [p for name, p in sig.parameters.items() if name != "client"]
    loop_kind = inspect.Parameter("loop_kind", inspect.Parameter.POSITIONAL_OR_KEYWORD)

    def test(loop_kind: str, **kwargs: object) -> None:
        async def main() -> None:
            c = None
            if needs_client:
                c = UpstreamClient(connect_timeout_s=2.0, read_timeout_s=2.0)
                await c.start()
                kwargs["client"] = c
            try:
                await asyncio.wait_for(fn(**kwargs), 30)
            finally:
                if c is not None:
                    await c.close()

        (uvloop.run if loop_kind == "uvloop" else asyncio.run)(main())

    test.__name__ = fn.__name__
    test.__qualname__ = fn.__qualname__
    test.__doc__ = fn.__doc__
    test.__signature__ = sig.replace(parameters=[loop_kind, *params])  # type: ignore[attr-defined]
    return pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])(test)


# -- a real engine ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sim_url() -> Iterator[str]:
    """One ``harness.sim --trivial`` engine for the module (fixed answer, 4-event SSE streams)."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "harness.sim",
            "--port",
            "0",
            "--trivial",
            "--model",
            MODEL,
            "--die-with-parent",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()
    m = re.match(r"READY (\d+)", line)
    assert m, f"sim did not start: {line!r}"
    try:
        yield f"http://127.0.0.1:{m.group(1)}"
    finally:
        proc.terminate()
        proc.wait(10)


def chat(stream: bool = False) -> bytes:
    return orjson.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    )


JSON = {"content-type": "application/json", "accept-encoding": "identity"}


def inner(c: UpstreamClient) -> HttpClient:
    assert c._client is not None
    return c._client


# -- raw servers -----------------------------------------------------------------------------

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]


class RawServer:
    """A TCP server running ``handler(reader, writer, connection_index)`` per connection."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.requests: list[bytes] = []
        self.closed = asyncio.Event()  # set when a connection ended (the peer went away)
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> RawServer:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._server.wait_closed(), 2)

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        index = self.connections
        self.connections += 1
        try:
            await self.handler(reader, writer, index)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
            self.closed.set()

    async def read_request(self, reader: asyncio.StreamReader) -> bytes | None:
        """One request (head + Content-Length body), or None at EOF."""
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            return None
        m = re.search(rb"(?im)^content-length:\s*(\d+)", head)
        body = await reader.readexactly(int(m.group(1))) if m else b""
        self.requests.append(head + body)
        return head + body


def ok(body: bytes = b'{"ok":true}', extra: bytes = b"") -> bytes:
    return (
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%b\r\n%b"
        % (len(body), extra, body)
    )


async def wait_for(pred: Callable[[], bool], within: float = 3.0) -> None:
    deadline = time.monotonic() + within
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


# -- against the engine ----------------------------------------------------------------------


@both_loops
async def test_keep_alive_reuses_one_connection(client: UpstreamClient, sim_url: str) -> None:
    for _ in range(20):
        up = await client.request("sim", "POST", sim_url + "/v1/chat/completions", JSON, chat())
        assert up.status == 200
        data = orjson.loads(await up.read())
        assert data["choices"][0]["message"]["content"]
    assert inner(client).connections_opened == 1
    assert inner(client).idle_connections(sim_url) == 1


@both_loops
async def test_content_length_body_and_case_insensitive_headers(
    client: UpstreamClient, sim_url: str
) -> None:
    up = await client.request("sim", "POST", sim_url + "/v1/chat/completions", JSON, chat())
    body = await up.read()
    assert int(up.headers["Content-Length"]) == len(body)
    assert up.headers.get("CONTENT-TYPE") == up.content_type == "application/json"
    assert "X-Sim-Backend" in up.headers and "x-sim-backend" in up.headers
    up.release()  # a no-op once read


@both_loops
async def test_chunked_sse_stream(client: UpstreamClient, sim_url: str) -> None:
    for _ in range(3):  # and the connection is reused after each complete stream
        up = await client.request(
            "sim", "POST", sim_url + "/v1/chat/completions", JSON, chat(stream=True)
        )
        assert up.status == 200
        assert up.content_type.startswith("text/event-stream")
        assert up.headers["transfer-encoding"] == "chunked"
        raw = b"".join([c async for c in up.iter_chunks()])
        events = [e for e in raw.split(b"\n\n") if e]
        assert events[-1] == b"data: [DONE]"
        assert all(e.startswith(b"data: ") for e in events)
        assert b"\r\n" not in raw, "chunk framing must be decoded"
        up.release()
    assert inner(client).connections_opened == 1


@both_loops
async def test_get_probe_with_total_timeout(client: UpstreamClient, sim_url: str) -> None:
    """What the health checker does: a GET (never HEAD) under a total probe timeout."""
    up = await client.request("sim", "GET", sim_url + "/v1/models", {}, client_timeout=2.0)
    assert up.status == 200
    ids = [m["id"] for m in orjson.loads(await up.read())["data"]]
    assert MODEL in ids
    up = await client.request("sim", "GET", sim_url + "/health", {}, client_timeout=2.0)
    assert 200 <= up.status < 300
    await up.read()


@both_loops
async def test_get_sends_no_body_headers() -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, _: int) -> None:
        while await srv.read_request(r) is not None:
            w.write(ok())

    async with RawServer(handler) as srv:
        c = UpstreamClient(1, 1)
        await c.start()
        up = await c.request("raw", "GET", srv.url + "/health?x=1", {"Authorization": "Bearer k"})
        await up.read()
        up = await c.request("raw", "POST", srv.url + "/p", {"Host": "evil", "x-a": "1"}, b"abc")
        await up.read()
        port = srv.url.rsplit(":", 1)[1]
        await c.close()
    get, post = srv.requests
    assert get.startswith(b"GET /health?x=1 HTTP/1.1\r\n")
    assert b"content-length" not in get.lower() and get.endswith(b"\r\n\r\n")
    assert f"host: 127.0.0.1:{port}\r\n".encode() in get
    assert b"Authorization: Bearer k\r\n" in get
    assert post.endswith(b"content-length: 3\r\n\r\nabc")
    assert b"evil" not in post, "the client owns Host"


# -- streaming, abandoning, flow control -----------------------------------------------------


@both_loops
async def test_stream_chunks_arrive_before_the_response_ends(client: UpstreamClient) -> None:
    release = asyncio.Event()

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, _: int) -> None:
        await srv.read_request(r)
        w.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n6\r\nfirst\n\r\n"
        )
        await release.wait()
        w.write(b"7\r\nsecond\n\r\n0\r\n\r\n")

    async with RawServer(handler) as srv:
        up = await client.request("raw", "POST", srv.url + "/s", JSON, b"{}")
        it = up.iter_chunks()
        assert await asyncio.wait_for(it.__anext__(), 2) == b"first\n"
        release.set()
        assert await asyncio.wait_for(it.__anext__(), 2) == b"second\n"
        with pytest.raises(StopAsyncIteration):
            await it.__anext__()


@both_loops
async def test_abandoning_a_stream_closes_the_connection(client: UpstreamClient) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, _: int) -> None:
        await srv.read_request(r)
        w.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        while True:  # an endless generation, until the client goes away
            w.write(b"5\r\ntick\n\r\n")
            await w.drain()
            await asyncio.sleep(0.02)

    async with RawServer(handler) as srv:
        up = await client.request("raw", "POST", srv.url + "/s", JSON, b"{}")
        async for chunk in up.iter_chunks():
            assert b"tick" in chunk
            break
        up.close()
        await asyncio.wait_for(srv.closed.wait(), 3)  # the engine saw the disconnect
        assert inner(client).idle_connections(srv.url) == 0
        # A release() of an unfinished response closes too (never reuses a mid-body socket).
        up = await client.request("raw", "POST", srv.url + "/s", JSON, b"{}")
        up.release()
        assert srv.connections == 2
        assert inner(client).idle_connections(srv.url) == 0


@both_loops
async def test_cancelled_read_closes_the_connection(client: UpstreamClient) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, _: int) -> None:
        await srv.read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc")
        await r.read()  # until the client hangs up

    async with RawServer(handler) as srv:
        up = await client.request("raw", "POST", srv.url + "/s", JSON, b"{}")
        task = asyncio.ensure_future(up.read())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(srv.closed.wait(), 3)


@both_loops
async def test_flow_control_pauses_a_lagging_consumer() -> None:
    size = 8 * 1024 * 1024
    payload = bytes(range(256)) * (size // 256)

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, _: int) -> None:
        await srv.read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % size)
        for i in range(0, size, 65536):
            w.write(payload[i : i + 65536])
            await w.drain()

    async with RawServer(handler) as srv:
        c = HttpClient(connect_timeout=1, read_timeout=5)
        resp = await c.request("POST", srv.url + "/big", {}, b"")
        got = [await resp.next_chunk()]
        await asyncio.sleep(0.3)  # lag: the server keeps sending meanwhile
        conn = resp._conn
        assert conn is not None and conn.paused, "reading must pause past the high-water mark"
        assert resp._buffered <= _HIGH_WATER + 512 * 1024
        while chunk := await resp.next_chunk():
            got.append(chunk)
        assert b"".join(got) == payload
        assert c.idle_connections(srv.url) == 1, "complete: back in the pool"
        await c.close()


# -- connection management -------------------------------------------------------------------


@both_loops
async def test_stale_pooled_connection_is_retried_transparently(client: UpstreamClient) -> None:
    """The server closes a kept-alive connection just as the next request arrives."""

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, index: int) -> None:
        await srv.read_request(r)
        w.write(ok(b'{"n":%d}' % index))
        await w.drain()
        if index == 0:
            await srv.read_request(r)  # read the second request and drop it unanswered
            return
        while await srv.read_request(r) is not None:
            w.write(ok(b'{"n":%d}' % index))

    async with RawServer(handler) as srv:
        up = await client.request("raw", "POST", srv.url + "/x", JSON, b"{}")
        assert await up.read() == b'{"n":0}'
        up = await client.request("raw", "POST", srv.url + "/x", JSON, b"{}")
        assert await up.read() == b'{"n":1}', "retried once on a fresh connection"
        assert srv.connections == 2
        assert len(srv.requests) == 3, "the second request was sent twice"


@both_loops
async def test_idle_connection_closed_by_the_server_leaves_the_pool(
    client: UpstreamClient,
) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, _: int) -> None:
        await srv.read_request(r)
        w.write(ok())
        await w.drain()
        await asyncio.sleep(0.05)  # then its keep-alive timeout closes the idle socket

    async with RawServer(handler) as srv:
        up = await client.request("raw", "POST", srv.url + "/x", JSON, b"{}")
        await up.read()
        await wait_for(lambda: inner(client).idle_connections(srv.url) == 0)
        up = await client.request("raw", "POST", srv.url + "/x", JSON, b"{}")
        assert await up.read() == b'{"ok":true}'
        assert srv.connections == 2


@both_loops
async def test_fresh_connection_closed_without_answer_is_a_connect_error(
    client: UpstreamClient,
) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, _: int) -> None:
        await srv.read_request(r)  # read it, answer nothing, close

    async with RawServer(handler) as srv:
        with pytest.raises(UpstreamConnectError) as ei:
            await client.request("raw", "POST", srv.url + "/x", JSON, b"{}")
        assert ei.value.backend == "raw"
        assert srv.connections == 1, "a fresh connection is never retried by the client"


@both_loops
async def test_connect_refused_is_a_connect_error(client: UpstreamClient) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(UpstreamConnectError) as ei:
        await client.request("gone", "POST", f"http://127.0.0.1:{port}/x", JSON, b"{}")
    assert ei.value.backend == "gone"
    assert "cannot connect" in ei.value.detail


@both_loops
async def test_connection_close_response_is_not_reused(client: UpstreamClient) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, _: int) -> None:
        await srv.read_request(r)
        w.write(ok(extra=b"connection: close\r\n"))

    async with RawServer(handler) as srv:
        for _ in range(2):
            up = await client.request("raw", "POST", srv.url + "/x", JSON, b"{}")
            assert await up.read() == b'{"ok":true}'
        assert srv.connections == 2


@pytest.mark.parametrize("framing", [b"", b"transfer-encoding: identity\r\n"], ids=["none", "te"])
@both_loops
async def test_body_delimited_by_close(client: UpstreamClient, framing: bytes) -> None:
    """No Content-Length and not chunked: the body ends when the server closes."""

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, _: int) -> None:
        await srv.read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n%b\r\nuntil " % framing)
        await w.drain()
        await asyncio.sleep(0.02)
        w.write(b"the end")

    async with RawServer(handler) as srv:
        up = await client.request("raw", "POST", srv.url + "/x", JSON, b"{}")
        assert await up.read() == b"until the end"


@both_loops
async def test_interim_1xx_response_is_skipped(client: UpstreamClient) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, _: int) -> None:
        while await srv.read_request(r) is not None:
            w.write(b"HTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n" + ok())

    async with RawServer(handler) as srv:
        for _ in range(2):
            up = await client.request("raw", "POST", srv.url + "/x", JSON, b"{}")
            assert up.status == 200 and "link" not in up.headers
            assert await up.read() == b'{"ok":true}'
        assert srv.connections == 1


@both_loops
async def test_pool_grows_on_demand_and_reuses_lifo(sim_url: str) -> None:
    c = HttpClient(connect_timeout=1, read_timeout=2)
    url = sim_url + "/health"

    async def get() -> None:
        resp = await c.request("GET", url)
        await resp.read()

    await asyncio.gather(*(get() for _ in range(4)))  # no limit: 4 at once, 4 connections
    assert c.connections_opened == 4 and c.idle_connections(url) == 4
    idle = c._target(url)[0].idle
    hottest = idle[-1]
    for _ in range(5):
        await get()
        assert idle[-1] is hottest, "the most recently used connection is reused first"
    assert c.connections_opened == 4
    await c.close()


@both_loops
async def test_idle_timeout_drops_old_connections(sim_url: str) -> None:
    c = HttpClient(connect_timeout=1, read_timeout=2, idle_timeout=0.1)
    resp = await c.request("GET", sim_url + "/health")
    await resp.read()
    assert c.idle_connections(sim_url) == 1
    await asyncio.sleep(0.15)
    resp = await c.request("GET", sim_url + "/health")
    await resp.read()
    assert c.connections_opened == 2, "an expired idle connection is not reused"
    await c.close()


# -- timeouts and broken answers -------------------------------------------------------------


@both_loops
async def test_no_answer_within_read_timeout_is_a_timeout() -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, _: int) -> None:
        await srv.read_request(r)
        await r.read()  # until the client hangs up

    async with RawServer(handler) as srv:
        c = UpstreamClient(connect_timeout_s=1.0, read_timeout_s=0.3)
        await c.start()
        t0 = time.monotonic()
        with pytest.raises(UpstreamTimeout) as ei:
            await c.request("slow", "POST", srv.url + "/x", JSON, b"{}")
        elapsed = time.monotonic() - t0
        assert 0.3 <= elapsed < 1.0, elapsed
        assert ei.value.backend == "slow"
        await asyncio.wait_for(srv.closed.wait(), 3)  # the abandoned request's socket is closed
        await c.close()


@both_loops
async def test_stalled_stream_is_a_timeout() -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, _: int) -> None:
        await srv.read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n")
        await r.read()  # until the client hangs up

    async with RawServer(handler) as srv:
        c = UpstreamClient(connect_timeout_s=1.0, read_timeout_s=0.2)
        await c.start()
        up = await c.request("slow", "POST", srv.url + "/x", JSON, b"{}")
        got = []
        with pytest.raises(UpstreamTimeout):
            async for chunk in up.iter_chunks():
                got.append(chunk)
        assert got == [b"abc"]
        await c.close()


@both_loops
async def test_probe_total_timeout_bounds_a_trickling_body(client: UpstreamClient) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, _: int) -> None:
        await srv.read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for _ in range(100):  # each chunk well within the read timeout, the whole not
            w.write(b"1\r\nx\r\n")
            await w.drain()
            await asyncio.sleep(0.05)

    async with RawServer(handler) as srv:
        t0 = time.monotonic()
        with pytest.raises(UpstreamTimeout):
            up = await client.request("raw", "GET", srv.url + "/health", {}, client_timeout=0.3)
            await up.read()
        assert time.monotonic() - t0 < 1.0


@pytest.mark.parametrize(
    "answer",
    [
        b"garbage\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: nope\r\n\r\n",
        b"HTTP/1.1 abc OK\r\n\r\n",
    ],
    ids=["not-http", "bad-length", "bad-status"],
)
@both_loops
async def test_garbage_is_a_protocol_error(client: UpstreamClient, answer: bytes) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, _: int) -> None:
        await srv.read_request(r)
        w.write(answer)
        await r.read()  # until the client hangs up

    async with RawServer(handler) as srv:
        with pytest.raises(UpstreamProtocolError) as ei:
            await client.request("garbler", "POST", srv.url + "/x", JSON, b"{}")
        assert ei.value.backend == "garbler"
        await asyncio.wait_for(srv.closed.wait(), 3)


@both_loops
async def test_eof_in_the_head_is_a_protocol_error(client: UpstreamClient) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, _: int) -> None:
        await srv.read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\ncontent-le")

    async with RawServer(handler) as srv:
        with pytest.raises(UpstreamProtocolError):
            await client.request("raw", "POST", srv.url + "/x", JSON, b"{}")


@both_loops
async def test_premature_eof_mid_body_is_a_protocol_error(client: UpstreamClient) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, _: int) -> None:
        await srv.read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n0123456789")

    async with RawServer(handler) as srv:
        up = await client.request("raw", "POST", srv.url + "/x", JSON, b"{}")
        with pytest.raises(UpstreamProtocolError) as ei:
            await up.read()
        assert "broke off" in ei.value.detail


@both_loops
async def test_stream_broken_off_is_a_protocol_error_after_its_chunks(
    client: UpstreamClient,
) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, _: int) -> None:
        await srv.read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n")
        await w.drain()

    async with RawServer(handler) as srv:
        up = await client.request("raw", "POST", srv.url + "/x", JSON, b"{}")
        got = []
        with pytest.raises(UpstreamProtocolError):
            async for chunk in up.iter_chunks():
                got.append(chunk)
        assert got == [b"abc"]


@both_loops
async def test_extra_bytes_after_a_response_poison_the_connection(
    client: UpstreamClient,
) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, _: int) -> None:
        while await srv.read_request(r) is not None:
            w.write(ok() + b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")

    async with RawServer(handler) as srv:
        for _ in range(2):
            up = await client.request("raw", "POST", srv.url + "/x", JSON, b"{}")
            assert await up.read() == b'{"ok":true}'
        assert srv.connections == 2, "a connection with unrequested bytes is not reused"


@both_loops
async def test_header_injection_is_refused(client: UpstreamClient, sim_url: str) -> None:
    with pytest.raises(UpstreamProtocolError):
        await client.request("sim", "GET", sim_url + "/health", {"x-a": "1\r\nx-b: 2"})


def test_parse_url() -> None:
    assert parse_url("http://h:81/a?b#c") == ("http", "h", 81, "h:81", "/a?b")
    assert parse_url("https://api.example.com") == (
        "https",
        "api.example.com",
        443,
        "api.example.com",
        "/",
    )
    assert parse_url("HTTP://[::1]:9000/v1") == ("http", "::1", 9000, "[::1]:9000", "/v1")
    assert parse_url("http://h?x=1")[4] == "/?x=1"
    for bad in ("ftp://h/", "h:80/x", "http://h:99999/", "http://:80/", "http://h:x/"):
        with pytest.raises(ValueError):
            parse_url(bad)


# -- TLS -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("the openssl CLI is needed to make a self-signed certificate")
    d = tmp_path_factory.mktemp("tls")
    cert, key = d / "cert.pem", d / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "2",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost,IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


@contextlib.asynccontextmanager
async def tls_server(cert: Path, key: Path) -> AsyncIterator[str]:
    from aiohttp import web

    async def hello(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if request.query.get("stream"):
            resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
            await resp.prepare(request)
            for i in range(3):
                await resp.write(b"data: %d\n\n" % i)
            await resp.write_eof()
            return resp
        return web.json_response({"echo": body.decode(), "peer": "tls"})

    app = web.Application()
    app.router.add_route("*", "/echo", hello)
    runner = web.AppRunner(app)
    await runner.setup()
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ctx)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"https://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@both_loops
async def test_tls_with_the_default_context(
    tls_files: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    cert, key = tls_files
    # The default context trusts SSL_CERT_FILE: the production code path, with a test CA.
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))
    async with tls_server(cert, key) as url:
        c = UpstreamClient(2.0, 2.0)
        await c.start()
        for i in range(3):
            up = await c.request("cloud", "POST", url + "/echo", JSON, b"hi%d" % i)
            assert up.status == 200
            assert orjson.loads(await up.read()) == {"echo": f"hi{i}", "peer": "tls"}
        up = await c.request("cloud", "POST", url + "/echo?stream=1", JSON, b"")
        assert up.content_type == "text/event-stream"
        assert b"".join([x async for x in up.iter_chunks()]) == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
        assert inner(c).connections_opened == 1, "TLS connections are kept alive too"
        await c.close()


@both_loops
async def test_tls_untrusted_certificate_is_a_connect_error(
    tls_files: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    cert, key = tls_files
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    async with tls_server(cert, key) as url:
        c = UpstreamClient(2.0, 2.0)
        await c.start()
        with pytest.raises(UpstreamConnectError) as ei:
            await c.request("cloud", "GET", url + "/echo", {})
        assert "certificate" in ei.value.detail.lower()
        await c.close()


@both_loops
async def test_a_closed_client_refuses_like_an_unreachable_backend() -> None:
    """A request that reaches the client after shutdown closed it (past the drain grace)
    fails as a connect error, which the proxy answers 502 with an OpenAI body, instead of
    an AssertionError and a traceback in the log."""
    c = UpstreamClient(connect_timeout_s=1.0, read_timeout_s=1.0)
    await c.start()
    await c.close()
    with pytest.raises(UpstreamConnectError, match="shutting down"):
        await c.request("b", "POST", "http://127.0.0.1:9/v1/chat/completions", {}, b"{}")
