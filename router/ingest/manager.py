"""KvEventConsumerManager: one consumer task per configured event source.

The manager owns the HTTP session the built-in openers share (created when the first
``sse`` source needs it, closed by :meth:`KvEventConsumerManager.stop`), asks an injected
``stream_opener_factory`` for each source's opener (the seam through which push mode's
event bus hands its own), and on a hot reload (:meth:`KvEventConsumerManager.restart`)
keeps unchanged sources running with their counters and resumes changed ones from their
last event ID when their endpoint and transport are unchanged.
"""

from __future__ import annotations

import asyncio
import copy
import logging
from collections.abc import Callable, Iterable

import aiohttp

from bus.backoff import Backoff
from bus.tasks import cancel_and_wait

from ..config.models import EventSourceConfig
from ..http.tls import client_context
from .consumer import (
    ApplyFn,
    ApplyManyFn,
    Clock,
    ConsumerStats,
    EndResyncFn,
    KvEventConsumer,
    default_backoff,
    wall_clock,
)
from .opener import StreamOpener

__all__ = ["KvEventConsumerManager"]

# The logger's name predates this package; kept so that log configs keep working.
log = logging.getLogger("continuum.kvindex.consumer")


def _default_session() -> aiohttp.ClientSession:
    # No total timeout: streams are long-lived (each request sets its own read timeout).
    return aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=10.0),
        connector=aiohttp.TCPConnector(ssl=client_context()),  # https:// listeners: TLS 1.2+
    )


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
        end_resync: Shared by every consumer, called with the backend (see
            :class:`KvEventConsumer`).
    """

    def __init__(
        self,
        sources: Iterable[EventSourceConfig],
        apply: ApplyFn,
        *,
        session_factory: Callable[[], aiohttp.ClientSession] = _default_session,
        backoff_factory: Callable[[EventSourceConfig], Backoff] = default_backoff,
        stream_opener_factory: Callable[[EventSourceConfig], StreamOpener | None] | None = None,
        clock: Clock = wall_clock,
        apply_many: ApplyManyFn | None = None,
        end_resync: EndResyncFn | None = None,
    ) -> None:
        self._sources = list(sources)
        self._apply = apply
        self._apply_many = apply_many
        self._end_resync = end_resync
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

    async def resync(self, backends: Iterable[str] | None = None) -> list[str]:
        """Start every running stream (of ``backends``, default all) over without its last
        event ID, so each listener answers ``resync`` + snapshot and the backend's entries
        are rebuilt whole. For an index that lost what it held (a Redis restarted empty):
        resuming would only bring what came after the router's position. Counters carry
        over; returns the backends.
        """
        if not self._started:
            return []
        old = dict(self._consumers)
        if backends is not None:
            wanted = set(backends)
            old = {name: c for name, c in old.items() if name in wanted}
        await self._cancel(list(old))
        for name, consumer in old.items():
            self._spawn(consumer.source, None)
            new = self._consumers.get(name)
            if new is not None:
                stats = consumer.stats
                stats.last_event_id = None
                stats.connected = False
                new.stats = stats
        return list(old)

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
                read_timeout=src.read_timeout_ms / 1000,
                apply_many=self._apply_many,
                end_resync=self._end_resync,
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
        # cancel_and_wait cancels again a consumer that lost its cancellation inside a
        # Redis write (bus.tasks): a single wait would hang the resync and the stop.
        await cancel_and_wait(*tasks)

    @staticmethod
    def _on_done(task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("%s ended unexpectedly", task.get_name(), exc_info=task.exception())
