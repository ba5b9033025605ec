"""KV event consumers: one supervised stream per event source, applied to the KV index in order.

The listener serves each backend's events as SSE (``GET /events/{backend}``, DESIGN.md §3).
One :class:`KvEventConsumer` per configured event source reads that stream and hands every
event to an injected ``apply`` callable (in production ``apply_event`` bound to the index);
:class:`KvEventConsumerManager` runs one consumer task per source.

Layers, so that push mode (``transport: event_bus``) plugs in without touching parsing:

* **opener** — ``StreamOpener(last_event_id) -> AsyncIterator[bytes]`` yields the raw SSE
  bytes of one connection; it ends (or raises) when the connection does. The built-in
  openers are SSE over HTTP(S) and SSE bytes carried in WebSocket messages; the event bus
  passes its own (``StreamData`` bytes are exactly what GET /events/{backend} sends). An
  opener may yield ``b""`` to say "open, nothing to read yet", so ``connected`` turns true
  before the first record (the HTTP opener does so right after the 200 headers).
* **connection** — :meth:`KvEventConsumer._run_once` holds one opened stream in
  ``async with``, feeds chunks to a fresh :class:`bus.sse.SseParser` and handles records
  one at a time; it returns or raises when the stream is over.
* **supervisor** — :meth:`KvEventConsumer.run` loops over connections with an injected
  :class:`bus.backoff.Backoff` between them. ``asyncio.CancelledError`` always propagates.

Per record:

* ``event: error`` (the listener's ``{"error":"buffer_overflow",...}`` on a slow consumer)
  drops the stream; the next connection resumes from the last event ID.
* Otherwise ``KvEvent.from_json(data, event_field=<event:>, backend=<this source>)``: the
  SSE ``event:`` field wins over the JSON ``event``, and the stream's own backend wins over
  the JSON ``backend`` (a stream can only speak for the backend it was opened for).
  Invalid records are counted in ``dropped`` and skipped; never fatal.
* The event is applied; only then do the counters and ``last_event_id`` move. An event
  whose ``apply`` raised is not skipped: the stream is dropped and the next connection
  asks for it again (``Last-Event-ID`` is the last *applied* event). An invalid record is
  also passed over by ``last_event_id``: asking for it again could never make it valid.
* With ``apply_many`` (the router passes ``apply_events``), the events of a slice of up to
  256 records are applied in one call: for the Redis index, one script per run of writes
  instead of a MULTI/EXEC each. When that call raises, none of the slice counts as
  applied, and the next connection asks for all of it again: at least once, which is
  exact for the index because applying an event twice changes nothing.

Resumption: every connection sends ``Last-Event-ID: <last_event_id>`` when one is known, so
the listener replays what is missing from its history ring (no duplicate, no gap), or
starts with ``resync`` + snapshot when the id is from another epoch or too old. A fresh
consumer sends none and gets ``resync`` + snapshot, so its view is complete from the start.

Overflow: :class:`bus.sse.SseOverflow` (a line or record over 1 MiB) drops the stream; the
oversized record is counted once in ``dropped`` (and ``overflows``), and the next
connection resumes from the last applied event. Records completed in the same chunk before
the overflow are not lost: they were not applied, so ``last_event_id`` still precedes them.

Backoff: after every connection that ends (error, overflow, ``event: error``, clean EOF),
the supervisor waits ``backoff.compute(failures)``. The default (:func:`default_backoff`)
starts at ``reconnect_interval_ms`` and doubles up to ``max(reconnect_interval_ms, 60 s)``.
A connection that applied at least one event resets the count (``backoff.reset()``), so
the wait after a long healthy stream is the first step again; a listener that accepts the
connection but never delivers an event keeps doubling. (A fresh connection always
delivers at least the resync record or the replay, so a healthy one always resets.)

WebSocket framing (``ws://``/``wss://`` endpoints): the listener is assumed to send the
same SSE bytes it would send on GET /events/{backend}, split into messages arbitrarily
(a message need not hold whole lines or records; text messages are UTF-8 encoded back to
bytes, binary ones are taken as is); ``Last-Event-ID`` goes in the handshake headers. The
message boundaries carry no meaning; the same parser and the same caps apply.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, fields
from datetime import UTC, datetime
from typing import Any

import aiohttp
import orjson

from bus.backoff import Backoff, ExponentialBackoff
from bus.events import EventError, KvEvent
from bus.sse import SseOverflow, SseParser, SseRecord

from ..config.models import EventSourceConfig

__all__ = [
    "ERROR_EVENT",
    "MAX_BACKOFF_S",
    "ApplyFn",
    "ApplyManyFn",
    "ConsumerError",
    "ConsumerStats",
    "EventApplyError",
    "KvEventConsumer",
    "KvEventConsumerManager",
    "SourceUnavailable",
    "StreamClosedByPeer",
    "StreamOpener",
    "StreamRejected",
    "default_backoff",
]

log = logging.getLogger("continuum.kvindex.consumer")

ERROR_EVENT = "error"
"""SSE ``event:`` of the listener's stream-ending error record (never a KvEvent)."""
MAX_BACKOFF_S = 60.0
"""Reconnect delays double up to ``max(reconnect_interval_ms, MAX_BACKOFF_S)``."""

