"""The HTTP client the router uses towards backends, and its error taxonomy.

The proxy decides what to do by error class, not by library exception:
``UpstreamConnectError`` is safe to retry on another backend (nothing reached the
engine), ``UpstreamTimeout`` becomes 504 and ``UpstreamProtocolError`` 502.

The transport underneath is :mod:`router.http.client`, a small HTTP/1.1 client on an asyncio
``Protocol`` and httptools: the upstream hop runs on every proxied request, and aiohttp's
client machinery cost more CPU per request than routing did. This module only adds the
backend's name to its errors and keeps the interface the proxy and the health checker use.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping

from .http.client import (
    ConnectError,
    Headers,
    HttpClient,
    HttpError,
    HttpResponse,
    HttpTimeout,
    ProtocolError,
)

__all__ = [
    "UpstreamClient",
    "UpstreamConnectError",
    "UpstreamError",
    "UpstreamProtocolError",
    "UpstreamResponse",
    "UpstreamTimeout",
]

_IDLE_TIMEOUT_S = 30.0
"""Idle keep-alive connections are dropped after this long (servers drop theirs too)."""


class UpstreamError(Exception):
    """Root of upstream failures; ``backend`` names the backend for the client's error."""

    def __init__(self, backend: str, detail: str) -> None:
        self.backend = backend
        self.detail = detail
        super().__init__(f"{backend}: {detail}")


class UpstreamConnectError(UpstreamError):
    """The request never reached the backend: retrying elsewhere is safe."""


class UpstreamTimeout(UpstreamError):
    """The backend did not answer (or stream) within the request timeout."""


class UpstreamProtocolError(UpstreamError):
    """The backend answered something that is not a valid response."""


class UpstreamResponse:
    """An open upstream response; release it with ``close`` (or read it whole)."""

    __slots__ = ("_resp", "backend", "headers", "status")

    def __init__(self, backend: str, resp: HttpResponse) -> None:
        self.backend = backend
        self._resp = resp
        self.status = resp.status
        self.headers: Headers = resp.headers
        """Case-insensitive, read-only by convention."""

    @property
    def content_type(self) -> str:
        return dict.get(self.headers, "content-type", "")

    async def read(self) -> bytes:
        """The whole body; the connection is reused (or closed, on any failure)."""
        try:
            return await self._resp.read()
        except HttpTimeout:
            raise UpstreamTimeout(self.backend, "timed out reading the response") from None
        except HttpError as exc:
            raise UpstreamProtocolError(self.backend, f"response broke off: {exc}") from None

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        """Body bytes as they arrive (everything buffered since the last chunk, joined)."""
        next_chunk = self._resp.next_chunk
        try:
            while True:
                chunk = await next_chunk()
                if not chunk:
                    return
                yield chunk
        except HttpTimeout:
            raise UpstreamTimeout(self.backend, "stream stalled past the timeout") from None
        except HttpError as exc:
            raise UpstreamProtocolError(self.backend, f"stream broke off: {exc}") from None

    def close(self) -> None:
        """Drop the connection: for an unfinished stream this aborts the engine's work."""
        self._resp.close()

    def release(self) -> None:
        """Give the connection back: a no-op once the body was read to its end."""
        self._resp.release()


class UpstreamClient:
    """One pooled keep-alive client for all backends."""

    def __init__(self, connect_timeout_s: float, read_timeout_s: float) -> None:
        self._connect_timeout = connect_timeout_s
        self._read_timeout = read_timeout_s
        self._client: HttpClient | None = None

    async def start(self) -> None:
        self._client = HttpClient(
            connect_timeout=self._connect_timeout,
            read_timeout=self._read_timeout,
            idle_timeout=_IDLE_TIMEOUT_S,
        )

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def request(
        self,
        backend: str,
        method: str,
        url: str,
        headers: Mapping[str, str],
        body: bytes | None = None,
        client_timeout: float | None = None,
    ) -> UpstreamResponse:
        """Send a request and return once the status line and headers arrived.

        ``client_timeout`` is a total deadline in seconds (connect + head + body: health
        probes); without it the client's connect and read timeouts apply.
        """
        client = self._client
        if client is None:  # closed at shutdown, after the grace for requests in flight
            raise UpstreamConnectError(backend, "the router is shutting down")
        try:
            resp = await client.request(method, url, headers, body, client_timeout)
        except ConnectError as exc:
            raise UpstreamConnectError(backend, str(exc)) from None
        except HttpTimeout:
            raise UpstreamTimeout(backend, "no response within the timeout") from None
        except ProtocolError as exc:
            raise UpstreamProtocolError(backend, f"invalid response: {exc}") from None
        except HttpError as exc:
            raise UpstreamProtocolError(backend, f"request failed: {exc}") from None
        return UpstreamResponse(backend, resp)
