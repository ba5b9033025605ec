"""A lean HTTP/1.1 client for the router's upstream hop: an asyncio ``Protocol`` + httptools.

Why not aiohttp's client: under load the router spent most of its CPU in the proxy hop, and
aiohttp's ``ClientSession`` carries machinery the router never uses on that hop (tracing
signals, cookie jar, redirects, timer context managers per request, ``StreamReader``,
multidict headers, decompression plumbing). The router talks to a handful of known backends
with a small subset of HTTP/1.1, so this module does exactly that, with the fewest Python-level
steps per request:

* per-origin (scheme, host, port) keep-alive pools with LIFO reuse (the most recently used
  connection is the one least likely to have been closed by the server); idle connections are
  dropped after ``idle_timeout`` seconds; no connection limit, but an idle one is always reused
  before a new one is opened;
* ``http://`` and ``https://`` (``loop.create_connection(ssl=...)``, default verifying context,
  TLS 1.2 at least even for a context handed in: ``router.http.tls``);
* a request is one ``transport.write``: request line, headers and body together;
* responses are parsed by httptools (llhttp) in the transport's callback: Content-Length,
  chunked (the decoded body is delivered) and read-until-close bodies; no decompression (the
  router asks for ``identity``);
* the body is handed over as it arrives, with flow control: reading pauses while more than
  ``_HIGH_WATER`` bytes wait for a lagging consumer and resumes when it catches up;
* timeouts: connect; a read timeout armed only while actually waiting (for the head, then
  between body chunks); an optional total deadline (health probes);
* a connection goes back to its pool only after a complete response. Abandoning a response
  mid-body closes its connection, which is how an engine learns that the client went away
  and stops generating;
* a reused connection that the server had closed while idle (EOF or reset before any byte of
  the response) is retried once, transparently, on a fresh connection: the server closed
  without reading the request. Anywhere else that failure is a :class:`ConnectError`.

Errors are one class per meaning, which ``router.upstream`` maps to its own taxonomy:
:class:`ConnectError` (nothing was answered: connection refused, unreachable, TLS failure,
closed before a single response byte), :class:`HttpTimeout` and :class:`ProtocolError` (the
answer was not valid HTTP, or broke off).

Size: one module (about 700 lines) on purpose: the connection pool, the protocol callbacks
and the response body states share per-request state on the hot path, where an extra layer
costs CPU on every proxied request.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from collections.abc import Mapping
from typing import Any

import httptools

from .tls import client_context, enforce_minimum

__all__ = [
    "ConnectError",
    "Headers",
    "HttpClient",
    "HttpError",
    "HttpResponse",
    "HttpTimeout",
    "InvalidURL",
    "ProtocolError",
]

_HIGH_WATER = 256 * 1024
"""Bytes buffered for a consumer that lags before reading from the socket pauses."""

_SKIP = frozenset(
    ("host", "content-length", "transfer-encoding", "connection", "keep-alive", "upgrade")
)
"""Request headers the client owns (framing and connection management): callers' are dropped."""

_TICK = 0.05
"""Resolution of read timeouts and deadlines, in seconds (they fire up to this late)."""

_BODY_METHODS = frozenset(("POST", "PUT", "PATCH"))
_URL_CACHE_MAX = 4096


class HttpError(Exception):
    """Root of this client's errors."""


class ConnectError(HttpError):
    """No response at all: cannot connect, or the connection closed before any response byte."""


class InvalidURL(ConnectError, ValueError):
    """The URL is not ``http(s)://host[:port][/path]``: nothing was sent."""


class HttpTimeout(HttpError):
    """Connect-to-headers or between-chunks read timeout, or the total deadline, expired."""


class ProtocolError(HttpError):
    """The server's answer is not valid HTTP/1.x, or it broke off before its end."""


class InvalidRequest(HttpError, ValueError):
    """A header name or value would break the request framing (CR/LF): nothing was sent."""


class _NoResponse(ConnectError):
    """EOF/reset before any response byte; retried once when the connection was reused."""


class Headers(dict[str, str]):
    """Response headers: keys stored lower-case, lookups case-insensitive.

    Repeated fields are joined with ``", "`` (RFC 9110 5.3), enough for what a router reads.
    """

    __slots__ = ()

    def __getitem__(self, key: str) -> str:
        return dict.__getitem__(self, key.lower())

    def get(self, key: str, default: Any = None) -> Any:
        return dict.get(self, key.lower(), default)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and dict.__contains__(self, key.lower())