ApplyFn = Callable[[KvEvent], Awaitable[str]]
"""Applies one event to the index; returns a label (``created``, ``evicted``, ...)."""
ApplyManyFn = Callable[[list[KvEvent]], Awaitable[Sequence[str]]]
"""Applies events in order; returns one label each."""
StreamOpener = Callable[[str | None], AsyncIterator[bytes]]
"""Opens one stream given the last applied event ID; yields raw SSE bytes until it ends."""
Clock = Callable[[], datetime]

_SSE_CONTENT_TYPE = "text/event-stream"
_YIELD_EVERY = 256
"""Records applied between yields to the event loop (about 2 ms of work)."""


def _wall_clock() -> datetime:
    return datetime.now(UTC)


def default_backoff(source: EventSourceConfig, *, jitter: float = 0.2) -> Backoff:
    """The reconnect strategy of a source: ``reconnect_interval_ms`` doubling per failure up
    to ``max(reconnect_interval_ms, 60 s)``.

    Args:
        source: The event source.
        jitter: Fraction by which each delay may be shortened at random, so that many
            routers reconnecting to a restarted listener spread out; the documented delay
            is never exceeded. 0 gives the exact sequence.
    """
    base = source.reconnect_interval_ms / 1000.0
    return ExponentialBackoff(base, max(base, MAX_BACKOFF_S), jitter)


# -- errors ------------------------------------------------------------------------------------


class ConsumerError(Exception):
    """Root of the consumer's errors; each ends one connection, none ends the consumer."""


class StreamRejected(ConsumerError):
    """The endpoint answered, but not with an event stream (status, content type)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class StreamClosedByPeer(ConsumerError):
    """The listener ended the stream with an ``event: error`` record."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"listener closed the stream: {reason}")
        self.reason = reason


class SourceUnavailable(ConsumerError):
    """Nobody offers the source yet (push mode: no live listener session announces it).

    Not a failure of a peer: the supervisor retries after the first backoff step
    (``reconnect_interval_ms``) every time, without doubling, so a stream opens soon after
    a listener connects.
    """


class EventApplyError(ConsumerError):
    """``apply`` raised; the event was not applied and will be asked for again."""

    def __init__(self, backend: str, event_id: str | None, event: str) -> None:
        super().__init__(f"applying {event} (id {event_id}) for {backend} failed")
        self.backend = backend
        self.event_id = event_id


# -- counters ----------------------------------------------------------------------------------


