"""KvEventConsumer: one event source's stream, applied to the KV index in order.

One :class:`KvEventConsumer` per configured event source reads that source's SSE stream
(``GET /events/{backend}`` on the listener, or the same bytes over WebSocket or the event
bus: the opener seam, ``router.ingest.opener``) and hands every event to an injected
``apply`` callable (in production ``apply_event`` bound to the index). It knows nothing of
the index beyond that callable.

Layers, so that push mode (``transport: event_bus``) plugs in without touching parsing:

* **opener** — ``StreamOpener(last_event_id) -> AsyncIterator[bytes]`` yields the raw SSE
  bytes of one connection (``router.ingest.opener``; built-in ones in
  ``router.ingest.transports``).
* **connection** — :meth:`KvEventConsumer._run_once` holds one opened stream in
  ``async with``, feeds chunks to a fresh :class:`bus.sse.SseParser` and handles records
  one at a time; it returns or raises when the stream is over.
* **supervisor** — :meth:`KvEventConsumer.run` loops over connections under the shared
  :class:`bus.supervisor.Supervisor`, with an injected :class:`bus.backoff.Backoff`
  between them. ``asyncio.CancelledError`` always propagates.

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
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, fields
from datetime import UTC, datetime
from typing import Any

import aiohttp
import orjson

from bus.backoff import Backoff, ExponentialBackoff
from bus.errors import BUFFER_OVERFLOW, ERROR_EVENT
from bus.events import EventError, KvEvent
from bus.sse import SseOverflow, SseParser, SseRecord
from bus.supervisor import Attempt, Supervisor, Verdict

from ..config.models import EventSourceConfig
from .errors import ConsumerError, EventApplyError, SourceUnavailable, StreamClosedByPeer
from .opener import StreamOpener, closing_stream
from .transports import builtin_opener

__all__ = [
    "MAX_BACKOFF_S",
    "ApplyFn",
    "ApplyManyFn",
    "Clock",
    "ConsumerStats",
    "EndResyncFn",
    "KvEventConsumer",
    "default_backoff",
    "wall_clock",
]

# The logger's name predates this package; kept so that log configs keep working.
log = logging.getLogger("continuum.kvindex.consumer")

MAX_BACKOFF_S = 60.0
"""Reconnect delays double up to ``max(reconnect_interval_ms, MAX_BACKOFF_S)``."""

ApplyFn = Callable[[KvEvent], Awaitable[str]]
"""Applies one event to the index; returns a label (``created``, ``evicted``, ...)."""
ApplyManyFn = Callable[[list[KvEvent]], Awaitable[Sequence[str]]]
"""Applies events in order; returns one label each."""
EndResyncFn = Callable[[str], Awaitable[None]]
"""Called with the backend once the last record of a resync's snapshot is applied."""
Clock = Callable[[], datetime]

_YIELD_EVERY = 256
"""Records applied between yields to the event loop (about 2 ms of work)."""


