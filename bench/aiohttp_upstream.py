"""An aiohttp implementation of the router's upstream client, for ``proxy_bench`` only.

The router talks to its backends through ``router.upstream.UpstreamClient``, a thin facade
over ``router.http.client`` (a keep-alive HTTP/1.1 client on an asyncio ``Protocol`` and
httptools), written because aiohttp's client machinery cost more CPU per proxied request
than the routing did. To keep that a figure measured in the same run rather than one from
another day, ``proxy_bench`` also runs the full router with this class in its place
(``bench.aiohttp_router``): the same interface (``start``, ``close``, ``request`` ->
response with ``status``, ``headers``, ``content_type``, ``read``, ``iter_chunks``,
``release``, ``close``) and the same error taxonomy
(``UpstreamConnectError`` when nothing reached the backend, ``UpstreamTimeout``,
``UpstreamProtocolError``), on one pooled ``aiohttp.ClientSession`` configured as the
router's aiohttp client was before the hand-written one replaced it: no connection
limit, 30 s keep-alive, no decompression, no default User-Agent or Content-Type.

Not product code: nothing under ``router/`` imports it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp

from router.upstream import (
    UpstreamConnectError,
    UpstreamProtocolError,
    UpstreamTimeout,
)

__all__ = ["AiohttpUpstreamClient", "AiohttpUpstreamResponse"]

_IDLE_TIMEOUT_S = 30.0


class AiohttpUpstreamResponse:
    """An open upstream response; release it with ``close`` (or read it whole)."""

    __slots__ = ("_resp", "backend", "headers", "status")

    def __init__(self, backend: str, resp: aiohttp.ClientResponse) -> None:
        self.backend = backend
        self._resp = resp
        self.status = resp.status
        self.headers = resp.headers  # case-insensitive, like the router's Headers

    @property
    def content_type(self) -> str:
        return self._resp.headers.get("Content-Type", "")

    async def read(self) -> bytes:
        """The whole body; the connection goes back to the pool."""
        try:
            return await self._resp.read()
        except TimeoutError:
            raise UpstreamTimeout(self.backend, "timed out reading the response") from None
        except aiohttp.ClientError as exc:
            raise UpstreamProtocolError(self.backend, f"response broke off: {exc}") from None
        finally:
            self._resp.release()

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        """Body bytes as they arrive."""
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
        """Give the connection back."""
        self._resp.release()


class AiohttpUpstreamClient:
    """One pooled keep-alive ``aiohttp.ClientSession`` for all backends."""

    def __init__(self, connect_timeout_s: float, read_timeout_s: float) -> None:
        self._timeout = aiohttp.ClientTimeout(
            total=None, connect=None, sock_connect=connect_timeout_s, sock_read=read_timeout_s
        )
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(
            limit=0, limit_per_host=0, keepalive_timeout=_IDLE_TIMEOUT_S, ttl_dns_cache=60
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
        client_timeout: float | None = None,
    ) -> AiohttpUpstreamResponse:
        """Send a request and return once the status line and headers arrived;
        ``client_timeout`` is a total deadline in seconds."""
        session = self._session
        if session is None:  # closed at shutdown, as the router's own client refuses
            raise UpstreamConnectError(backend, "the router is shutting down")
        kwargs: dict[str, Any] = {"headers": headers, "data": body}
        if client_timeout is not None:
            kwargs["timeout"] = aiohttp.ClientTimeout(total=client_timeout)
        try:
            resp = await session.request(method, url, **kwargs)
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
        return AiohttpUpstreamResponse(backend, resp)