@dataclass(slots=True)
class ConsumerStats:
    """Counters of one event source (one backend). Counters only rise."""

    backend: str
    received: int = 0
    """Event records read from the stream (valid or not; ``event: error`` excluded)."""
    processed: int = 0
    """Events applied to the index."""
    dropped: int = 0
    """Records that could not be applied: invalid ones, and oversized ones (SseOverflow)."""
    index_created: int = 0
    """Applications labelled ``created``."""
    index_evicted: int = 0
    """Applications labelled ``evicted``."""
    resyncs: int = 0
    """``resync`` events applied (stream start, restart of the listener, expired id...)."""
    overflows: int = 0
    """Streams dropped because a line or record exceeded 1 MiB."""
    reconnects: int = 0
    """Connection attempts after the first one."""
    last_event_at: datetime | None = None
    """Wall-clock time (UTC) of the latest applied event."""
    connected: bool = False
    """True while a stream is open."""
    last_event_id: str | None = None
    """SSE id of the latest applied (or invalid, passed-over) record; sent on reconnect."""
    last_error: str | None = None
    """Why the latest connection ended, if it ended."""

    def as_dict(self) -> dict[str, Any]:
        """JSON-able copy (``last_event_at`` as ISO 8601)."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        if self.last_event_at is not None:
            d["last_event_at"] = self.last_event_at.isoformat()
        return d


# -- one source --------------------------------------------------------------------------------


def _header_safe(event_id: str | None) -> str | None:
    """The id if it can go in an HTTP header, else None (the listener then resyncs)."""
    if event_id and event_id.isascii() and event_id.isprintable():
        return event_id
    return None


@contextlib.asynccontextmanager
async def _closing(stream: AsyncIterator[bytes]) -> AsyncIterator[AsyncIterator[bytes]]:
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


class KvEventConsumer:
    """Consumes one event source until cancelled (see the module docstring).

    Args:
        source: The event source; ``backend_name`` tags every event it delivers.
        apply: Applies one event to the index and returns its label; awaited in stream
            order, one at a time.
        session: HTTP session of the built-in openers (not closed here). May be None when
            ``stream_opener`` is given.
        backoff: Reconnect strategy; default :func:`default_backoff` of ``source``.
        clock: Wall clock for ``last_event_at``.
        stream_opener: Opens one stream given the last event ID. Default: SSE over HTTP for
            ``http(s)://`` endpoints, SSE bytes in WebSocket messages for ``ws(s)://``.
            Required for ``transport: event_bus``.
        sleep: Awaited with each backoff delay (tests inject one that does not sleep).
        last_event_id: Resume from this ID (e.g. carried over a hot reload) instead of
            starting with a resync.
        read_timeout: Seconds without a byte before an open stream counts as dead; must
            exceed the listener's heartbeat interval (15 s by default). None: no limit.
        connect_timeout: Seconds to open the TCP (and TLS) connection.
        apply_many: Applies a list of events in order and returns their labels; when given,
            each slice of a chunk goes to it at once instead of event by event to ``apply``
            (see :meth:`_apply_all` for what a failure means then).

    Raises:
        ValueError: no opener for the source (``event_bus`` without ``stream_opener``, an
            ``sse`` source without an endpoint or without a session).
    """

    def __init__(
        self,
        source: EventSourceConfig,
        apply: ApplyFn,
        session: aiohttp.ClientSession | None = None,
        backoff: Backoff | None = None,
        clock: Clock = _wall_clock,
        *,
        stream_opener: StreamOpener | None = None,
        sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
        last_event_id: str | None = None,
        read_timeout: float | None = 60.0,
        connect_timeout: float = 10.0,
        apply_many: ApplyManyFn | None = None,
    ) -> None:
        self.source = source
        self.backend = source.backend_name
        self._apply = apply
        self._apply_many = apply_many
        self._session = session
        self._backoff = backoff if backoff is not None else default_backoff(source)
        self._clock = clock
        self._sleep = sleep
        self._read_timeout = read_timeout
        self._connect_timeout = connect_timeout
        self._open: StreamOpener
        if stream_opener is not None:
            self._open = stream_opener
        elif source.transport == "event_bus":
            raise ValueError(
                f"event source {self.backend}: transport event_bus requires a stream_opener"
            )
        elif source.endpoint is None:
            raise ValueError(f"event source {self.backend}: transport sse requires endpoint")
        elif session is None:
            raise ValueError(f"event source {self.backend}: an HTTP session is required")
        elif source.endpoint.startswith(("ws://", "wss://")):
            self._open = self._open_websocket
        else:
            self._open = self._open_http
        self.stats = ConsumerStats(self.backend, last_event_id=last_event_id)
        self._applied_now = 0
        self._drop_logged = False

    @property
    def last_event_id(self) -> str | None:
        return self.stats.last_event_id

    # -- supervisor ----------------------------------------------------------------------------

    async def run(self) -> None:
        """Consume until cancelled; may run once at a time per consumer.

        Each connection (:meth:`_run_once`) that ends, by error or cleanly, is logged and
        followed by ``backoff.compute(failures)`` seconds of waiting; a connection that
        applied an event first resets ``failures`` (and calls ``backoff.reset()``).

        Raises:
            asyncio.CancelledError: always propagated, from a connection or from a wait.
        """
        failures = 0
        attempts = 0
        while True:
            if attempts:
                self.stats.reconnects += 1
            attempts += 1
            self._applied_now = 0
            self._drop_logged = False
            try:
                await self._run_once()
            except SourceUnavailable as exc:
                # Flat retry, no doubling and no warning per attempt (module docstring).
                self.stats.last_error = str(exc)
                log.debug("event source %s: %s", self.backend, exc)
                await self._sleep(self._backoff.compute(1))
                continue
            except SseOverflow as exc:
                self.stats.overflows += 1
                self.stats.dropped += 1
                why = f"overflow: {exc}"
            except ConsumerError as exc:
                why = str(exc)
                if isinstance(exc, EventApplyError) and exc.__cause__ is not None:
                    why += f": {type(exc.__cause__).__name__}: {exc.__cause__}"
            except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            except Exception as exc:  # a bug in an opener or in apply's wrapper: keep going
                log.exception("event source %s: unexpected error", self.backend)
                why = f"{type(exc).__name__}: {exc}"
            else:
                why = "stream ended"
            finally:
                self.stats.connected = False
            self.stats.last_error = why
            if self._applied_now:
                failures = 0
                self._backoff.reset()
            failures += 1
            delay = self._backoff.compute(failures)
            # A stream that delivered and then ended cleanly is routine; anything else is not.
            clean = why == "stream ended" and self._applied_now
            level = logging.INFO if clean else logging.WARNING
            log.log(
                level,
                "event source %s: %s; reconnecting in %.2fs from %s (failure %d)",
                self.backend,
                why,
                delay,
                self.stats.last_event_id or "the start",
                failures,
            )
            await self._sleep(delay)

    # -- one connection ------------------------------------------------------------------------

    async def _run_once(self) -> None:
        """Open one stream from the last event ID and apply its records until it ends.

        Returns on a clean end of stream. Raises on anything that ends it otherwise
        (:class:`ConsumerError`, :class:`bus.sse.SseOverflow`, transport errors).
        """
        parser = SseParser(last_id=self.stats.last_event_id)
        async with _closing(self._open(self.stats.last_event_id)) as chunks:
            async for chunk in chunks:
                if not self.stats.connected:
                    self.stats.connected = True
                    log.info(
                        "event source %s: connected, resuming from %s",
                        self.backend,
                        self.stats.last_event_id or "the start",
                    )
                if chunk:
                    records = parser.feed(chunk)
                    if records:
                        await self._handle(records)

    async def _handle(self, records: list[SseRecord]) -> None:
        """Apply one chunk's records in order (the per-record rules: module docstring).

        This is the router's per-event hot path, so the counters live in locals and go back
        to ``stats`` at the end, also when a record ends the stream; the wall clock is read
        once per chunk. Records go in slices of ``_YIELD_EVERY``: each slice's events are
        decoded, then applied together (``apply_many``: one Redis round trip per run of
        writes), and the consumer yields to the event loop between slices. A chunk can
        hold thousands of records and an in-memory index never suspends, so without the
        yield the router's requests (and, in push mode, the gRPC call that reads the next
        StreamData ahead) would wait for the whole chunk.
        """
        st = self.stats
        backend = self.backend
        from_json = KvEvent.from_json
        received = processed = dropped = created = evicted = resyncs = 0
        last_id = st.last_event_id
        try:
            for start in range(0, len(records), _YIELD_EVERY):
                if start:
                    await asyncio.sleep(0)
                part = records[start : start + _YIELD_EVERY]
                decoded: list[KvEvent | None] = []
                closing: SseRecord | None = None
                for rec in part:
                    if rec.event == ERROR_EVENT:
                        closing = rec
                        break
                    received += 1
                    try:
                        decoded.append(from_json(rec.data, event_field=rec.event, backend=backend))
                    except EventError as exc:
                        dropped += 1
                        decoded.append(None)
                        if not self._drop_logged:
                            self._drop_logged = True
                            log.warning(
                                "event source %s: dropped an invalid record (id %s): %s; "
                                "further ones on this connection are only counted",
                                backend,
                                rec.id,
                                exc,
                            )
                labels, error = await self._apply_all([ev for ev in decoded if ev is not None])
                done = iter(labels)
                for rec, ev in zip(part, decoded, strict=False):
                    if ev is not None:
                        label = next(done, None)
                        if label is None:  # not applied: the next connection asks again
                            raise EventApplyError(backend, rec.id, ev.event) from error
                        processed += 1
                        if label == "created":
                            created += 1
                        elif label == "evicted":
                            evicted += 1
                        if ev.event == "resync":
                            resyncs += 1
                    # A record without id keeps the id in effect (SseParser carries it over);
                    # an empty ``id:`` resets it, as in EventSource: the next connection sends
                    # none. An invalid record is passed over too: asking again cannot help.
                    if rec.id is not None:
                        last_id = rec.id or None
                if closing is not None:
                    raise StreamClosedByPeer(_error_reason(closing.data))
        finally:
            st.received += received
            st.processed += processed
            st.dropped += dropped
            st.index_created += created
            st.index_evicted += evicted
            st.resyncs += resyncs
            st.last_event_id = last_id
            if processed:
                st.last_event_at = self._clock()
                self._applied_now += processed

    async def _apply_all(self, events: list[KvEvent]) -> tuple[list[str], Exception | None]:
        """Labels of the events applied, in order, and the error that stopped the rest.

        With ``apply_many`` a failure leaves it unknown how many were applied, so none
        counts as applied: the next connection asks for all of them again (applying an
        event twice changes nothing). With ``apply`` alone, exactly those before the
        failing one count.
        """
        if not events:
            return [], None
        if self._apply_many is not None:
            try:
                return list(await self._apply_many(events)), None
            except Exception as exc:
                return [], exc
        labels: list[str] = []
        apply = self._apply
        for ev in events:
            try:
                labels.append(await apply(ev))
            except Exception as exc:
                return labels, exc
        return labels, None

    # -- built-in openers ----------------------------------------------------------------------

    def _headers(self, last_event_id: str | None) -> dict[str, str]:
        headers = {"Accept": _SSE_CONTENT_TYPE, "Cache-Control": "no-cache"}
        safe = _header_safe(last_event_id)
        if safe is not None:
            headers["Last-Event-ID"] = safe
        elif last_event_id:
            log.warning(
                "event source %s: last event id %r cannot be sent; resuming with a resync",
                self.backend,
                last_event_id,
            )
        return headers

    async def _open_http(self, last_event_id: str | None) -> AsyncIterator[bytes]:
        """SSE over HTTP(S): GET the endpoint, yield the body as it arrives."""
        assert self._session is not None and self.source.endpoint is not None
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=self._connect_timeout, sock_read=self._read_timeout
        )
        async with self._session.get(
            self.source.endpoint, headers=self._headers(last_event_id), timeout=timeout
        ) as resp:
            if resp.status != 200:
                body = await resp.content.read(256)
                raise StreamRejected(
                    f"HTTP {resp.status} from {self.source.endpoint}: "
                    f"{body.decode('utf-8', 'replace')!r}",
                    resp.status,
                )
            ctype = resp.headers.get("Content-Type", "")
            if not ctype.lower().startswith(_SSE_CONTENT_TYPE):
                raise StreamRejected(
                    f"{self.source.endpoint} answered {ctype or 'no content type'!r}, "
                    f"not {_SSE_CONTENT_TYPE}",
                    resp.status,
                )
            yield b""
            async for chunk in resp.content.iter_any():
                yield chunk

    async def _open_websocket(self, last_event_id: str | None) -> AsyncIterator[bytes]:
        """SSE bytes carried in WebSocket messages (framing: module docstring)."""
        assert self._session is not None and self.source.endpoint is not None
        async with self._session.ws_connect(
            self.source.endpoint,
            headers=self._headers(last_event_id),
            timeout=aiohttp.ClientWSTimeout(ws_receive=self._read_timeout, ws_close=5.0),
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


def _error_reason(data: bytes) -> str:
    """The ``error`` field of an error record, or a short form of its data."""
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        obj = None
    if isinstance(obj, dict) and isinstance(obj.get("error"), str):
        return obj["error"]
    return data[:100].decode("utf-8", "replace") or "error"


# -- all sources -------------------------------------------------------------------------------


def _default_session() -> aiohttp.ClientSession:
    # No total timeout: streams are long-lived (each request sets its own read timeout).
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10.0))


class KvEventConsumerManager:
    """One :class:`KvEventConsumer` task per event source.

    Args:
        sources: The event sources; one per backend (a duplicate backend is skipped with an
            error log, as is a source without an opener, e.g. ``event_bus`` without
            ``stream_opener_factory``: configuration validation reports both).
        apply: Shared by every consumer; events carry their backend.
        session_factory: Creates the HTTP session the consumers share; called by
            :meth:`start`, and the session is closed by :meth:`stop`.
        backoff_factory: The reconnect strategy of a source (default :func:`default_backoff`).
        stream_opener_factory: An opener for a source, or None for the built-in one; the
            seam for push mode (``event_bus``).
        clock: Wall clock for ``last_event_at``.
        apply_many: Shared by every consumer, as ``apply`` (see :class:`KvEventConsumer`).
    """

    def __init__(
        self,
        sources: Iterable[EventSourceConfig],
        apply: ApplyFn,
        *,
        session_factory: Callable[[], aiohttp.ClientSession] = _default_session,
        backoff_factory: Callable[[EventSourceConfig], Backoff] = default_backoff,
        stream_opener_factory: Callable[[EventSourceConfig], StreamOpener | None] | None = None,
        clock: Clock = _wall_clock,
        apply_many: ApplyManyFn | None = None,
    ) -> None:
        self._sources = list(sources)
        self._apply = apply
        self._apply_many = apply_many
        self._session_factory = session_factory
        self._backoff_factory = backoff_factory
        self._opener_factory = stream_opener_factory
        self._clock = clock
        self._session: aiohttp.ClientSession | None = None
        self._consumers: dict[str, KvEventConsumer] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._started = False

    @property
    def sources(self) -> list[EventSourceConfig]:
        return list(self._sources)

    @property
    def consumers(self) -> dict[str, KvEventConsumer]:
        """The running consumers by backend name (read-only view for admin/tests)."""
        return dict(self._consumers)

    async def start(self) -> None:
        """Start one task per source. Idempotent."""
        if self._started:
            return
        self._started = True
        for src in self._sources:
            self._spawn(src, None)

    async def stop(self) -> None:
        """Cancel every consumer, wait for them, close the session. Idempotent."""
        self._started = False
        await self._cancel(list(self._tasks))
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()

    async def restart(self, sources: Iterable[EventSourceConfig]) -> None:
        """Switch to ``sources`` (hot reload): unchanged sources keep running with their
        counters; removed ones stop; new or changed ones start. A changed source keeps its
        last event ID when its endpoint and transport are unchanged (it resumes instead of
        resyncing). Before :meth:`start` this only replaces the source list.
        """
        new = list(sources)
        self._sources = new
        if not self._started:
            return
        wanted = {s.backend_name: s for s in reversed(new)}  # first one per backend wins
        carry: dict[str, str | None] = {}
        stale = []
        for name, consumer in self._consumers.items():
            src = wanted.get(name)
            if src == consumer.source:
                continue
            stale.append(name)
            old = consumer.source
            if src is not None and src.endpoint == old.endpoint and src.transport == old.transport:
                carry[name] = consumer.last_event_id
        await self._cancel(stale)
        for src in new:
            if src.backend_name not in self._consumers:
                self._spawn(src, carry.get(src.backend_name))

    def stats(self) -> dict[str, ConsumerStats]:
        """A copy of every running consumer's counters, by backend name."""
        return {name: copy.copy(c.stats) for name, c in self._consumers.items()}

    # -- internals -----------------------------------------------------------------------------

    def _spawn(self, src: EventSourceConfig, last_event_id: str | None) -> None:
        name = src.backend_name
        if name in self._consumers:
            log.error("event source %s: duplicate source for this backend, skipped", name)
            return
        opener = self._opener_factory(src) if self._opener_factory is not None else None
        session = None
        if opener is None and src.transport == "sse" and src.endpoint is not None:
            if self._session is None:
                self._session = self._session_factory()
            session = self._session
        try:
            consumer = KvEventConsumer(
                src,
                self._apply,
                session,
                self._backoff_factory(src),
                self._clock,
                stream_opener=opener,
                last_event_id=last_event_id,
                apply_many=self._apply_many,
            )
        except ValueError as exc:
            log.error("%s; not consumed", exc)
            return
        task = asyncio.get_running_loop().create_task(consumer.run(), name=f"kv-events:{name}")
        task.add_done_callback(self._on_done)
        self._consumers[name] = consumer
        self._tasks[name] = task

    async def _cancel(self, names: list[str]) -> None:
        tasks = [self._tasks.pop(n) for n in names if n in self._tasks]
        for n in names:
            self._consumers.pop(n, None)
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks)

    @staticmethod
    def _on_done(task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("%s ended unexpectedly", task.get_name(), exc_info=task.exception())
