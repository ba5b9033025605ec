"""A deliberately small HTTP/1.1 server on a raw asyncio ``Protocol`` and httptools.

Why not aiohttp: router throughput is benchmarked against this server, so the backend must be
several times faster than the thing being measured, otherwise the benchmark measures the
backend. A Protocol + httptools server does one parser callback pass and one
``transport.write`` per response, which is roughly 3-5x what aiohttp's server manages.

Scope is what a simulated inference engine needs and no more: keep-alive, pipelining (responses
are written strictly in request order), Content-Length and chunked request bodies,
Content-Length responses, chunked streaming responses fed by an async iterator, ``Expect:
100-continue``, and cancellation of the handler (and its stream generator) when the client goes
away. No TLS, no upgrades, no idle timeouts.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from http import HTTPStatus
from typing import Any, cast
from urllib.parse import parse_qs

try:
    import httptools
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "harness.sim needs httptools: pip install httptools (it is not pulled in by uvloop)"
    ) from exc

try:
    import orjson

    def dumps(obj: Any) -> bytes:
        """Serialise to compact JSON bytes; orjson keeps the sim off the profile."""
        return orjson.dumps(obj)

    loads: Callable[[bytes | str], Any] = orjson.loads
    JSONDecodeError: type[Exception] = orjson.JSONDecodeError
except ImportError:  # pragma: no cover - orjson is a project dependency
    import json

    def dumps(obj: Any) -> bytes:
        """Serialise to compact JSON bytes (stdlib fallback when orjson is absent)."""
        return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()

    loads = json.loads
    JSONDecodeError = ValueError

__all__ = [
    "Handler",
    "Request",
    "Response",
    "StreamResponse",
    "bound_port",
    "dumps",
    "json_response",
    "loads",
    "serve",
    "shutdown",
]

log = logging.getLogger("harness.sim.http")

# Pre-rendered status lines: formatting them per response is measurable at 20k+ req/s.
_STATUS_LINES: dict[int, bytes] = {
    s.value: f"HTTP/1.1 {s.value} {s.phrase}\r\n".encode() for s in HTTPStatus
}
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_LAST_CHUNK = b"0\r\n\r\n"
# Pipelined requests beyond this many queued on one connection pause reading, so a client
# cannot make us buffer unbounded work; we resume once the queue drains to the low mark.
_QUEUE_HIGH = 64
_QUEUE_LOW = 8


def _status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    if line is None:
        line = f"HTTP/1.1 {status} Unknown\r\n".encode()
    return line


class Request:
    """One parsed request; the body is fully buffered because sim handlers need all of it."""

    __slots__ = ("body", "headers", "http_version", "keep_alive", "method", "path", "query")

    def __init__(
        self,
        method: str,
        path: str,
        query: str,
        headers: dict[str, str],
        body: bytes,
        keep_alive: bool = True,
        http_version: str = "1.1",
    ) -> None:
        self.method = method
        self.path = path
        #: Raw query string without the ``?`` (cheap); use :attr:`args` for a parsed view.
        self.query = query
        #: Lower-case header names; repeated headers are joined with ", ".
        self.headers = headers
        self.body = body
        self.keep_alive = keep_alive
        self.http_version = http_version

    @property
    def args(self) -> dict[str, list[str]]:
        """Parsed query, computed on demand so the hot path never pays for it."""
        return parse_qs(self.query, keep_blank_values=True)

    def json(self) -> Any:
        """Decode the body as JSON; raises ``JSONDecodeError`` (a ``ValueError``) if invalid."""
        return loads(self.body)

    def __repr__(self) -> str:
        return f"<Request {self.method} {self.path} {len(self.body)}B>"


class Response:
    """A complete response sent with Content-Length (one write, keep-alive friendly)."""

    __slots__ = ("body", "content_type", "headers", "status")

    def __init__(
        self,
        body: bytes | str = b"",
        status: int = 200,
        headers: Mapping[str, str] | None = None,
        content_type: str = "application/json",
    ) -> None:
        self.body = body.encode() if isinstance(body, str) else body
        self.status = status
        self.headers = headers
        self.content_type = content_type


class StreamResponse:
    """A response whose body is produced incrementally (SSE), sent chunked.

    The iterator is closed (``aclose``) when the response ends for any reason, and the task
    driving it is cancelled if the client disconnects, so generator ``finally`` blocks are the
    place to release per-request state.
    """

    __slots__ = ("body_iter", "content_type", "headers", "status")

    def __init__(
        self,
        body_iter: AsyncIterator[bytes],
        status: int = 200,
        headers: Mapping[str, str] | None = None,
        content_type: str = "text/event-stream",
    ) -> None:
        self.body_iter = body_iter
        self.status = status
        self.headers = headers
        self.content_type = content_type


Handler = Callable[[Request], Awaitable[Response | StreamResponse]]


def json_response(
    obj: Any, status: int = 200, headers: Mapping[str, str] | None = None
) -> Response:
    """Shortcut because nearly every sim endpoint answers JSON."""
    return Response(dumps(obj), status, headers)


def _encode_headers(headers: Mapping[str, str] | None) -> bytes:
    if not headers:
        return b""
    return "".join([f"{k}: {v}\r\n" for k, v in headers.items()]).encode("latin-1")


class _HttpProtocol(asyncio.Protocol):
    """One instance per TCP connection; parser callbacks fill a FIFO that one task drains."""

    def __init__(self, handler: Handler, connections: set[_HttpProtocol]) -> None:
        self._handler = handler
        self._connections = connections
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpRequestParser(self)
        # Per-message parse state, reset in on_message_begin.
        self._url = b""
        self._headers: dict[str, str] = {}
        self._body: list[bytes] = []
        self._keep_alive = True
        self._version = "1.1"
        # Requests waiting for the worker; ``None`` marks a parse error to answer in order.
        self._queue: deque[Request | None] = deque()
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._parse_failed = False
        self._eof = False
        self._reading_paused = False
        self._write_paused = False
        self._drain_waiter: asyncio.Future[None] | None = None

    # -- asyncio.Protocol -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)
        self._connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self._connections.discard(self)
        self._queue.clear()
        if self._task is not None:
            # Cancels a running handler or the stream generator it is iterating.
            self._task.cancel()
        self._wake_drain()

    def data_received(self, data: bytes) -> None:
        if self._parse_failed:
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail_parse()
        except httptools.HttpParserError:
            self._fail_parse()

    def eof_received(self) -> bool | None:
        # A half-closing client (``nc -N``, some load tools) still wants its answers: keep the
        # write side open until the queue is served, then close.
        self._eof = True
        if self._task is None:
            return None
        return True

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        self._wake_drain()

    # -- httptools callbacks ----------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = {}
        self._body = []

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        key = name.decode("latin-1").lower()
        val = value.decode("latin-1")
        prev = self._headers.get(key)
        self._headers[key] = val if prev is None else f"{prev}, {val}"

    def on_headers_complete(self) -> None:
        self._keep_alive = self._parser.should_keep_alive()
        self._version = self._parser.get_http_version()
        expect = self._headers.get("expect")
        if expect is not None and expect.lower() == "100-continue" and self._transport:
            self._transport.write(_CONTINUE)

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        url = self._url
        q = url.find(b"?")
        if q >= 0:
            path = url[:q].decode("latin-1")
            query = url[q + 1 :].decode("latin-1")
        else:
            path = url.decode("latin-1")
            query = ""
        body = self._body
        req = Request(
            self._parser.get_method().decode("latin-1"),
            path,
            query,
            self._headers,
            body[0] if len(body) == 1 else b"".join(body),
            self._keep_alive,
            self._version,
        )
        self._enqueue(req)

    # -- request processing -----------------------------------------------------------------

    def _fail_parse(self) -> None:
        self._parse_failed = True
        if self._transport is not None:
            self._transport.pause_reading()
        self._enqueue(None)

    def _enqueue(self, req: Request | None) -> None:
        self._queue.append(req)
        if self._task is None:
            self._task = self._loop.create_task(self._run())
        if (
            len(self._queue) > _QUEUE_HIGH
            and not self._reading_paused
            and self._transport is not None
        ):
            self._reading_paused = True
            self._transport.pause_reading()

    async def _run(self) -> None:
        """Serve queued requests strictly in order, which is what makes pipelining safe."""
        try:
            queue = self._queue
            while queue and not self._closed:
                req = queue.popleft()
                if self._reading_paused and len(queue) <= _QUEUE_LOW and not self._parse_failed:
                    self._reading_paused = False
                    if self._transport is not None:
                        self._transport.resume_reading()
                if req is None:
                    self._write_simple(400, b"malformed HTTP request\n", close=True)
                    return
                if not await self._respond(req):
                    self._close()
                    return
            if self._eof:
                self._close()
        finally:
            self._task = None

    async def _respond(self, req: Request) -> bool:
        """Run the handler and write its answer; returns whether to keep the connection."""
        try:
            resp = await self._handler(req)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("handler failed for %r", req)
            resp = Response(b"internal server error\n", 500, content_type="text/plain")
        if self._closed:
            if isinstance(resp, StreamResponse):
                await _aclose(resp.body_iter)
            return False
        if isinstance(resp, StreamResponse):
            return await self._write_stream(req, resp)
        self._write_response(req, resp)
        return req.keep_alive

    def _write_response(self, req: Request, resp: Response) -> None:
        body = resp.body
        head = b"%bcontent-type: %b\r\ncontent-length: %d\r\n%b%b\r\n" % (
            _status_line(resp.status),
            resp.content_type.encode("latin-1"),
            len(body),
            _encode_headers(resp.headers),
            b"" if req.keep_alive else b"connection: close\r\n",
        )
        assert self._transport is not None
        if req.method == "HEAD":
            self._transport.write(head)
        else:
            self._transport.write(head + body)

    async def _write_stream(self, req: Request, resp: StreamResponse) -> bool:
        transport = self._transport
        assert transport is not None
        # HTTP/1.0 has no chunked encoding: stream raw bytes and delimit by closing.
        chunked = req.http_version != "1.0"
        keep_alive = req.keep_alive and chunked
        head = b"%bcontent-type: %b\r\ncache-control: no-cache\r\n%b%b%b\r\n" % (
            _status_line(resp.status),
            resp.content_type.encode("latin-1"),
            b"transfer-encoding: chunked\r\n" if chunked else b"",
            _encode_headers(resp.headers),
            b"" if keep_alive else b"connection: close\r\n",
        )
        transport.write(head)
        gen = resp.body_iter
        try:
            async for chunk in gen:
                if self._closed:
                    return False
                if chunk:
                    if chunked:
                        transport.write(b"%x\r\n%b\r\n" % (len(chunk), chunk))
                    else:
                        transport.write(chunk)
                if self._write_paused:
                    await self._drain()
        except asyncio.CancelledError:
            raise
        except Exception:
            # Headers are gone already; the only honest signal left is an unterminated body.
            log.warning("stream generator failed for %r; closing connection", req, exc_info=True)
            self._close()
            return False
        finally:
            await _aclose(gen)
        if self._closed:
            return False
        if chunked:
            transport.write(_LAST_CHUNK)
        return keep_alive

    def _write_simple(self, status: int, body: bytes, close: bool) -> None:
        if self._transport is None or self._closed:
            return
        self._transport.write(
            b"%bcontent-type: text/plain\r\ncontent-length: %d\r\n%b\r\n%b"
            % (_status_line(status), len(body), b"connection: close\r\n" if close else b"", body)
        )
        if close:
            self._close()

    async def _drain(self) -> None:
        if not self._write_paused or self._closed:
            return
        waiter = self._loop.create_future()
        self._drain_waiter = waiter
        await waiter

    def _wake_drain(self) -> None:
        waiter = self._drain_waiter
        self._drain_waiter = None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _close(self) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.close()

    def close(self) -> None:
        """Close the connection from the server side (used by :func:`shutdown`)."""
        self._close()


async def _aclose(it: AsyncIterator[bytes]) -> None:
    aclose = getattr(it, "aclose", None)
    if aclose is not None:
        try:
            await aclose()
        except Exception:
            log.debug("error while closing stream iterator", exc_info=True)


# Server object -> its live connections. uvloop's Server cannot carry attributes, so the
# registry lives here; shutdown() needs it because Server.close() leaves keep-alive
# connections open.
_LIVE: dict[int, set[_HttpProtocol]] = {}


async def serve(
    handler: Handler, host: str = "127.0.0.1", port: int = 0, *, backlog: int = 2048
) -> asyncio.AbstractServer:
    """Start listening; with ``port=0`` the OS picks a port, read it via :func:`bound_port`."""
    loop = asyncio.get_running_loop()
    connections: set[_HttpProtocol] = set()
    server = await loop.create_server(
        lambda: _HttpProtocol(handler, connections),
        host,
        port,
        backlog=backlog,
        reuse_address=True,
    )
    _LIVE[id(server)] = connections
    return server


def bound_port(server: asyncio.AbstractServer) -> int:
    """The port actually bound, which matters when :func:`serve` was given ``port=0``."""
    sockets = getattr(server, "sockets", None) or ()
    for sock in sockets:
        return int(sock.getsockname()[1])
    raise RuntimeError("server has no listening socket")


async def shutdown(server: asyncio.AbstractServer, grace: float = 2.0) -> None:
    """Stop accepting, drop open connections (cancelling in-flight handlers) and wait."""
    server.close()
    for conn in list(_LIVE.pop(id(server), ())):
        conn.close()
    try:
        await asyncio.wait_for(server.wait_closed(), grace)
    except TimeoutError:
        log.warning("server did not close within %.1fs", grace)