def wall_clock() -> datetime:
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
    stream_overflows: int = 0
    """Streams the listener closed with ``buffer_overflow``: the router read too slowly
    (backpressure); the next connection resumes from the last applied event."""
    resync_losses: int = 0
    """``resync`` events that replaced state this consumer already held (a resume the
    listener's ring could no longer answer, or the listener's own reset): events were
    lost upstream and the snapshot restated the state. The first stream's resync is not
    counted."""
    reconnects: int = 0
    """Connection attempts after the first one. A wait for a source that is not there
    yet (push mode: no listener session for the backend) is not an attempt: it polls
    every ``reconnect_interval_ms`` and would count a long partition by the thousand."""
    last_event_at: datetime | None = None
    """Wall-clock time (UTC) of the latest applied event."""
    connected: bool = False
    """True while a stream is open."""
    last_event_id: str | None = None
    """SSE id of the latest applied (or invalid, passed-over) record; sent on reconnect."""
    last_error: str | None = None
    """Why the latest connection ended, if it ended."""
    view_incomplete: bool = False
    """The latest ``resync`` said the backend's state may lack entries (its listener
    resumed from a checkpoint and could not replay every event of its downtime)."""

    def as_dict(self) -> dict[str, Any]:
        """JSON-able copy (``last_event_at`` as ISO 8601)."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        if self.last_event_at is not None:
            d["last_event_at"] = self.last_event_at.isoformat()
        return d


# -- one source --------------------------------------------------------------------------------


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
        end_resync: Called with the backend right after the last snapshot record of a
            ``resync`` that said its ``snapshot_size`` (> 0) was applied, before any later
            record; when it raises, that last record counts as not applied and is asked
            for again.

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
        clock: Clock = wall_clock,
        *,
        stream_opener: StreamOpener | None = None,
        sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
        last_event_id: str | None = None,
        read_timeout: float | None = 60.0,
        connect_timeout: float = 10.0,
        apply_many: ApplyManyFn | None = None,
        end_resync: EndResyncFn | None = None,
    ) -> None:
        self.source = source
        self.backend = source.backend_name
        self._apply = apply
        self._apply_many = apply_many
        self._end_resync = end_resync
        self._snapshot_left: int | None = None
        """Snapshot records still to come after a sized ``resync`` (None: not in one).
        Kept across connections: a shared resync block resumes from the history ring."""
        self._clock = clock
        self._open: StreamOpener = (
            stream_opener
            if stream_opener is not None
            else builtin_opener(
                source, session, connect_timeout=connect_timeout, read_timeout=read_timeout
            )
        )
        self.stats = ConsumerStats(self.backend, last_event_id=last_event_id)
        self._supervisor = Supervisor(
            self._connection,
            self._classify,
            backoff=backoff if backoff is not None else default_backoff(source),
            sleep=sleep,
            on_retry=self._on_retry,
        )
        self._applied_now = 0
        """Events applied by the current connection."""
        self._waiting = False
        """The last attempt found the source unavailable (``RETRY_FLAT``)."""
        self._drop_logged = False
        self.applying = False
        """A chunk's records are being applied: the index may be ahead of
        ``last_event_id`` (which moves when the chunk is done)."""

    @property
    def last_event_id(self) -> str | None:
        return self.stats.last_event_id

    # -- supervisor ----------------------------------------------------------------------------

    async def run(self) -> None:
        """Consume until cancelled; may run once at a time per consumer.

        A :class:`bus.supervisor.Supervisor` runs the connections (:meth:`_connection`):
        each that ends, by error or cleanly, is logged and followed by
        ``backoff.compute(failures)`` seconds of waiting; one that applied an event resets
        ``failures`` (and calls ``backoff.reset()``); :class:`SourceUnavailable` waits the
        first step without counting a failure.

        Raises:
            asyncio.CancelledError: always propagated, from a connection or from a wait.
        """
        await self._supervisor.run()

    async def _connection(self) -> None:
        if self._supervisor.attempts > 1 and not self._waiting:
            self.stats.reconnects += 1
        self._drop_logged = False
        self._applied_now = 0
        try:
            await self._run_once()
        finally:
            self.stats.connected = False
            if self._applied_now:  # healthy: it applied events (reported as it ends)
                self._supervisor.healthy()

    def _classify(self, exc: Exception | None) -> Verdict:
        """Why the connection ended (``stats.last_error``); only "unavailable" is flat."""
        if isinstance(exc, SourceUnavailable):
            return Verdict.RETRY_FLAT
        if exc is None:
            why = "stream ended"
        elif isinstance(exc, SseOverflow):
            self.stats.overflows += 1
            self.stats.dropped += 1
            why = f"overflow: {exc}"
        elif isinstance(exc, ConsumerError):
            why = str(exc)
            if (
                isinstance(exc, StreamClosedByPeer)
                and exc.reason.split(" ", 1)[0] == BUFFER_OVERFLOW
            ):
                self.stats.stream_overflows += 1
            if isinstance(exc, EventApplyError) and exc.__cause__ is not None:
                why += f": {type(exc.__cause__).__name__}: {exc.__cause__}"
        elif isinstance(exc, (aiohttp.ClientError, OSError, TimeoutError)):
            why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        else:  # a bug in an opener or in apply's wrapper: keep going
            log.exception("event source %s: unexpected error", self.backend)
            why = f"{type(exc).__name__}: {exc}"
        self.stats.last_error = why
        return Verdict.RETRY

    def _on_retry(self, attempt: Attempt) -> None:
        self._waiting = attempt.verdict is Verdict.RETRY_FLAT
        if self._waiting:
            # No doubling and no warning per attempt (module docstring).
            self.stats.last_error = str(attempt.error)
            log.debug("event source %s: %s", self.backend, attempt.error)
            return
        # A stream that delivered and then ended cleanly is routine; anything else is not.
        clean = attempt.error is None and attempt.healthy
        log.log(
            logging.INFO if clean else logging.WARNING,
            "event source %s: %s; reconnecting in %.2fs from %s (failure %d)",
            self.backend,
            self.stats.last_error,
            attempt.delay,
            self.stats.last_event_id or "the start",
            attempt.failures,
        )

    # -- one connection ------------------------------------------------------------------------

    async def _run_once(self) -> None:
        """Open one stream from the last event ID and apply its records until it ends.

        Returns on a clean end of stream. Raises on anything that ends it otherwise
        (:class:`ConsumerError`, :class:`bus.sse.SseOverflow`, transport errors).
        """
        parser = SseParser(last_id=self.stats.last_event_id)
        async with closing_stream(self._open(self.stats.last_event_id)) as chunks:
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
        received = processed = dropped = created = evicted = resyncs = losses = 0
        last_id = st.last_event_id
        self.applying = True
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
                labels, error = await self._apply_blocks([ev for ev in decoded if ev is not None])
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
                            if last_id is not None:
                                losses += 1
                            st.view_incomplete = ev.incomplete
                    # A record without id keeps the id in effect (SseParser carries it over);
                    # an empty ``id:`` resets it, as in EventSource: the next connection sends
                    # none. An invalid record is passed over too: asking again cannot help.
                    if rec.id is not None:
                        last_id = rec.id or None
                if closing is not None:
                    raise StreamClosedByPeer(_error_reason(closing.data))
        finally:
            self.applying = False
            st.received += received
            st.processed += processed
            st.dropped += dropped
            st.index_created += created
            st.index_evicted += evicted
            st.resyncs += resyncs
            st.resync_losses += losses
            st.last_event_id = last_id
            if processed:
                st.last_event_at = self._clock()
                self._applied_now += processed

    async def _apply_blocks(self, events: list[KvEvent]) -> tuple[list[str], Exception | None]:
        """``_apply_all``, cut after the last record of a sized resync's snapshot so that
        ``end_resync`` runs between it and the next record."""
        labels: list[str] = []
        start = 0
        while start < len(events):
            left = self._snapshot_left
            cut = None
            for i in range(start, len(events)):
                left = _snapshot_step(left, events[i])
                if left == 0:
                    cut = i
                    break
            end = len(events) if cut is None else cut + 1
            part = events[start:end]
            got, error = await self._apply_all(part)
            labels += got
            for ev in part[: len(got)]:
                self._snapshot_left = _snapshot_step(self._snapshot_left, ev)
            if error is not None:
                return labels, error
            if cut is not None:
                self._snapshot_left = None
                if self._end_resync is not None:
                    try:
                        await self._end_resync(self.backend)
                    except Exception as exc:
                        self._snapshot_left = 1  # the last record comes again
                        return labels[:-1], exc
            start = end
        return labels, None

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


def _snapshot_step(left: int | None, ev: KvEvent) -> int | None:
    """Snapshot records still to come after ``ev`` (0: ``ev`` was the last one)."""
    if ev.event == "resync":
        return ev.snapshot_size or None
    if left is None or left == 0:
        return None
    return left - 1


def _error_reason(data: bytes) -> str:
    """The ``error`` field of an error record, or a short form of its data."""
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        obj = None
    if isinstance(obj, dict) and isinstance(obj.get("error"), str):
        return obj["error"]
    return data[:100].decode("utf-8", "replace") or "error"
