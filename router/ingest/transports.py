"""The built-in openers of ``transport: sse`` sources: SSE over HTTP(S), SSE in WebSocket.

Both send ``Last-Event-ID: <last applied id>`` when one is known (``opener.sse_headers``)
and yield ``b""`` as soon as the stream is open, then the bytes as they arrive.

HTTP (``http://``/``https://`` endpoints): ``GET`` the endpoint; anything but a 200 with
``Content-Type: text/event-stream`` is :class:`StreamRejected`. ``read_timeout`` is the
socket read timeout of the body, so a stream without a byte (not even the listener's
heartbeat) for that long counts as dead.

WebSocket framing (``ws://``/``wss://`` endpoints): the listener is assumed to send the
same SSE bytes it would send on GET /events/{backend}, split into messages arbitrarily
(a message need not hold whole lines or records; text messages are UTF-8 encoded back to
bytes, binary ones are taken as is); ``Last-Event-ID`` goes in the handshake headers. The
message boundaries carry no meaning; the same parser and the same caps apply.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp

from ..config.models import EventSourceConfig
from .errors import ConsumerError, StreamRejected
from .opener import SSE_CONTENT_TYPE, StreamOpener, sse_headers

__all__ = ["builtin_opener", "http_opener", "websocket_opener"]


def builtin_opener(
    source: EventSourceConfig,
    session: aiohttp.ClientSession | None,
    *,
    connect_timeout: float,
    read_timeout: float | None,
) -> StreamOpener:
    """The opener of ``source``'s endpoint: WebSocket for ``ws(s)://``, else HTTP.

    Raises:
        ValueError: no built-in opener fits (``event_bus``, which needs the event bus's
            opener; an ``sse`` source without an endpoint or without a session).
    """
    backend = source.backend_name
    if source.transport == "event_bus":
        raise ValueError(f"event source {backend}: transport event_bus requires a stream_opener")
    if source.endpoint is None:
        raise ValueError(f"event source {backend}: transport sse requires endpoint")
    if session is None:
        raise ValueError(f"event source {backend}: an HTTP session is required")
    if source.endpoint.startswith(("ws://", "wss://")):
        return websocket_opener(session, source.endpoint, backend, read_timeout=read_timeout)
    return http_opener(
        session,
        source.endpoint,
        backend,
        connect_timeout=connect_timeout,
        read_timeout=read_timeout,
    )


def http_opener(
    session: aiohttp.ClientSession,
    endpoint: str,
    backend: str,
    *,
    connect_timeout: float,
    read_timeout: float | None,
) -> StreamOpener:
    """SSE over HTTP(S): GET ``endpoint``, yield the body as it arrives."""

    async def open_http(last_event_id: str | None) -> AsyncIterator[bytes]:
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=connect_timeout, sock_read=read_timeout
        )
        async with session.get(
            endpoint, headers=sse_headers(backend, last_event_id), timeout=timeout
        ) as resp:
            if resp.status != 200:
                body = await resp.content.read(256)
                raise StreamRejected(
                    f"HTTP {resp.status} from {endpoint}: {body.decode('utf-8', 'replace')!r}",
                    resp.status,
                )
            ctype = resp.headers.get("Content-Type", "")
            if not ctype.lower().startswith(SSE_CONTENT_TYPE):
                raise StreamRejected(
                    f"{endpoint} answered {ctype or 'no content type'!r}, not {SSE_CONTENT_TYPE}",
                    resp.status,
                )
            yield b""
            async for chunk in resp.content.iter_any():
                yield chunk

    return open_http


def websocket_opener(
    session: aiohttp.ClientSession,
    endpoint: str,
    backend: str,
    *,
    read_timeout: float | None,
) -> StreamOpener:
    """SSE bytes carried in WebSocket messages (framing: module docstring)."""

    async def open_websocket(last_event_id: str | None) -> AsyncIterator[bytes]:
        async with session.ws_connect(
            endpoint,
            headers=sse_headers(backend, last_event_id),
            timeout=aiohttp.ClientWSTimeout(ws_receive=read_timeout, ws_close=5.0),
        ) as ws:
            yield b""
            while True:
                msg = await ws.receive()
                if msg.type == aiohttp.WSMsgType.TEXT:
                    yield msg.data.encode()
                elif msg.type == aiohttp.WSMsgType.BINARY:
                    yield msg.data
                elif msg.type == aiohttp.WSMsgType.ERROR:
                    err = ws.exception()
                    raise err if err is not None else ConsumerError("websocket error")
                elif msg.type in (
                    aiohttp.WSMsgType.CLOSE,
                    aiohttp.WSMsgType.CLOSING,
                    aiohttp.WSMsgType.CLOSED,
                ):
                    return
                # PING/PONG are answered by aiohttp (autoping)

    return open_websocket
