"""The opener seam: how a consumer gets the raw SSE bytes of one connection.

``StreamOpener(last_event_id) -> AsyncIterator[bytes]`` yields the raw SSE bytes of one
connection; it ends (or raises) when the connection does. The built-in openers
(``router.ingest.transports``) are SSE over HTTP(S) and SSE bytes carried in WebSocket
messages; the event bus passes its own (``StreamData`` bytes are exactly what GET
/events/{backend} sends). An opener may yield ``b""`` to say "open, nothing to read yet",
so ``connected`` turns true before the first record (the HTTP opener does so right after
the 200 headers).

The consumer holds each opened stream in :func:`closing_stream`: an error that ends the
connection on the consumer's side is thrown into an async-generator opener first, so an
opener with a peer of its own can tell that peer why the stream ends.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable

__all__ = ["SSE_CONTENT_TYPE", "StreamOpener", "closing_stream", "header_safe", "sse_headers"]

# The consumer's logger since before ingestion had a package of its own; kept for log configs.
log = logging.getLogger("continuum.kvindex.consumer")

StreamOpener = Callable[[str | None], AsyncIterator[bytes]]
"""Opens one stream given the last applied event ID; yields raw SSE bytes until it ends."""

SSE_CONTENT_TYPE = "text/event-stream"


def header_safe(event_id: str | None) -> str | None:
    """The id if it can go in an HTTP header, else None (the listener then resyncs)."""
    if event_id and event_id.isascii() and event_id.isprintable():
        return event_id
    return None


def sse_headers(backend: str, last_event_id: str | None) -> dict[str, str]:
    """Request headers of an SSE connection resuming after ``last_event_id``.

    An id that cannot be sent is left out, with a warning naming ``backend``: the
    listener then starts with ``resync`` + snapshot.
    """
    headers = {"Accept": SSE_CONTENT_TYPE, "Cache-Control": "no-cache"}
    safe = header_safe(last_event_id)
    if safe is not None:
        headers["Last-Event-ID"] = safe
    elif last_event_id:
        log.warning(
            "event source %s: last event id %r cannot be sent; resuming with a resync",
            backend,
            last_event_id,
        )
    return headers


@contextlib.asynccontextmanager
async def closing_stream(stream: AsyncIterator[bytes]) -> AsyncIterator[AsyncIterator[bytes]]:
    """Like ``contextlib.aclosing`` but also for iterators without ``aclose``.

    An error that ends the connection on the consumer's side (an oversized record, a
    failed apply) is thrown into an async-generator opener at its ``yield`` first, so an
    opener with a peer of its own (the event bus) can tell that peer why the stream ends.
    """
    try:
        yield stream
    except Exception as exc:
        athrow = getattr(stream, "athrow", None)
        if athrow is not None:
            with contextlib.suppress(Exception, StopAsyncIteration):
                await athrow(exc)
        raise
    finally:
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            await aclose()