class _Origin:
    """One (scheme, host, port): how to connect, and the idle connections, most recent last."""

    __slots__ = ("host", "idle", "port", "ssl")

    def __init__(self, host: str, port: int, ssl_ctx: ssl.SSLContext | None) -> None:
        self.host = host
        self.port = port
        self.ssl = ssl_ctx
        self.idle: list[_Conn] = []


class HttpResponse:
    """A response whose head has arrived; its body arrives through ``read``/``next_chunk``.

    Release it by reading it to the end (the connection goes back to the pool as soon as the
    last byte is parsed) or with ``close``/``release`` (an unfinished body closes the
    connection).
    """

    __slots__ = (
        "_buffered",
        "_chunks",
        "_client",
        "_conn",
        "_deadline",
        "_done",
        "_exc",
        "_expires",
        "_got_bytes",
        "_head",
        "_until_eof",
        "_waiter",
        "_whole",
        "headers",
        "status",
    )

    def __init__(self, client: HttpClient, deadline: float | None, head: bool) -> None:
        self.status = 0
        self.headers: Headers = _EMPTY_HEADERS
        self._client = client
        self._deadline = deadline
        self._expires = 0.0
        self._head = head
        self._conn: _Conn | None = None
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._done = False
        self._exc: HttpError | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._got_bytes = False
        self._until_eof = False
        self._whole = False

    @property
    def complete(self) -> bool:
        """The whole body has arrived (it may still wait in the buffer)."""
        return self._done

    async def read(self) -> bytes:
        """The whole body; the connection is back in its pool when this returns."""
        self._whole = True
        conn = self._conn
        if conn is not None and conn.paused:
            conn.resume()
        while not self._done:
            if self._exc is not None:
                raise self._exc
            await self._wait()
        chunks = self._chunks
        self._chunks = []
        self._buffered = 0
        if len(chunks) == 1:
            return chunks[0]
        return b"".join(chunks)

    async def next_chunk(self) -> bytes:
        """All body bytes that arrived since the last call (waiting for some); ``b""`` at end."""
        while True:
            chunks = self._chunks
            if chunks:
                self._chunks = []
                self._buffered = 0
                conn = self._conn
                if conn is not None and conn.paused:
                    conn.resume()
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)
            if self._done:
                return b""
            if self._exc is not None:
                raise self._exc
            await self._wait()

    def close(self) -> None:
        """Abandon the response: an unfinished body closes the connection."""
        conn = self._conn
        if conn is not None:
            self._conn = None
            conn.resp = None
            conn.close()
        if not self._done and self._exc is None:
            self._exc = ProtocolError("response closed before its end")
        self._wake()

    release = close
    """Same as ``close``: a finished response has already given its connection back."""

    # -- waiting ---------------------------------------------------------------------------

    def _wake(self) -> None:
        w = self._waiter
        if w is not None:
            self._waiter = None
            if not w.done():
                w.set_result(None)

    def _on_timeout(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            self._waiter = None
            what = "reading the response body" if self.status else "waiting for the response"
            w.set_exception(HttpTimeout(f"timed out {what}"))

    async def _wait(self) -> None:
        """Until the connection delivers something, under the read timeout/deadline.

        The timeout is not a timer per wait (``call_later`` + ``cancel`` cost ~2.5 us on
        uvloop, paid once or twice per request): the waiting response joins the client's
        ``_waiting`` set, which one coarse ticker scans (see ``HttpClient._tick``).
        """
        client = self._client
        loop = client._loop
        timeout = client.read_timeout
        deadline = self._deadline
        if deadline is None:
            expires = None if timeout is None else loop.time() + timeout
        else:
            expires = deadline if timeout is None else min(deadline, loop.time() + timeout)
        fut = loop.create_future()
        self._waiter = fut
        if expires is not None:
            self._expires = expires
            client._waiting.add(self)
            if client._ticker is None:
                client._start_ticker()
        try:
            await fut
        except BaseException:
            # Timed out or cancelled (the caller went away): the response is abandoned.
            self._waiter = None
            self.close()
            raise
        finally:
            client._waiting.discard(self)


_EMPTY_HEADERS = Headers()


class _Conn(asyncio.Protocol):
    """One TCP (or TLS) connection; parser callbacks feed the current ``HttpResponse``."""

    __slots__ = (
        "_hdrs",
        "_interim",
        "client",
        "closed",
        "idle_since",
        "in_pool",
        "keep_alive",
        "origin",
        "parser",
        "paused",
        "resp",
        "transport",
    )

    def __init__(self, client: HttpClient, origin: _Origin) -> None:
        self.client = client
        self.origin = origin
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.resp: HttpResponse | None = None
        self.closed = False
        self.in_pool = False
        self.paused = False
        self.keep_alive = False
        self.idle_since = 0.0
        self._interim = False
        self._hdrs: dict[str, str] = {}

    # -- asyncio.Protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError, AttributeError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.client._conns.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.client._conns.discard(self)
        if self.in_pool:
            self.in_pool = False
            with contextlib.suppress(ValueError):
                self.origin.idle.remove(self)
        resp = self.resp
        if resp is None:
            return
        self.resp = None
        resp._conn = None
        if resp.status and resp._until_eof and not self._interim:
            resp._done = True  # a body delimited by the end of the connection
        elif not resp._got_bytes:
            resp._exc = _NoResponse("connection closed by the server before responding")
        elif not resp.status:
            resp._exc = ProtocolError("connection closed in the middle of the response head")
        else:
            why = f" ({exc})" if exc is not None else ""
            resp._exc = ProtocolError(f"connection closed before the end of the body{why}")
        resp._wake()

    def data_received(self, data: bytes) -> None:
        resp = self.resp
        if resp is None:
            self.close()  # bytes nobody asked for: this connection cannot be trusted
            return
        resp._got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(ProtocolError("unexpected protocol upgrade"))
        except httptools.HttpParserError as exc:
            self._fail(ProtocolError(f"invalid HTTP response: {exc}"))

    def eof_received(self) -> bool | None:
        return None  # close our side too; connection_lost settles the response

    # -- httptools callbacks ---------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.resp is None:
            self.close()  # a second response in the same read: nothing asked for it
        self._hdrs = {}

    def on_header(self, name: bytes, value: bytes) -> None:
        key = name.decode("latin-1").lower()
        h = self._hdrs
        prev = h.get(key)
        h[key] = value.decode("latin-1") if prev is None else f"{prev}, {value.decode('latin-1')}"

    def on_headers_complete(self) -> None:
        resp = self.resp
        if resp is None:
            return
        parser = self.parser
        status = parser.get_status_code()
        if status < 200:
            self._interim = True  # 1xx (103 Early Hints...): the real response follows
            return
        hdrs = self._hdrs
        resp.headers = Headers(hdrs)
        resp.status = status
        self.keep_alive = parser.should_keep_alive() and not resp._head
        if status != 204 and status != 304 and "content-length" not in hdrs:
            # No length and not chunked: llhttp reads the body until the connection closes.
            te = hdrs.get("transfer-encoding")
            resp._until_eof = te is None or not te.rstrip().lower().endswith("chunked")
        if resp._head:
            # llhttp does not know the request was HEAD and would wait for the body: the
            # response ends here and the connection is not reused.
            self._complete(resp)
            return
        resp._wake()

    def on_body(self, body: bytes) -> None:
        resp = self.resp
        if resp is None:
            return
        resp._chunks.append(body)
        n = resp._buffered + len(body)
        resp._buffered = n
        if n > _HIGH_WATER and not resp._whole and not self.paused and not self.closed:
            self.paused = True
            self.transport.pause_reading()  # type: ignore[union-attr]
        resp._wake()

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        resp = self.resp
        if resp is not None:
            self._complete(resp)

    # -- state -----------------------------------------------------------------------------

    def _complete(self, resp: HttpResponse) -> None:
        self.resp = None
        resp._conn = None
        resp._done = True
        if self.keep_alive and not self.closed:
            if self.paused:
                self.resume()
            self.idle_since = self.client._loop.time()
            self.in_pool = True
            self.origin.idle.append(self)
        else:
            self.close()
        resp._wake()

    def _fail(self, exc: HttpError) -> None:
        resp = self.resp
        self.close()
        if resp is not None:
            resp._conn = None
            resp._exc = exc
            resp._wake()

    def send(self, resp: HttpResponse, data: bytes) -> None:
        self.resp = resp
        resp._conn = self
        self.transport.write(data)  # type: ignore[union-attr]

    def resume(self) -> None:
        self.paused = False
        if not self.closed:
            self.transport.resume_reading()  # type: ignore[union-attr]

    def close(self) -> None:
        """Close without waiting; a response still attached is settled by connection_lost."""
        if self.closed:
            return
        self.closed = True
        if self.in_pool:
            self.in_pool = False
            with contextlib.suppress(ValueError):
                self.origin.idle.remove(self)
        if self.transport is not None:
            self.transport.close()


def _encode_head(
    method: str, target: str, host: str, headers: Mapping[str, str], body: bytes | None
) -> bytes:
    """Request line + headers (+ body): one buffer, so the request is one write."""
    lines = [f"{k}: {v}\r\n" for k, v in headers.items() if k.lower() not in _SKIP]
    if body is not None or method in _BODY_METHODS:
        head = (
            f"{method} {target} HTTP/1.1\r\nhost: {host}\r\n{''.join(lines)}"
            f"content-length: {len(body) if body is not None else 0}\r\n\r\n"
        )
        expected = len(lines) + 4
    else:
        head = f"{method} {target} HTTP/1.1\r\nhost: {host}\r\n{''.join(lines)}\r\n"
        expected = len(lines) + 3
    if head.count("\n") != expected:
        # One C-level scan instead of checking every value: some name or value holds a line
        # break and would smuggle headers (or a second request) into the stream.
        raise InvalidRequest("a header name or value contains a line break")
    try:
        raw = head.encode("latin-1")
    except UnicodeEncodeError:
        raw = head.encode("utf-8")  # what the client most likely sent us in the first place
    return raw + body if body else raw


def parse_url(url: str) -> tuple[str, str, int, str, str]:
    """``scheme://host[:port]/path?q`` -> (scheme, host, port, host header, request target)."""
    scheme, sep, rest = url.partition("://")
    scheme = scheme.lower()
    if not sep or scheme not in ("http", "https"):
        raise InvalidURL(f"unsupported URL {url!r} (http:// or https:// expected)")
    end = len(rest)
    for ch in "/?#":
        i = rest.find(ch)
        if 0 <= i < end:
            end = i
    authority, target = rest[:end], rest[end:]
    target = target.partition("#")[0]
    if not target or target[0] != "/":
        target = "/" + target
    authority = authority.rpartition("@")[2]
    default_port = 443 if scheme == "https" else 80
    try:
        if authority.startswith("["):
            close = authority.index("]")
            host = authority[1:close]
            tail = authority[close + 1 :]
            port = int(tail[1:]) if tail.startswith(":") else default_port
        else:
            host, colon, port_s = authority.partition(":")
            port = int(port_s) if colon else default_port
    except ValueError:
        raise InvalidURL(f"invalid host or port in {url!r}") from None
    if not host or not 0 < port < 65536:
        raise InvalidURL(f"invalid host or port in {url!r}")
    return scheme, host, port, authority, target


class HttpClient:
    """Keep-alive HTTP/1.1 client over per-origin connection pools; one per event loop."""

    def __init__(
        self,
        connect_timeout: float = 5.0,
        read_timeout: float | None = 60.0,
        idle_timeout: float = 30.0,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.idle_timeout = idle_timeout
        self._ssl = enforce_minimum(ssl_context) if ssl_context is not None else None
        self._loop = asyncio.get_running_loop()
        self._origins: dict[tuple[str, str, int], _Origin] = {}
        self._targets: dict[str, tuple[_Origin, str, str]] = {}
        self._conns: set[_Conn] = set()
        self._waiting: set[HttpResponse] = set()
        """Responses waiting for bytes under a timeout; ``_tick`` expires them."""
        self._ticker: asyncio.TimerHandle | None = None
        self._sweeper: asyncio.TimerHandle | None = self._loop.call_later(
            idle_timeout / 2, self._sweep
        )
        self.connections_opened = 0
        """Connections opened so far (tests and diagnostics: keep-alive reuse)."""

    # -- public ----------------------------------------------------------------------------

    async def request(
        self,
        method: str,
        url: str,
        headers: Mapping[str, str] | None = None,
        body: bytes | None = None,
        total_timeout: float | None = None,
    ) -> HttpResponse:
        """Send a request; return once the status line and headers have arrived.

        ``total_timeout`` is a deadline over connect, head and body (probes); the client's
        connect and read timeouts apply in any case.
        """
        deadline = None if total_timeout is None else self._loop.time() + total_timeout
        target = self._targets.get(url)
        if target is None:
            target = self._target(url)
        origin, path, host = target
        data = _encode_head(method, path, host, headers or {}, body)
        head = method == "HEAD"
        fresh = False
        while True:
            conn = None if fresh else self._idle(origin)
            reused = conn is not None
            if conn is None:
                conn = await self._connect(origin, deadline)
            resp = HttpResponse(self, deadline, head)
            conn.send(resp, data)
            try:
                while not resp.status:
                    if resp._exc is not None:
                        raise resp._exc
                    await resp._wait()
            except _NoResponse:
                if reused:
                    fresh = True  # the server had closed this idle connection: not our request
                    continue
                raise
            return resp

    async def close(self) -> None:
        """Close every connection, idle or busy (busy responses fail with ProtocolError)."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        if self._ticker is not None:
            self._ticker.cancel()
            self._ticker = None
        for conn in list(self._conns):
            conn.close()
        for origin in self._origins.values():
            origin.idle.clear()
        await asyncio.sleep(0)  # let the transports run connection_lost

    def idle_connections(self, url: str) -> int:
        """How many idle pooled connections the origin of ``url`` has (tests, diagnostics)."""
        return len(self._target(url)[0].idle)

    # -- internals -------------------------------------------------------------------------

    def _target(self, url: str) -> tuple[_Origin, str, str]:
        scheme, host, port, authority, path = parse_url(url)
        key = (scheme, host, port)
        origin = self._origins.get(key)
        if origin is None:
            ctx = None
            if scheme == "https":
                if self._ssl is None:
                    self._ssl = client_context(alpn=("http/1.1",))
                ctx = self._ssl
            origin = self._origins[key] = _Origin(host, port, ctx)
        if len(self._targets) >= _URL_CACHE_MAX:
            self._targets.clear()
        t = self._targets[url] = (origin, path, authority)
        return t

    def _idle(self, origin: _Origin) -> _Conn | None:
        idle = origin.idle
        if not idle:
            return None
        oldest = self._loop.time() - self.idle_timeout
        while idle:
            conn = idle.pop()
            conn.in_pool = False
            if conn.closed:
                continue
            if conn.idle_since < oldest or conn.transport.is_closing():  # type: ignore[union-attr]
                conn.close()
                continue
            return conn
        return None

    async def _connect(self, origin: _Origin, deadline: float | None) -> _Conn:
        loop = self._loop
        timeout = self.connect_timeout
        if deadline is not None:
            timeout = min(timeout, deadline - loop.time())
        where = f"{origin.host}:{origin.port}"
        try:
            async with asyncio.timeout(max(timeout, 0.0)):
                _, conn = await loop.create_connection(
                    lambda: _Conn(self, origin),
                    origin.host,
                    origin.port,
                    ssl=origin.ssl,
                    server_hostname=origin.host if origin.ssl is not None else None,
                )
        except TimeoutError:
            raise ConnectError(f"cannot connect to {where}: timed out") from None
        except OSError as exc:
            raise ConnectError(f"cannot connect to {where}: {exc}") from None
        self.connections_opened += 1
        return conn

    def _start_ticker(self) -> None:
        if self._ticker is None:
            self._ticker = self._loop.call_later(_TICK, self._tick)

    def _tick(self) -> None:
        """Expire the waits whose time is up; runs every ``_TICK`` s while anything waits.

        A timeout thus fires up to ``_TICK`` late, never early.
        """
        self._ticker = None
        waiting = self._waiting
        if not waiting:
            return
        now = self._loop.time()
        for resp in [r for r in waiting if r._expires <= now]:
            waiting.discard(resp)
            resp._on_timeout()
        if waiting:
            self._ticker = self._loop.call_later(_TICK, self._tick)

    def _sweep(self) -> None:
        """Close connections idle for longer than ``idle_timeout`` (oldest are first)."""
        oldest = self._loop.time() - self.idle_timeout
        for origin in self._origins.values():
            idle = origin.idle
            while idle and idle[0].idle_since < oldest:
                conn = idle.pop(0)
                conn.in_pool = False
                conn.close()
        self._sweeper = self._loop.call_later(self.idle_timeout / 2, self._sweep)
