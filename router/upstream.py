"""The HTTP client the router uses towards backends, and its error taxonomy.

The proxy decides what to do by error class, not by library exception:
``UpstreamConnectError`` is safe to retry on another backend (nothing reached the
engine), ``UpstreamTimeout`` becomes 504 and ``UpstreamProtocolError`` 502.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp

__all__ = [
    "UpstreamClient",
    "UpstreamConnectError",
    "UpstreamError",
    "UpstreamProtocolError",
    "UpstreamResponse",
    "UpstreamTimeout",
]


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

    def __init__(self, backend: str, resp: aiohttp.ClientResponse) -> None:
        self.backend = backend
        self._resp = resp
        self.status = resp.status
        self.headers = resp.headers

    @property
    def content_type(self) -> str:
        return self._resp.headers.get("Content-Type", "")

    async def read(self) -> bytes:
        try:
            return await self._resp.read()
        except TimeoutError:
            raise UpstreamTimeout(self.backend, "timed out reading the response") from None
        except aiohttp.ClientError as exc:
            raise UpstreamProtocolError(self.backend, f"response broke off: {exc}") from None
        finally:
            self._resp.release()

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._resp.content.iter_any():
                yield chunk
        except TimeoutError:
            raise UpstreamTimeout(self.backend, "stream stalled past the timeout") from None
        except aiohttp.ClientError as exc:
            raise UpstreamProtocolError(self.backend, f"stream broke off: {exc}") from None

    def close(self) -> None:
        """Drop the connection: for an unfinished stream this aborts the engine's work."""
        self._resp.close()

    def release(self) -> None:
        self._resp.release()


class UpstreamClient:
    """One pooled keep-alive client for all backends."""

    def __init__(self, connect_timeout_s: float, read_timeout_s: float) -> None:
        self._timeout = aiohttp.ClientTimeout(
            total=None, connect=None, sock_connect=connect_timeout_s, sock_read=read_timeout_s
        )
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(
            limit=0, limit_per_host=0, keepalive_timeout=30, ttl_dns_cache=60
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=self._timeout,
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Content-Type"),
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def request(
        self,
        backend: str,
        method: str,
        url: str,
        headers: Mapping[str, str],
        body: bytes | None = None,
        client_timeout: aiohttp.ClientTimeout | None = None,
    ) -> UpstreamResponse:
        """Send a request and return once the status line and headers arrived."""
        assert self._session is not None, "UpstreamClient.start() was not awaited"
        kwargs: dict[str, Any] = {"headers": headers, "data": body}
        if client_timeout is not None:
            kwargs["timeout"] = client_timeout
        try:
            resp = await self._session.request(method, url, **kwargs)
        except aiohttp.ClientConnectorError as exc:
            raise UpstreamConnectError(backend, f"cannot connect: {exc.os_error}") from None
        except aiohttp.ServerDisconnectedError:
            # A pooled keep-alive connection the backend had closed: nothing was read.
            raise UpstreamConnectError(backend, "connection closed by the backend") from None
        except (TimeoutError, aiohttp.ServerTimeoutError):
            raise UpstreamTimeout(backend, "no response within the timeout") from None
        except aiohttp.ClientResponseError as exc:
            raise UpstreamProtocolError(backend, f"invalid response: {exc.message}") from None
        except aiohttp.ClientError as exc:
            raise UpstreamProtocolError(backend, f"request failed: {exc}") from None
        except asyncio.CancelledError:
            raise
        return UpstreamResponse(backend, resp)

    def probe_timeout(self, seconds: float) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=seconds)
